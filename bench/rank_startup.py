"""Start-up of a 4-rank train engine: forked rank processes vs one Ray actor per rank.

Builds ``megatron(tp = 2, dp = 2)`` on a tiny local Llama (hidden 128, 4 heads, 2 KV heads, 2
layers) in a fresh Python process per measurement, two ways:

* ``forked``: no placement (an engine outside Ray): the engine's process starts a fork server that
  imports torch and Megatron once and forks the 4 ranks from it (``flowrl.engines.ranks.ForkedRanks``);
* ``actors``: a local Ray instance with 4 logical GPUs and one STRICT_PACK placement group of 4
  bundles, as the runtime makes for one node; the engine starts one Ray actor per rank in its bundle
  (``flowrl.engines.rank_actors.ActorRanks``), each importing torch and Megatron itself. Ray's own
  start is timed apart (``ray_s``) and not counted in ``start_s``.

``start_s`` is the engine's constructor (every rank built and in its process group), ``stop_s``
its ``shutdown``, ``rank_pss_gb`` each rank process's proportional set size once built (GB: a
forked rank shares its fork server's pages, a rank actor shares nothing). The 1-minute load average before and after each run is recorded: on a shared
2-core machine the figures move with it.

Usage::

    .venv/bin/python bench/rank_startup.py [--repeat 1] [--out bench/results/rank_startup.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
from flowrl.engines.megatron import MegatronTrainEngine
mode, model = sys.argv[1], sys.argv[2]
out = {"mode": mode}
placement = None
if mode == "actors":
    t0 = time.time()
    import ray
    from ray.util.placement_group import placement_group
    from flowrl.engines.ranks import RankPlacement
    ray.init(address="local", num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    pg = placement_group([{"GPU": 1}] * 4, strategy="STRICT_PACK")
    ray.get(pg.ready())
    placement = RankPlacement((pg,) * 4, (0, 1, 2, 3), (1.0,) * 4, "GPU", (0,) * 4)
    out["ray_s"] = time.time() - t0
t0 = time.time()
engine = MegatronTrainEngine(model, tp=2, dp=2, threads=1, placement=placement)
out["start_s"] = time.time() - t0
import psutil
pids = [w["pid"] for w in engine.rank_locations()]
out["rank_pss_gb"] = [psutil.Process(p).memory_full_info().pss / 1e9 for p in pids]
t0 = time.time()
engine.shutdown()
out["stop_s"] = time.time() - t0
print(json.dumps(out))
"""


def measure(mode: str, model: str) -> dict:
    load = os.getloadavg()[0]
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, model], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO),
                                                                                        os.environ.get("PYTHONPATH"))))},
                          timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{mode}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**row, "load_1m_before": load, "load_1m_after": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "rank_startup.json"))
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from flowrl.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_model(Path(tmp) / "model", hidden=128, heads=4, kv_heads=2, layers=2, seed=0))
        rows = [measure(mode, model) for _ in range(args.repeat) for mode in ("forked", "actors")]
    for r in rows:
        print(f"{r['mode']:7s} start {r['start_s']:6.1f} s  stop {r['stop_s']:5.1f} s  "
              f"PSS/rank {sum(r['rank_pss_gb']) / len(r['rank_pss_gb']):.2f} GB"
              + (f"  (Ray {r['ray_s']:.1f} s)" if "ray_s" in r else "")
              + f"  load {r['load_1m_before']:.1f} -> {r['load_1m_after']:.1f}")
    Path(args.out).write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
                                          "layout": "megatron(tp = 2, dp = 2)", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
