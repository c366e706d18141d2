"""Can GRPO measurably improve a tiny warm-started model on the arith task, fast, on 2 CPU cores?

A standalone, minimal GRPO loop in plain torch + transformers ``generate`` (no Ray, no
vLLM), used to choose the defaults of ``flowrl.tasks.arith`` (task difficulty) and
``flowrl.models.warmstart`` (model size, warm-start length) and the GRPO settings the
default flow uses. The question: after a short supervised warm start leaves the model
partway (15-45% held-out greedy accuracy), does RL alone lift held-out accuracy by at
least 30 points, with warm start + RL well under 10 minutes?

GRPO as implemented here (one readable function each):

* reward: 1.0 when the completion equals the answer (``exact`` verifier), else 0.0;
* advantage of sample j in the group of prompt i: ``(r_ij - mean_i) / (std_i + eps)``;
* loss: token-level PPO-clip, ``-min(ratio * A, clip(ratio, 1-eps, 1+eps) * A)`` averaged
  over all response tokens of the batch (each token weighs the same), no KL term.

Usage::

    .venv/bin/python bench/rl_feasibility.py                 # the chosen defaults
    .venv/bin/python bench/rl_feasibility.py --rl-steps 80 --group 8 --json out.json

Prints a table of held-out accuracy over RL steps and writes the numbers as JSON
(default ``bench/results/rl_feasibility.json``).

Chosen settings (the defaults of this script, of ``ArithSpec`` and of ``SFTConfig``):
``"ab+cd="`` with zero-padded operands 0..99 (4000 train / 400 test rows); Llama
hidden 128, 2 layers, 4 heads (2 KV), MLP 256 (~0.3M params); warm start AdamW lr 3e-3,
weight decay 0.1, batch 64, until greedy accuracy on 512 training rows reaches 30%,
checked every 10 steps (seed 0: 1150 steps); GRPO 64 prompts x 8 completions, lr 5e-4,
temperature 1, one update per batch, 300 steps.

Why the warm start stops where it does. The model learns addition in a sudden
transition: held-out accuracy sits near 8% on a plateau, then climbs within ~150 steps
(seed 2: 12% at step 700, 28% at 800, 61% at 875), and the plateau ends at a step that
depends on the seed (~470 for seed 1, ~800 for seed 2, ~1100 for seed 0, with weight
decay 0.1; without it seed 1 was still on the plateau after 3000 steps). GRPO from the
plateau learns nothing (from 6-8%: 7-9% after 100 steps; from 12%: 14% after 125 steps);
from 28% it reached 86% after 150. So the warm start stops on accuracy, not on a step
count, and checks it often and exactly (every 10 steps, 512 rows, one teacher-forced
forward pass): the old rule (20% on 256 rows, every 50 steps) stopped at 19% held-out on
one CPU and 27% on another, since 50 steps of the transition move accuracy by tens of
points. The three seeds stop at 28-34% held-out (bit-reproducible on one machine).

Measured (seed 0, 1 torch thread, 2-core machine with a load of 8-11 from other jobs, so
its seconds are not representative): warm start 1150 steps → 34.3% held-out; GRPO →
76.0% after 200 steps, 83.3% after 300 (+49.0 points). ``flowrl run
flows/arith_grpo.flow`` (vLLM + torch engines) after 200 steps: seed 0 34.2% → 79.8%,
seed 1 33.8% → 66.5%, seed 2 28.2% → 88.8%; the slowest, seed 1, reached 72.5% after 300,
so the default flow runs 300 steps. Tried on seed 1 and dropped: RL lr 1e-3 (57.8% after
200 steps), two minibatches per step (67.5%), 32 prompts x 16 (no faster here). Two torch
threads were slower than one on this machine (spinning OpenMP threads when other
processes compete for the cores).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowrl.data.sampler import BatchSampler  # noqa: E402
from flowrl.models.tiny import build_tiny_model, load_tokenizer  # noqa: E402
from flowrl.models.warmstart import SFTConfig, TinyModelConfig, evaluate_accuracy, sft_train  # noqa: E402
from flowrl.rewards.verifiers import exact_match  # noqa: E402
from flowrl.tasks import arith  # noqa: E402


@dataclass(frozen=True)
class GRPOSettings:
    """The RL half of the experiment."""

    steps: int = 300
    """GRPO iterations (one rollout batch each)."""
    prompts_per_step: int = 64
    """Distinct prompts per rollout batch."""
    group: int = 8
    """Completions per prompt (GRPO group size)."""
    lr: float = 5e-4
    """AdamW learning rate of the policy (3e-3, the SFT rate, collapsed the policy)."""
    temperature: float = 1.0
    """Sampling temperature of rollouts."""
    updates: int = 1
    """Optimizer steps per rollout batch (PPO epochs over the whole batch)."""
    clip: float = 0.2
    """PPO ratio clip epsilon."""
    eps: float = 1e-6
    """Added to the group std before dividing."""
    eval_every: int = 25
    """Held-out greedy accuracy every this many steps."""


def group_advantages(rewards: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    """GRPO advantages. ``rewards``: ``[P * G]`` (groups contiguous) → ``[P * G]``."""
    r = rewards.view(-1, group)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)
    return adv.view(-1)


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` log p(input_ids[b, t] | input_ids[b, :t]); position 0 is 0 (types.py convention)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    lp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)


def ppo_clip_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip: float,
    n_tokens: float,
) -> torch.Tensor:
    """Token-level PPO-clip, summed and divided by ``n_tokens`` (response tokens in the whole batch).

    ``logprobs``/``old_logprobs``/``mask``: ``[B, T]``; ``advantages``: ``[B]``. Scalar.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None]
    per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
    return (per_token * mask).sum() / max(n_tokens, 1.0)


