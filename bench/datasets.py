"""Large datasets: `flowrl check` time and a run's driver memory over a synthetic JSON-lines file.

Writes a synthetic arithmetic JSON-lines file of ``--gb`` GB (default 10) under /tmp (refused where
the disk has less than the size plus 2 GB free: name a smaller ``--gb``), then:

* ``flowrl check`` on a flow naming it, as a user runs it (a fresh process, imports included), best
  and median of ``--repeats``, and ``check_file`` in a warm process (the check alone); the check reads
  the file's first rows only (``check_head``, ``check_datasets``, the plan's workload: at most 64 rows);
* ``flowrl run --steps N`` over it (a tiny local model, vLLM and the torch trainer on Ray), sampling
  the driver process's resident memory (``VmRSS``) and its peak (``VmHWM``) from /proc every 0.1 s;
  the file passes 256 MiB, so the run streams it (``stream = "auto"``): it holds one window of
  blocks, never the file. The same run over a 1 MB file is the baseline, so the table shows what
  the large file adds to the driver.

The file and the runs' folders are deleted afterwards. Prints a table (with the 1-minute load
average before and after, and the CPU count) and writes ``bench/results/datasets.json``.
Target (issue 33): the check under 2 s, the driver under 1 GB.

Usage::

    .venv/bin/python bench/datasets.py [--gb 10] [--steps 2] [--repeats 3] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
FLOWRL = [sys.executable, "-m", "flowrl.cli"]

FLOW = """import stdlib.grpo
model policy = hf("model")
dataset big = jsonl("DATA", eval = "test.jsonl")
reward exact = verifier("exact")
flow main(steps: int = 2) {
  grpo(policy, big, exact, batch = 4, group = 2, max_tokens = 4, lr = 3e-3, kl = 0.0, seed = 1)
}
"""


def write_data(path: Path, size: int) -> int:
    """A JSON-lines file of ``size`` bytes or a little more (arithmetic rows, a chunk written again and
    again); returns its rows."""
    from flowrl.tasks.arith import make_split

    rows = make_split(8_000, 11)
    chunk = "".join(json.dumps({**r, "id": i, "note": "x" * (i % 64)}) + "\n" for i, r in enumerate(rows)).encode()
    per_chunk = len(rows)
    written = n = 0
    with open(path, "wb") as f:
        while written < size:
            f.write(chunk)
            written += len(chunk)
            n += per_chunk
    return n


def timed_check(flow: Path, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        done = subprocess.run(FLOWRL + ["check", str(flow)], capture_output=True, text=True, cwd=flow.parent)
        out.append(time.perf_counter() - t)
        if done.returncode != 0:
            raise SystemExit(f"flowrl check failed:\n{done.stdout}{done.stderr}")
    return out


def timed_check_in_process(flow: Path, repeats: int) -> list[float]:
    """``check_file`` in this process, after a first call (imports and caches warm): what the check itself
    costs, without starting Python (each call reads the file again: its cached reads are keyed by
    modification time, which is touched before each)."""
    from flowrl.compiler.pipeline import check_file

    data = next(p for p in flow.parent.glob(flow.stem + ".jsonl"))
    check_file(str(flow))
    out = []
    for _ in range(repeats):
        os.utime(data)  # a new version: no read cached from the call before
        t = time.perf_counter()
        check_file(str(flow))
        out.append(time.perf_counter() - t)
    return out


def _status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes (empty once it has exited)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def run_memory(flow: Path, steps: int) -> dict:
    """Peak driver RSS of ``flowrl run`` over ``flow``, sampled from /proc."""
    out_dir = flow.parent / f"run-{flow.stem}"
    t = time.perf_counter()
    proc = subprocess.Popen(FLOWRL + ["run", str(flow), "--steps", str(steps), "--out", str(out_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=flow.parent)
    peak = hwm = 0
    while proc.poll() is None:
        s = _status(proc.pid)
        peak, hwm = max(peak, s.get("VmRSS", 0)), max(hwm, s.get("VmHWM", 0))
        time.sleep(0.1)
    output = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"flowrl run failed ({proc.returncode}):\n{output[-4000:]}")
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {"seconds": round(time.perf_counter() - t, 1), "rss_peak_mb": round(peak / 2**20, 1),
            "hwm_mb": round(hwm / 2**20, 1), "steps": [m["step"] for m in metrics if "reward/mean" in m]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=10.0, help="size of the synthetic file in GB (10^9 bytes)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "datasets.json"))
    args = ap.parse_args()
    size = int(args.gb * 1e9)
    free = shutil.disk_usage(tempfile.gettempdir()).free
    if free < size + 2e9:
        raise SystemExit(f"{tempfile.gettempdir()} has {free / 1e9:.1f} GB free, {args.gb + 2:.1f} GB needed: "
                         f"name a smaller --gb")
    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="flowrl-bench-datasets-"))
    try:
        from flowrl.models.tiny import build_tiny_model
        from flowrl.tasks.arith import make_split

        build_tiny_model(work / "model", seed=0)
        (work / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make_split(8, 5)))
        t = time.perf_counter()
        rows = write_data(work / "big.jsonl", size)
        write_s = time.perf_counter() - t
        write_data(work / "small.jsonl", 1_000_000)
        big, small = work / "big.flow", work / "small.flow"
        big.write_text(FLOW.replace("DATA", "big.jsonl"))
        small.write_text(FLOW.replace("DATA", "small.jsonl"))
        check_big = timed_check(big, args.repeats)
        check_small = timed_check(small, args.repeats)
        inproc_big = timed_check_in_process(big, args.repeats)
        inproc_small = timed_check_in_process(small, args.repeats)
        run_small = run_memory(small, args.steps)
        run_big = run_memory(big, args.steps)
        file_bytes = (work / "big.jsonl").stat().st_size
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "file_bytes": file_bytes, "rows": rows, "write_seconds": round(write_s, 1),
        "check_seconds": {"big": [round(x, 3) for x in check_big], "small": [round(x, 3) for x in check_small]},
        "check_in_process_seconds": {"big": [round(x, 4) for x in inproc_big],
                                     "small": [round(x, 4) for x in inproc_small]},
        "run": {"big": run_big, "small": run_small}, "steps": args.steps,
        "cpus": os.cpu_count(), "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
    }
    print(f"synthetic JSON lines: {file_bytes / 1e9:.2f} GB, {rows:,} rows (written in {write_s:.0f} s)")
    print(f"{'':28} {'big file':>12} {'1 MB file':>12}")
    print(f"{'flowrl check, best (s)':28} {min(check_big):>12.2f} {min(check_small):>12.2f}")
    print(f"{'flowrl check, median (s)':28} {statistics.median(check_big):>12.2f} {statistics.median(check_small):>12.2f}")
    print(f"{'check in process, best (s)':28} {min(inproc_big):>12.3f} {min(inproc_small):>12.3f}")
    print(f"{'run: driver peak RSS (MB)':28} {run_big['hwm_mb']:>12.0f} {run_small['hwm_mb']:>12.0f}")
    print(f"{'run: seconds ({} steps)'.format(args.steps):28} {run_big['seconds']:>12.0f} {run_small['seconds']:>12.0f}")
    print(f"{os.cpu_count()} CPUs; 1-minute load average {result['load_before']} before, {result['load_after']} after")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
