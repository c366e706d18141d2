"""Packing benchmark: padded micro-batches vs token-budget micro-batches vs packed rows.

On one long-tailed batch (most completions a few to a few tens of tokens, a tail of a few hundred)
the torch train engine takes full ``train_step``s (forward, backward over micro-batches, clip,
AdamW) three ways (:mod:`flowrl.engines.batching`):

* ``padded``: ``--micro`` rows per micro-batch, each padded to its longest row (the default path);
* ``tokens``: micro-batches of at most ``--budget`` real tokens (``micro_batch_tokens``), rows of
  like lengths together, so little padding;
* ``packed``: the same micro-batches, each run as one row (``pack = true``): no padding, attention
  kept within each sequence by a block-diagonal mask.

It reports the median step seconds, real tokens/s (the batch's non-padding tokens / step
seconds), the padding share of the token slots run (``pad_fraction``), the micro-batches per step,
and the loss and grad norm of the first step (equal across modes up to float rounding: the
denominators are the whole batch's). One torch thread (``--threads``): on a loaded 2-core machine
more threads than free cores measure the machine, not the batching.

Prints a table and writes ``bench/results/packing.json``.

Usage::

    .venv/bin/python bench/packing.py [--rows 64] [--micro 8] [--budget 1024] [--steps 3]
        [--warmup 1] [--hidden 256] [--layers 4] [--threads 1] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from flowrl.engines import batching  # noqa: E402
from flowrl.engines.torch_train import OptimConfig, TorchTrainEngine  # noqa: E402
from flowrl.engines.types import TokenBatch  # noqa: E402
from flowrl.models.tiny import build_tiny_model  # noqa: E402

MODES = {"padded": {}, "tokens": {"pack": False}, "packed": {"pack": True}}
"""Mode -> the train_step keywords beyond the micro-batch size (``tokens``/``packed`` add the budget)."""


def long_tailed_lengths(rows: int, longest: int, seed: int = 0) -> list[int]:
    """Row lengths from a few tokens to ``longest``: log-uniform, so most are short and a few long."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(rows, generator=g)
    return [int(x) for x in (6 * (longest / 6) ** u).round().clamp(6, longest).tolist()]


def make_batch(lengths: list[int], vocab: int, seed: int = 0) -> TokenBatch:
    """Right-padded random rows (a 4-token prompt, the rest response) with random advantages."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    attn = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(4, vocab, (len(lengths), width), generator=g) * attn
    resp = ((torch.arange(width)[None] >= 4) & (attn > 0)).float()
    adv = torch.randn(len(lengths), width, generator=g) * resp
    return TokenBatch(ids, attn, resp, {"advantages": adv})


def pg_loss(outputs: dict, mb: TokenBatch, denom: dict) -> torch.Tensor:
    """Token-mean policy gradient with a 0.01 entropy bonus over the global token count."""
    mask = mb.response_mask
    return (-(outputs["logprobs"] * mb.extras["advantages"] * mask).sum()
            - 0.01 * (outputs["entropy"] * mask).sum()) / denom["tokens"]


def run(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(args.threads)
    optim = OptimConfig(lr=1e-4)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_model(tmp, hidden=args.hidden, layers=args.layers, heads=args.hidden // 64,
                                    kv_heads=max(1, args.hidden // 128), intermediate=2 * args.hidden,
                                    max_position=args.longest))
        vocab = json.loads(Path(path, "config.json").read_text())["vocab_size"]
        lengths = long_tailed_lengths(args.rows, args.longest)
        batch = make_batch(lengths, vocab)
        real = sum(lengths)
        for mode, kw in MODES.items():
            budget = args.budget if mode != "padded" else 0
            engine = TorchTrainEngine(path, optim=optim)
            params = sum(p.numel() for p in engine.model.parameters())
            times, first = [], None
            for i in range(args.warmup + args.steps):
                t0 = time.perf_counter()
                stats = engine.train_step(batch, pg_loss, micro_batch_size=args.micro, micro_batch_tokens=budget,
                                          **kw)
                if i >= args.warmup:
                    times.append(time.perf_counter() - t0)
                first = first or stats
            plan = batching.plan_ranks(lengths, 1, max_rows=args.micro, max_tokens=budget,
                                       padded=not kw.get("pack", False))[0]
            step = statistics.median(times)
            rows.append({"mode": mode, "micro_batch": args.micro, "budget": budget, "micro_batches": len(plan),
                         "pad_fraction": first["pad_fraction"], "step_s": step, "tokens_per_s": real / step,
                         "loss_step1": first["loss"], "grad_norm_step1": first["grad_norm"], "params": params,
                         "real_tokens": real, "rows": args.rows, "longest": max(lengths), "shortest": min(lengths)})
            del engine
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base
    return rows


def print_table(rows: list[dict]) -> None:
    r0 = rows[0]
    print(f"{r0['rows']} rows, {r0['real_tokens']} real tokens (lengths {r0['shortest']}-{r0['longest']}), "
          f"model {r0['params'] / 1e6:.1f}M params")
    print(f"{'mode':8} {'micro-batches':>13} {'pad %':>6} {'step s':>7} {'tokens/s':>9} {'speed-up':>8} "
          f"{'loss (step 1)':>14} {'grad norm':>10}")
    for r in rows:
        print(f"{r['mode']:8} {r['micro_batches']:>13} {100 * r['pad_fraction']:>6.1f} {r['step_s']:>7.2f} "
              f"{r['tokens_per_s']:>9.0f} {r['speedup']:>7.2f}x {r['loss_step1']:>14.7f} {r['grad_norm_step1']:>10.6f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--longest", type=int, default=384, help="longest row (tokens); the shortest is 6")
    p.add_argument("--micro", type=int, default=8, help="rows per micro-batch of the padded mode")
    p.add_argument("--budget", type=int, default=1024, help="real tokens per micro-batch of the other modes")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "packing.json"))
    args = p.parse_args()
    load_before = os.getloadavg()[0]
    rows = run(args)
    print_table(rows)
    out = {"rows": rows, "args": vars(args), "load_1min": [load_before, os.getloadavg()[0]],
           "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "torch": torch.__version__}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
