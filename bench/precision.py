"""fp32, mixed bf16 and pure bf16 training on the arithmetic task: learning and trainer/rollout mismatch.

The default flow's model and task (``tiny(task = "arith")``, warm-started by SFT and cached; the
shipped ``data/arith`` splits; an exact-answer reward) trained by GRPO with flowrl's own engines in
this process, one precision after the other, with the same budget and seeds:

* ``fp32``: ``dtype = "float32"`` (trainer and rollout engine in fp32);
* ``mixed``: ``dtype = "bfloat16"`` (the default ``precision = "mixed"``): the trainer computes in
  bf16, AdamW updates fp32 masters, the rollout engine serves the bf16 casts;
* ``pure``: ``dtype = "bfloat16", precision = "pure"``: weights, gradients and moments in bf16.

The trainer is :class:`~flowrl.engines.torch_train.TorchTrainEngine`, the rollout engine
:class:`~flowrl.engines.torch_rollout.TorchRolloutEngine` (``hf_generate``) in the same dtype, the
weights synced after every step (``update_weights(named_weights())``). GRPO: group-normalised
rewards, token-level PPO-clip (0.2) against the trainer's own log-probs of the batch, no KL, the
default flow's lr 5e-4. Reported per precision: held-out greedy accuracy before and after (the
first ``--eval`` rows of ``data/arith/test.jsonl``), the trainer-vs-rollout log-prob mismatch of
the sampled tokens (mean and max |trainer - rollout| over the run's response tokens: both engines
hold the same weights, so this is the arithmetic's difference alone), wall seconds and the
1-minute load average. Writes ``bench/results/precision.json`` (``--out``).

Usage::

    .venv/bin/python bench/precision.py                      # 40 steps x 32 prompts x 8 samples each
    .venv/bin/python bench/precision.py --steps 10 --markdown
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PRECISIONS = (("fp32", "float32", "mixed"), ("mixed", "bfloat16", "mixed"), ("pure", "bfloat16", "pure"))
"""(label, dtype, precision) of each run."""


@dataclass
class Result:
    label: str
    dtype: str
    precision: str
    accuracy_before: float
    accuracy_after: float
    mismatch_mean: float
    mismatch_max: float
    reward_first: float
    reward_last: float
    wall_s: float
    load_before: float
    load_after: float


def _rows(split: str) -> list[dict]:
    return [json.loads(line) for line in (ROOT / "data" / "arith" / f"{split}.jsonl").read_text().splitlines()
            if line.strip()]


def tiny_arith(seed: int) -> str:
    """The default flow's warm-started tiny arith model (the cache ``flowrl run`` uses), built if absent."""
    from flowrl.warmcache import cached, task_model_config, task_sft

    cfg, sft = task_model_config("arith"), task_sft("arith")
    result = cached("arith", cfg, sft, seed)[0]
    if result is None:
        from flowrl.models.warmstart import warm_start

        result = warm_start("arith", model_cfg=cfg, sft=sft, seed=seed)
    return str(result.path)


def _text(rollout, completion) -> str:
    ids = [t for t in completion.response_ids if t not in rollout.eos_ids]
    return rollout.tokenizer.decode(ids).strip()


def accuracy(rollout, prompts: list[list[int]], answers: list[str]) -> float:
    from flowrl.engines.types import SamplingSpec

    out = rollout.generate(prompts, SamplingSpec(n=1, temperature=0.0, max_tokens=5, seed=0))
    return sum(_text(rollout, g[0]) == a for g, a in zip(out, answers)) / len(answers)


def grpo_loss(outputs, micro, denominator, clip: float = 0.2):
    """Token-level PPO-clip against ``extras["old_logprobs"]`` with per-row ``extras["advantages"]``."""
    import torch

    ratio = torch.exp(outputs["logprobs"] - micro.extras["old_logprobs"])
    adv = micro.extras["advantages"][:, None]
    per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
    return (per_token * micro.response_mask).sum() / denominator["tokens"]


