"""Train-engine benchmark: the torch engine and the megatron engine on the same model and batch.

For each engine / layout it builds the engine on one tiny Llama checkpoint (built locally,
like every model here), runs ``--warmup`` training steps, then times ``--steps`` more,
each a full ``train_step`` (forward, backward over micro-batches, grad sync, clip, AdamW)
on the same right-padded batch with a policy-gradient + entropy loss. It reports

* ``step_s``: median wall seconds per step,
* ``tokens_per_s``: real (non-padding) tokens of the batch / ``step_s``,
* ``start_s``: seconds to build the engine (the megatron engine forks its rank processes
  from a preloaded fork server; the first megatron engine of a process pays the imports),
* ``forward_s``: median seconds of a no-grad ``forward`` (logprobs + entropy).

Every process gets ``--threads`` torch threads (default 1): on a loaded 2-core machine
more intra-op threads than free cores made the same step 10-30x slower (spin-waiting),
which would measure the machine, not the engines. A megatron layout with 2 ranks uses
2 cores, the torch engine 1.

Prints a table and writes ``bench/results/train_engines.json``.

Usage::

    .venv/bin/python bench/train_engines.py [--steps 5] [--warmup 2] [--rows 32] [--width 64]
        [--hidden 128] [--layers 2] [--layouts tp1,tp2,pp2,dp2] [--threads 1] [--out PATH]

On a 2-core CPU machine the megatron layouts with 2 ranks run one thread per rank; the
numbers measure the engines' overheads on a toy model, not Megatron's GPU throughput.
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

from flowrl.engines.torch_train import OptimConfig, TorchTrainEngine  # noqa: E402
from flowrl.engines.types import TokenBatch  # noqa: E402
from flowrl.models.tiny import build_tiny_model  # noqa: E402

LAYOUTS = {
    "tp1": {"tp": 1, "pp": 1, "dp": 1},
    "tp2": {"tp": 2, "pp": 1, "dp": 1},
    "pp2": {"tp": 1, "pp": 2, "dp": 1},
    "dp2": {"tp": 1, "pp": 1, "dp": 2},
}
"""Megatron layouts the benchmark knows (``--layouts`` picks among them)."""


def make_batch(rows: int, width: int, vocab: int, seed: int = 0) -> TokenBatch:
    """Right-padded random rows (a 4-token prompt, a response, padding) with random advantages."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(width // 2, width + 1, (rows,), generator=g)
    attn = (torch.arange(width)[None] < lengths[:, None]).long()
    ids = torch.randint(4, vocab, (rows, width), generator=g) * attn
    resp = ((torch.arange(width)[None] >= 4) & (attn > 0)).float()
    adv = torch.randn(rows, width, generator=g) * resp
    return TokenBatch(ids, attn, resp, {"advantages": adv})


def pg_loss(outputs: dict, mb: TokenBatch, denom: dict) -> torch.Tensor:
    """Token-mean policy gradient with a 0.01 entropy bonus over the global token count."""
    mask = mb.response_mask
    return (-(outputs["logprobs"] * mb.extras["advantages"] * mask).sum()
            - 0.01 * (outputs["entropy"] * mask).sum()) / denom["tokens"]


def measure(engine, batch: TokenBatch, steps: int, warmup: int, micro: int) -> dict:
    """Median forward and train-step seconds of ``engine`` on ``batch``."""
    for _ in range(warmup):
        engine.train_step(batch, pg_loss, micro_batch_size=micro)
    times, fwd = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        stats = engine.train_step(batch, pg_loss, micro_batch_size=micro)
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        engine.forward(batch, entropy=True, micro_batch_size=micro)
        fwd.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens = int(batch.attention_mask.sum())
    return {"step_s": step_s, "forward_s": statistics.median(fwd), "tokens_per_s": tokens / step_s,
            "tokens_per_step": tokens, "last_loss": float(stats["loss"])}


def run(args: argparse.Namespace) -> list[dict]:
    rows: list[dict] = []
    optim = OptimConfig(lr=1e-4, max_grad_norm=1.0)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_model(tmp, hidden=args.hidden, layers=args.layers, heads=args.hidden // 32,
                                    kv_heads=max(1, args.hidden // 64), intermediate=2 * args.hidden))
        vocab = json.loads(Path(path, "config.json").read_text())["vocab_size"]
        batch = make_batch(args.rows, args.width, vocab)
        torch.set_num_threads(args.threads)
        t0 = time.perf_counter()
        torch_engine = TorchTrainEngine(path, optim=optim)
        start = time.perf_counter() - t0
        rows.append({"engine": "torch", "layout": "1 process", "processes": 1, "threads": args.threads,
                     "start_s": start,
                     **measure(torch_engine, batch, args.steps, args.warmup, args.micro)})
        del torch_engine
        from flowrl.engines.megatron import MegatronTrainEngine

        for name in args.layouts.split(","):
            layout = LAYOUTS[name]
            t0 = time.perf_counter()
            with MegatronTrainEngine(path, optim=optim, threads=args.threads, **layout) as engine:
                start = time.perf_counter() - t0
                world = layout["tp"] * layout["pp"] * layout["dp"]
                label = ", ".join(f"{k}={v}" for k, v in layout.items())
                rows.append({"engine": "megatron", "layout": label, "processes": world, "threads": args.threads,
                             "start_s": start,
                             **measure(engine, batch, args.steps, args.warmup, args.micro)})
    return rows


def print_table(rows: list[dict]) -> None:
    header = (f"{'engine':<9} {'layout':<16} {'procs':>5} {'thr':>3} {'start s':>8} {'step s':>8} {'fwd s':>7} "
              f"{'tokens/s':>9}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['engine']:<9} {r['layout']:<16} {r['processes']:>5} {r['threads']:>3} {r['start_s']:>8.2f} "
              f"{r['step_s']:>8.3f} {r['forward_s']:>7.3f} {r['tokens_per_s']:>9.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--micro", type=int, default=8, help="micro-batch rows")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--layouts", default="tp1,tp2,pp2,dp2")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per process (the torch engine and each megatron rank)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "train_engines.json"))
    args = parser.parse_args()
    unknown = sorted(set(args.layouts.split(",")) - set(LAYOUTS))
    if unknown:
        parser.error(f"unknown layout(s) {unknown}; choose from {sorted(LAYOUTS)}")
    rows = run(args)
    print_table(rows)
    meta = {"machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "cuda": torch.cuda.is_available(), "args": vars(args)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