@torch.no_grad()
def rollout(model, tokenizer, prompts: list[str], group: int, temperature: float, max_new_tokens: int):
    """Sample ``group`` completions per prompt.

    Returns ``(input_ids [B, T], attention_mask [B, T], response_mask [B, T], texts [B])``
    with ``B = len(prompts) * group``, rows of a prompt contiguous, right-padded as in
    ``flowrl.engines.types.TokenBatch`` (response = generated tokens up to and including EOS).
    """
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    out = model.generate(
        **enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
        num_return_sequences=group, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    width = enc.input_ids.shape[1]
    prompt_ids = enc.input_ids.repeat_interleave(group, dim=0)
    prompt_mask = enc.attention_mask.repeat_interleave(group, dim=0)
    gen = out[:, width:]
    # Response length: through the first EOS, else all generated tokens.
    is_eos = gen == tokenizer.eos_token_id
    first_eos = is_eos.int().argmax(1)  # 0 when there is no EOS: fixed by the where below
    resp_len = torch.where(is_eos.any(1), first_eos + 1, torch.full_like(first_eos, gen.shape[1]))
    rows, resp_masks = [], []
    for i in range(gen.shape[0]):
        p = prompt_ids[i][prompt_mask[i].bool()]
        r = gen[i, : resp_len[i]]
        rows.append(torch.cat([p, r]))
        resp_masks.append(torch.cat([torch.zeros(len(p)), torch.ones(len(r))]))
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    rmask = torch.zeros((len(rows), T))
    for i, (r, m) in enumerate(zip(rows, resp_masks)):
        ids[i, : len(r)], attn[i, : len(r)], rmask[i, : len(r)] = r, 1, m
    texts = tokenizer.batch_decode(gen, skip_special_tokens=True)
    return ids, attn, rmask, texts


def grpo(model, tokenizer, train, test, s: GRPOSettings, *, seed: int, max_new_tokens: int):
    """Run GRPO in place; returns a list of ``{step, seconds, train_reward, test_acc}`` records."""
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0, betas=(0.9, 0.99))
    sampler = BatchSampler(len(train), s.prompts_per_step, seed=seed)
    log = [{"step": 0, "seconds": 0.0, "train_reward": None,
            "test_acc": evaluate_accuracy(model, test, tokenizer=tokenizer, max_new_tokens=max_new_tokens)}]
    t0 = time.perf_counter()
    rewards_window: list[float] = []
    for step in range(1, s.steps + 1):
        rows = sampler.next_rows(train)
        model.eval()
        ids, attn, rmask, texts = rollout(model, tokenizer, [r["prompt"] for r in rows], s.group, s.temperature, max_new_tokens)
        answers = [r["answer"] for r in rows for _ in range(s.group)]
        rewards = torch.tensor(exact_match(texts, answers))
        rewards_window.append(float(rewards.mean()))
        adv = group_advantages(rewards, s.group, s.eps)
        # Rows with zero advantage (groups whose rewards are all equal) add exactly 0 to the
        # loss: skip their forward/backward, but divide by the whole batch's token count so
        # the loss is the plain token mean over the full batch.
        n_tokens = float(rmask.sum())
        keep = adv.abs() > 0
        if keep.any():
            ids, attn, rmask, adv = ids[keep], attn[keep], rmask[keep], adv[keep]
            with torch.no_grad():
                old = token_logprobs(model, ids, attn)
            model.train()
            for _ in range(s.updates):
                loss = ppo_clip_loss(token_logprobs(model, ids, attn), old, adv, rmask, s.clip, n_tokens)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        if step % s.eval_every == 0 or step == s.steps:
            seconds = time.perf_counter() - t0
            acc = evaluate_accuracy(model, test, tokenizer=tokenizer, max_new_tokens=max_new_tokens)
            log.append({"step": step, "seconds": round(seconds, 2),
                        "train_reward": round(sum(rewards_window) / len(rewards_window), 4), "test_acc": acc})
            print(f"  rl step {step:4d}  {seconds:7.1f} s  train reward {log[-1]['train_reward']:.3f}  "
                  f"test acc {acc:.3f}  samples {texts[:4]}", flush=True)
            rewards_window = []
            t0 += time.perf_counter() - t0 - seconds  # exclude evaluation time from RL seconds
    return log


