"""Compile-time benchmark of the front end: ``check_file`` on real and generated flows.

Measures the wall time of ``check_file`` (parse, imports, every pass, every flow of the
file) for

* every ``stdlib/*.flow`` and ``flows/*.flow`` (globbed when the benchmark runs), and
* generated programs of about 10, 100, 1,000 and 10,000 ops: chains of
  sample -> generate -> score -> logprobs -> advantage blocks over several models (each
  model updated once, as the language requires), a third of them written inline, the
  rest through nested flow calls (``main -> pair -> block``).

For each size it reports the ops in the compiled graph, the time (best of ``--repeat``
runs), the time per op, and the growth ratio ``t(n) / t(n / 10)`` (10.0 is linear growth).
Prints a table and writes ``bench/results/compile.json``.

Usage::

    .venv/bin/python bench/compile.py [--repeat 3] [--sizes 10,100,1000,10000] [--out PATH]

Acceptance target: near-linear growth, and 1,000 ops checked in under 2 s.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrl.compiler.pipeline import check_file  # noqa: E402
from flowrl.diagnostics import FlowError  # noqa: E402
from flowrl.catalog.ops import RESOURCE_KINDS  # noqa: E402

OPS_PER_BLOCK = 5
"""sample, generate, score, logprobs, group_advantage."""
BLOCKS_PER_MODEL = 8
"""Blocks sharing one model."""
UPDATE_OPS = 5
"""Each model's single update (the language allows one per step) and its own inputs:
sample, generate, score, group_advantage, update."""


def generate_program(target_ops: int) -> str:
    """A valid flow file whose entry flow ``main`` compiles to about ``target_ops`` ops.

    One model per ``BLOCKS_PER_MODEL`` blocks. A third of the blocks are written inline,
    the rest are inlined from ``block`` directly or through ``pair`` (which calls
    ``block`` twice), so flow calls nest two deep.
    """
    per_model = BLOCKS_PER_MODEL * OPS_PER_BLOCK + UPDATE_OPS
    n_models = max(1, round(target_ops / per_model))
    n_blocks = max(1, round((target_ops - n_models * UPDATE_OPS) / OPS_PER_BLOCK))
    # The shipped dataset by absolute path: programs are written to a temporary folder, and
    # `flowrl check` checks the file exists and reads its first row.
    lines = [f'dataset arith = jsonl("{REPO / "data" / "arith" / "train.jsonl"}")', 'reward exact = verifier("math")']
    lines += [f'model m{i} = tiny(task = "arith", seed = {i})' for i in range(n_models)]
    lines += [
        "",
        "flow block(m: model, d: dataset, rw: reward, n: int = 4) {",
        "  b   = sample(d, size = 8)",
        "  r   = generate(m, b, n = n)",
        "  s   = rw(r)",
        "  lp  = logprobs(m, r)",
        "  adv = group_advantage(s, group = n)",
        "  return adv",
        "}",
        "",
        "flow pair(m: model, d: dataset, rw: reward) {",
        "  first  = block(m, d, rw)",
        "  second = block(m, d, rw, n = 2)",
        "  return second",
        "}",
        "",
        "flow main() {",
    ]
    k = 0
    for mi in range(n_models):
        m = f"m{mi}"
        end = n_blocks if mi == n_models - 1 else min(n_blocks, k + BLOCKS_PER_MODEL)
        while k < end:
            if k % 3 == 0:  # inline
                lines += [f"  b{k} = sample(arith, size = 8)", f"  r{k} = generate({m}, b{k}, n = 4)",
                          f"  s{k} = exact(r{k})", f"  lp{k} = logprobs({m}, r{k})",
                          f"  adv{k} = group_advantage(s{k}, group = 4)"]
                k += 1
            elif k % 3 == 1 and end - k >= 2:  # two blocks through pair -> block
                lines.append(f"  p{k} = pair({m}, arith, exact)")
                k += 2
            else:
                lines.append(f"  c{k} = block({m}, arith, exact)")
                k += 1
        lines += [f"  ub{mi} = sample(arith, size = 8)", f"  ur{mi} = generate({m}, ub{mi}, n = 4)",
                  f"  us{mi} = exact(ur{mi})", f"  ua{mi} = group_advantage(us{mi}, group = 4)",
                  f"  update({m}, ur{mi}, ua{mi}, loss = pg())"]
    lines.append("}")
    return "\n".join(lines) + "\n"


def time_check(path: Path, repeat: int) -> tuple[float, dict]:
    """Best wall time (s) of ``check_file(path)`` over ``repeat`` runs, and the graphs' sizes."""
    best, sizes = float("inf"), {}
    for _ in range(repeat):
        t0 = time.perf_counter()
        try:
            graphs = check_file(path)
            error = None
        except FlowError as e:
            graphs, error = {}, e.render().splitlines()[0]
        best = min(best, time.perf_counter() - t0)
        sizes = {name: sum(1 for n in g.nodes() if n.kind not in RESOURCE_KINDS) for name, g in graphs.items()}
        if error:
            sizes["error"] = error
    return best, sizes