def run(label: str, dtype: str, precision: str, model: str, args) -> Result:
    import torch

    from flowrl.engines.torch_rollout import TorchRolloutEngine
    from flowrl.engines.torch_train import OptimConfig, TorchTrainEngine
    from flowrl.engines.types import SamplingSpec, TokenBatch

    torch.manual_seed(args.seed)
    load_before, t0 = os.getloadavg()[0], time.time()
    trainer = TorchTrainEngine(model, dtype=dtype, precision=precision, seed=args.seed,
                               optim=OptimConfig(lr=args.lr, max_grad_norm=1.0))
    rollout = TorchRolloutEngine(model, dtype=dtype, seed=args.seed)
    tok = rollout.tokenizer
    encode = lambda text: tok(text, add_special_tokens=True)["input_ids"]  # noqa: E731
    test = _rows("test")[: args.eval]
    test_prompts, test_answers = [encode(r["prompt"]) for r in test], [r["answer"] for r in test]
    train = _rows("train")
    before = accuracy(rollout, test_prompts, test_answers)
    rng = random.Random(args.seed)
    gaps, rewards = [], []
    for step in range(args.steps):
        rows = rng.sample(train, args.batch)
        groups = rollout.generate([encode(r["prompt"]) for r in rows],
                                  SamplingSpec(n=args.group, temperature=1.0, max_tokens=5, seed=args.seed + step))
        reward = torch.tensor([[float(_text(rollout, c) == r["answer"]) for c in g] for g, r in zip(groups, rows)])
        adv = (reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-6)
        batch = TokenBatch.from_completions([c for g in groups for c in g], pad_id=rollout.pad_id)
        trained = trainer.forward(batch, micro_batch_size=args.micro_batch)["logprobs"]
        mask = batch.response_mask.bool()
        gaps.append((trained[mask] - batch.extras["rollout_logprobs"][mask]).abs())
        rewards.append(float(reward.mean()))
        batch = TokenBatch(batch.input_ids, batch.attention_mask, batch.response_mask,
                           {**batch.extras, "old_logprobs": trained, "advantages": adv.flatten()})
        trainer.train_step(batch, grpo_loss, micro_batch_size=args.micro_batch)
        rollout.update_weights(trainer.named_weights())
    after = accuracy(rollout, test_prompts, test_answers)
    gap = torch.cat(gaps)
    last = max(1, len(rewards) // 5)
    return Result(label, dtype, precision, before, after, float(gap.mean()), float(gap.max()),
                  sum(rewards[:last]) / last, sum(rewards[-last:]) / last, time.time() - t0, load_before,
                  os.getloadavg()[0])


def table(results: list[Result], markdown: bool = False) -> str:
    head = ["precision", "hf(dtype, precision)", "held-out before", "after", "gain (points)",
            "train reward first/last fifth", "log-prob mismatch mean", "max", "wall s", "load 1m before/after"]
    rows = [[r.label, f"{r.dtype}, {r.precision}" if r.dtype != "float32" else "float32",
             f"{100 * r.accuracy_before:.1f}%", f"{100 * r.accuracy_after:.1f}%",
             f"{100 * (r.accuracy_after - r.accuracy_before):+.1f}", f"{r.reward_first:.3f} / {r.reward_last:.3f}",
             f"{r.mismatch_mean:.2e}", f"{r.mismatch_max:.2e}", f"{r.wall_s:.0f}",
             f"{r.load_before:.1f} / {r.load_after:.1f}"] for r in results]
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in [head, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--micro-batch", type=int, default=128)
    parser.add_argument("--eval", type=int, default=400, help="held-out rows scored (greedy)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="comma-separated labels (fp32,mixed,pure)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "precision.json"))
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model = tiny_arith(args.seed)
    wanted = set(filter(None, args.only.split(",")))
    results = []
    for label, dtype, precision in PRECISIONS:
        if wanted and label not in wanted:
            continue
        results.append(run(label, dtype, precision, model, args))
        print(table(results[-1:]), flush=True)
    print(table(results, markdown=args.markdown))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"settings": vars(args), "results": [asdict(r) for r in results]},
                                         indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