def warm_started(a, spec, model_cfg, sft, train):
    """``(model, tokenizer, wall seconds, CPU seconds)`` of the warm start (from ``--sft-cache`` if there)."""
    key = hashlib.sha256(json.dumps([asdict(spec), a.n_train, a.n_test, asdict(model_cfg), asdict(sft), a.seed],
                                    sort_keys=True).encode()).hexdigest()[:16]
    cached = a.sft_cache / key if a.sft_cache else None
    if cached and (cached / "timing.json").is_file():
        timing = json.loads((cached / "timing.json").read_text())
        model = AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32)
        return model, load_tokenizer(cached), timing["wall"], timing["cpu"], timing["steps"]
    t0, c0 = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_model(tmp, chars=arith.CHARS, seed=a.seed, **asdict(model_cfg))
        tokenizer = load_tokenizer(tmp)
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    losses = sft_train(model, tokenizer, train, sft, seed=a.seed)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"warm start: {len(losses)} steps, final loss {losses[-1]:.3f}", flush=True)
    if cached:
        model.save_pretrained(cached)
        tokenizer.save_pretrained(cached)
        (cached / "timing.json").write_text(json.dumps({"wall": wall, "cpu": cpu, "steps": len(losses)}))
    return model, tokenizer, wall, cpu, len(losses)