def bench_files(repeat: int) -> list[dict]:
    rows = []
    for pattern in ("stdlib/*.flow", "flows/*.flow"):
        for path in sorted(REPO.glob(pattern)):
            seconds, sizes = time_check(path.relative_to(REPO), repeat)
            ops = sum(v for v in sizes.values() if isinstance(v, int))
            rows.append({"file": str(path.relative_to(REPO)), "ops": ops, "seconds": seconds,
                         "lines": path.read_text().count("\n"), "error": sizes.get("error")})
    return rows


def bench_generated(sizes: list[int], repeat: int, workdir: Path) -> list[dict]:
    rows = []
    for target in sizes:
        path = workdir / f"gen_{target}.flow"
        text = generate_program(target)
        path.write_text(text)
        seconds, graph_sizes = time_check(path, repeat)
        if "error" in graph_sizes:
            raise SystemExit(f"generated program of {target} ops does not compile: {graph_sizes['error']}")
        ops = graph_sizes["main"]
        prev = rows[-1] if rows else None
        rows.append({"target_ops": target, "ops": ops, "lines": text.count("\n"), "seconds": seconds,
                     "us_per_op": seconds / ops * 1e6,
                     "growth": (seconds / prev["seconds"]) if prev else None,
                     "ops_ratio": (ops / prev["ops"]) if prev else None})
    return rows


def print_tables(files: list[dict], generated: list[dict]) -> None:
    print(f"{'file':<36} {'ops':>6} {'lines':>6} {'ms':>9}")
    for r in files:
        note = f"  ERROR {r['error']}" if r["error"] else ""
        print(f"{r['file']:<36} {r['ops']:>6} {r['lines']:>6} {r['seconds'] * 1e3:>9.1f}{note}")
    print()
    print(f"{'target':>7} {'ops':>7} {'lines':>7} {'seconds':>9} {'us/op':>8} {'growth':>8} {'ops x':>7}")
    for r in generated:
        growth = f"{r['growth']:.2f}" if r["growth"] else "-"
        ratio = f"{r['ops_ratio']:.2f}" if r["ops_ratio"] else "-"
        print(f"{r['target_ops']:>7} {r['ops']:>7} {r['lines']:>7} {r['seconds']:>9.3f} {r['us_per_op']:>8.1f} "
              f"{growth:>8} {ratio:>7}")
    print("(growth = time / time of the previous size; equal to `ops x` when growth is linear)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs per input; the best is kept")
    ap.add_argument("--sizes", default="10,100,1000,10000", help="generated program sizes, in ops")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "compile.json"))
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    files = bench_files(args.repeat)
    with tempfile.TemporaryDirectory(prefix="flowrl-bench-") as d:
        generated = bench_generated(sizes, args.repeat, Path(d))
    print_tables(files, generated)
    by_size = {r["target_ops"]: r for r in generated}
    result = {
        "benchmark": "compile", "python": platform.python_version(), "machine": platform.machine(),
        "repeat": args.repeat, "files": files, "generated": generated,
        "target": {"ops_1000_under_s": 2.0,
                   "ops_1000_seconds": by_size.get(1000, {}).get("seconds"),
                   "met": by_size.get(1000, {}).get("seconds", 0.0) < 2.0},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
