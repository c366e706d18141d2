"""Routing replay (R3): the train/rollout log-prob mismatch of a mixture of experts with and without
replaying vLLM's routes in the torch trainer, and how many routes differ.

For each model (tiny checkpoints built here: hidden 128, 2 layers, std-0.1 init as in the family
tests) and each vLLM dtype (the trainer is fp32), vLLM samples ``--prompts`` x ``--n`` completions of
up to ``--tokens`` tokens with routes (``SamplingSpec(routes=True)``: its routers' own expert ids,
captured on CPU); the torch trainer then computes the sampled tokens' log-probs with its own routing
(``native``) and with vLLM's (``replay``). Reported:

* ``native`` / ``replay``: max (mean) |trainer - vLLM| log-prob over the response tokens, nats;
* ``differ``: token-layers whose vLLM top-k set differs from the trainer's own router's (native
  forward), of all token-layers with a route (prompt and response tokens but each sequence's last).

Models: ``moe`` (8 experts, top-2: the shipped flow's shape), ``near_tied`` (the same with its router
weights scaled by ``--tie-scale``, so that the top-2 logits of a token are often closer than bf16's
rounding of them: a router early in training, or one of the many 128-expert routers whose k-th and
(k+1)-th experts are close), ``dense`` (Qwen3 without experts: the dense families' level).

Prints a table and writes ``bench/results/routing_replay.json``.

Usage::

    .venv/bin/python bench/routing_replay.py [--prompts 32] [--n 4] [--tokens 24] [--tie-scale 0.02]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from flowrl.engines.route_replay import moe_routers, router_top_k  # noqa: E402
from flowrl.engines.torch_train import TorchTrainEngine  # noqa: E402
from flowrl.engines.types import ROUTES, SamplingSpec, TokenBatch  # noqa: E402

CHARS = "0123456789+-=abcdefgh"


def build(out: Path, arch: str, router_scale: float = 1.0, seed: int = 0) -> str:
    """A tiny random checkpoint of ``arch`` (std-0.1 init); the routers' weights times ``router_scale``."""
    from flowrl.models.families import model_class
    from flowrl.models.tiny import build_tokenizer, tiny_config

    tokenizer = build_tokenizer(CHARS)
    config = tiny_config(len(tokenizer), arch=arch)
    config.initializer_range = 0.1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(arch)(config).to(torch.float32)
    with torch.no_grad():
        for router in moe_routers(model):
            router.weight.mul_(router_scale)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def gap(lp: torch.Tensor, batch: TokenBatch) -> tuple[float, float]:
    mask = batch.response_mask.bool()
    d = (lp - batch.extras["rollout_logprobs"])[mask].abs()
    return float(d.max()), float(d.mean())


def measure(path: str, dtype: str, args, moe: bool) -> dict:
    from flowrl.engines.vllm_engine import VLLMRolloutEngine

    g = torch.Generator().manual_seed(1)
    prompts = [[1] + torch.randint(4, 4 + len(CHARS), (6,), generator=g).tolist() for _ in range(args.prompts)]
    spec = SamplingSpec(n=args.n, temperature=1.0, max_tokens=args.tokens, seed=3, routes=moe)
    rollout = VLLMRolloutEngine(path, dtype=dtype, max_model_len=64)
    try:
        completions = [c for group in rollout.generate(prompts, spec) for c in group]
    finally:
        rollout.shutdown()
    batch = TokenBatch.from_completions(completions, pad_id=0)
    trainer = TorchTrainEngine(path)
    row = {"dtype": dtype, "response_tokens": int(batch.response_mask.sum())}
    if not moe:
        row["native"] = gap(trainer.forward(batch)["logprobs"], batch)
        return row
    routes = batch.extras[ROUTES]
    out = trainer.forward(batch)
    row["replay"] = gap(out["logprobs"], batch)
    has = (routes[..., 0] >= 0) & batch.attention_mask.bool()[..., None]
    own = router_top_k(trainer.model, batch.input_ids, batch.attention_mask)
    row["differ"] = int(((routes.long().sort(-1).values != own.sort(-1).values).any(-1) & has).sum())
    row["routed"] = int(has.sum())
    row["differ_in_replayed_forward"] = int(out["routes_differ"].sum())  # what routing/differ logs
    del batch.extras[ROUTES]
    row["native"] = gap(trainer.forward(batch)["logprobs"], batch)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--tie-scale", type=float, default=0.02)
    ap.add_argument("--out", default=str(REPO / "bench/results/routing_replay.json"))
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("FLOWRL_THREADS") or 1))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {"moe": build(Path(tmp) / "moe", "qwen3_moe"),
                  "near_tied": build(Path(tmp) / "tied", "qwen3_moe", router_scale=args.tie_scale),
                  "dense": build(Path(tmp) / "dense", "qwen3")}
        for name, path in models.items():
            for dtype in ("float32", "bfloat16"):
                row = {"model": name, **measure(path, dtype, args, moe=name != "dense")}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n| model | vLLM dtype | native: max (mean) | replay: max (mean) | routes differing |")
    print("|---|---|---|---|---|")
    for r in rows:
        rep = f"{r['replay'][0]:.2g} ({r['replay'][1]:.2g})" if "replay" in r else "-"
        differ = f"{r['differ']} of {r['routed']}" if "differ" in r else "-"
        print(f"| {r['model']} | {r['dtype']} | {r['native'][0]:.2g} ({r['native'][1]:.2g}) | {rep} | {differ} |")
    Path(args.out).write_text(json.dumps({"rows": rows, "args": vars(args), "machine": platform.node(),
                                          "load_avg": os.getloadavg(), "cpus": os.cpu_count()}, indent=1))
    print(f"wrote {args.out}; load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