def parse_args(argv=None):
    d_spec, d_model, d_sft, d_rl = arith.ArithSpec(), TinyModelConfig(), SFTConfig(), GRPOSettings()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-operand", type=int, default=d_spec.max_operand)
    ap.add_argument("--ops", default=d_spec.ops)
    ap.add_argument("--no-zero-pad", action="store_true")
    ap.add_argument("--n-train", type=int, default=arith.DEFAULT_TRAIN)
    ap.add_argument("--n-test", type=int, default=arith.DEFAULT_TEST)
    ap.add_argument("--hidden", type=int, default=d_model.hidden)
    ap.add_argument("--layers", type=int, default=d_model.layers)
    ap.add_argument("--heads", type=int, default=d_model.heads)
    ap.add_argument("--kv-heads", type=int, default=d_model.kv_heads)
    ap.add_argument("--intermediate", type=int, default=d_model.intermediate)
    ap.add_argument("--sft-steps", type=int, default=d_sft.steps)
    ap.add_argument("--sft-batch", type=int, default=d_sft.batch_size)
    ap.add_argument("--sft-lr", type=float, default=d_sft.lr)
    ap.add_argument("--sft-wd", type=float, default=d_sft.weight_decay)
    ap.add_argument("--sft-check-every", type=int, default=d_sft.check_every)
    ap.add_argument("--sft-check-rows", type=int, default=d_sft.check_rows)
    ap.add_argument("--sft-stop-at", type=float, default=d_sft.stop_at_accuracy,
                    help="stop the warm start at this training-row accuracy (negative: run all steps)")
    ap.add_argument("--rl-steps", type=int, default=d_rl.steps)
    ap.add_argument("--prompts", type=int, default=d_rl.prompts_per_step)
    ap.add_argument("--group", type=int, default=d_rl.group)
    ap.add_argument("--rl-lr", type=float, default=d_rl.lr)
    ap.add_argument("--temperature", type=float, default=d_rl.temperature)
    ap.add_argument("--updates", type=int, default=d_rl.updates)
    ap.add_argument("--eval-every", type=int, default=d_rl.eval_every)
    ap.add_argument("--seed", type=int, default=0, help="model init and warm-start seed")
    ap.add_argument("--rl-seed", type=int, default=None, help="RL sampling seed (default: --seed)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: tiny ops gain little from 2, and on a busy machine "
                         "spinning OpenMP threads waste CPU)")
    ap.add_argument("--sft-cache", type=Path, default=None,
                    help="reuse the warm-started model from this folder (keyed by task/model/SFT/seed) to sweep RL settings")
    ap.add_argument("--json", type=Path, default=Path("bench/results/rl_feasibility.json"))
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    spec = arith.ArithSpec(max_operand=a.max_operand, ops=a.ops, zero_pad=not a.no_zero_pad)
    model_cfg = TinyModelConfig(hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads, intermediate=a.intermediate)
    sft = SFTConfig(steps=a.sft_steps, batch_size=a.sft_batch, lr=a.sft_lr, weight_decay=a.sft_wd,
                    stop_at_accuracy=None if a.sft_stop_at < 0 else a.sft_stop_at, check_every=a.sft_check_every,
                    check_rows=a.sft_check_rows)
    rl = GRPOSettings(steps=a.rl_steps, prompts_per_step=a.prompts, group=a.group, lr=a.rl_lr,
                      temperature=a.temperature, updates=a.updates, eval_every=a.eval_every)
    train, test = arith.make_splits(a.n_train, a.n_test, arith.DEFAULT_SEED, spec=spec)
    max_new = 5
    print(f"task {spec}  train {len(train)}  test {len(test)}\nmodel {model_cfg}\nsft {sft}\ngrpo {rl}", flush=True)

    model, tokenizer, sft_seconds, sft_cpu, sft_steps = warm_started(a, spec, model_cfg, sft, train)
    acc0 = evaluate_accuracy(model, test, tokenizer=tokenizer, max_new_tokens=max_new)
    print(f"warm start: {sft_steps} steps, {sft_seconds:.1f} s ({sft_cpu:.1f} CPU s), test acc {acc0:.3f}", flush=True)

    t1, c1 = time.perf_counter(), time.process_time()
    rl_seed = a.seed if a.rl_seed is None else a.rl_seed
    log = grpo(model, tokenizer, train, test, rl, seed=rl_seed, max_new_tokens=max_new)
    rl_wall, rl_cpu = time.perf_counter() - t1, time.process_time() - c1
    acc1 = log[-1]["test_acc"]
    result = {
        "task": asdict(spec), "n_train": len(train), "n_test": len(test), "model": asdict(model_cfg),
        "sft": asdict(sft), "grpo": asdict(rl), "seed": a.seed, "rl_seed": rl_seed, "threads": a.threads,
        "sft_steps_taken": sft_steps, "sft_seconds": round(sft_seconds, 1), "sft_cpu_seconds": round(sft_cpu, 1), "acc_after_sft": acc0,
        "rl_seconds": log[-1]["seconds"], "rl_wall_seconds_with_evals": round(rl_wall, 1),
        "rl_cpu_seconds_with_evals": round(rl_cpu, 1),
        "acc_after_rl": acc1, "gain_points": round(100 * (acc1 - acc0), 1), "log": log,
    }
    print("\n| stage       | seconds | held-out acc |\n|-------------|---------|--------------|")
    print(f"| warm start  | {sft_seconds:7.1f} | {acc0:12.3f} |")
    print(f"| + GRPO      | {log[-1]['seconds']:7.1f} | {acc1:12.3f} |")
    print(f"gain: {result['gain_points']:+.1f} points; CPU seconds: warm start {sft_cpu:.1f}, RL+evals {rl_cpu:.1f}")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
