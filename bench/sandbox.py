"""Sandbox throughput: trivial programs per second through ``SandboxPool`` vs plain ``subprocess``.

Both sides run the same trivial Python program (``print(sum(range(100)))``) with the same
interpreter (``/usr/bin/python3``) and the same number of programs in flight, in one
process run, alternating rounds so that a change in the machine's load hits both:

* ``subprocess``: ``subprocess.run([python3, "-c", src])`` from ``--workers`` threads: no
  isolation at all, the floor of what starting a Python program costs here;
* ``sandbox``: :class:`flowrl.sandbox.SandboxPool` with ``--workers`` workers, every layer
  its self-check found active (uid, rlimits, network namespace, seccomp, bubblewrap, ...).

Prints a table (programs/s and median latency per side and worker count, best of
``--rounds``), the active layers, the CPU count and the 1-minute load average before and
after; writes ``bench/results/sandbox.json``. Target: >= 100 programs/s on 2 cores.

Usage::

    .venv/bin/python bench/sandbox.py [--programs 200] [--workers 2,4] [--rounds 3] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrl.sandbox import SandboxPool  # noqa: E402
from flowrl.sandbox.types import PYTHON  # noqa: E402

SOURCE = "print(sum(range(100)))"
EXPECTED = "4950\n"


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run_subprocess(programs: int, workers: int) -> tuple[float, list[float]]:
    """(seconds for all, per-program latencies) with plain subprocess.run from ``workers`` threads."""

    def one(_: int) -> float:
        t = time.perf_counter()
        out = subprocess.run([PYTHON, "-E", "-s", "-B", "-c", SOURCE], capture_output=True, text=True).stdout
        assert out == EXPECTED, out
        return time.perf_counter() - t

    with ThreadPoolExecutor(workers) as ex:
        t = time.perf_counter()
        latencies = list(ex.map(one, range(programs)))
        return time.perf_counter() - t, latencies


def run_sandbox(pool: SandboxPool, programs: int) -> tuple[float, list[float]]:
    """(seconds for all, per-program wall times) through the pool, all submitted at once."""
    t = time.perf_counter()
    futures = [pool.submit(SOURCE) for _ in range(programs)]
    results = [f.result() for f in futures]
    elapsed = time.perf_counter() - t
    bad = [r for r in results if r.stdout != EXPECTED]
    assert not bad, bad[0]
    return elapsed, [r.wall_s for r in results]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--programs", type=int, default=200, help="programs per round and side")
    ap.add_argument("--workers", default="2,4", help="comma-separated numbers of programs in flight")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per side (best is reported)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "sandbox.json"))
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    rows, layers = [], None
    for workers in [int(w) for w in args.workers.split(",")]:
        with SandboxPool(workers) as pool:
            layers = pool.layers
            run_sandbox(pool, workers * 2)  # warm up (page cache, first bubblewrap)
            best = {"subprocess": None, "sandbox": None}
            for _ in range(args.rounds):
                for side in ("subprocess", "sandbox"):
                    if side == "sandbox":
                        elapsed, lat = run_sandbox(pool, args.programs)
                    else:
                        elapsed, lat = run_subprocess(args.programs, workers)
                    if best[side] is None or elapsed < best[side][0]:
                        best[side] = (elapsed, lat)
            for side, (elapsed, lat) in best.items():
                rows.append({"side": side, "workers": workers, "programs": args.programs,
                             "seconds": round(elapsed, 3), "per_s": round(args.programs / elapsed, 1),
                             "median_ms": round(1000 * statistics.median(lat), 1)})
    load_after = os.getloadavg()[0]
    print(f"{'side':<11} {'workers':>7} {'programs':>8} {'seconds':>8} {'programs/s':>10} {'median ms':>9}")
    for r in rows:
        print(f"{r['side']:<11} {r['workers']:>7} {r['programs']:>8} {r['seconds']:>8.2f} {r['per_s']:>10.1f} "
              f"{r['median_ms']:>9.1f}")
    print("layers: " + ", ".join(f"{layer.name}={'on' if layer.active else 'OFF'}" for layer in layers))
    print(f"cpus {os.cpu_count()}, 1-min load average {load_before:.2f} before, {load_after:.2f} after"
          f"{' (busy machine: numbers are pessimistic)' if max(load_before, load_after) > (os.cpu_count() or 1) else ''}")
    out = {"bench": "sandbox", "program": SOURCE, "interpreter": PYTHON, "rounds": args.rounds, "rows": rows,
           "layers": {layer.name: layer.active for layer in layers}, "euid": os.geteuid(),
           "cpus": os.cpu_count(), "load_before": load_before, "load_after": load_after,
           "python": platform.python_version(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
