"""The ``cpu`` profile measured automatically: a short micro-benchmark, cached per machine.

``flowrl plan`` for ``gpu = "cpu"`` uses this machine's figures without a manual
``flowrl profile``: on first use (a plan on ``cpu``, torch installed) a quick benchmark
(fp32 matmul at :data:`QUICK_SIZE`, a :data:`QUICK_COPY_MB` MB memcpy, the tiny model's passes
on the torch train engine, :mod:`flowrl.cost.trainbench`; no gloo; ~6 s on 2 cores) runs in a
child process (``plan`` itself never imports torch) and its profile is cached as
``$FLOWRL_CACHE/profiles/cpu-<key>.json`` (default ``~/.cache/flowrl/profiles``), the key
hashing the machine facts a measurement depends on (:func:`machine_facts`: CPU model,
core count, torch version), the benchmark's version (:data:`QUICK_VERSION`) and the figures
it keeps from the built-in ``cpu`` profile. An
explicit profile (``$FLOWRL_PROFILE`` or the ``flowrl profile`` file) wins;
``FLOWRL_AUTO_PROFILE=0`` turns it off (the test suite does, so that estimates there never
depend on the machine).

>>> key = machine_key({"cpu": "x", "cores": 2, "torch_version": "2.13.0"})
>>> len(key), key == machine_key({"torch_version": "2.13.0", "cores": 2, "cpu": "x"})
(16, True)
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from flowrl.catalog.hardware import CPU_FALLBACK
from flowrl.cache import cache_root
from flowrl.cost.profiles import ProfileError, can_measure, load_profile, profile_path, save_profile

QUICK_SIZE = 1024
"""Matmul size of the quick benchmark (``[n, n] @ [n, n]`` fp32)."""
QUICK_COPY_MB = 64
"""Memcpy size of the quick benchmark, MB."""
QUICK_REPEAT = 3
"""Best of this many runs of each measurement."""
QUICK_VERSION = 2
"""Bumped when the benchmark measures something new (2: the train engine's passes), so that a
profile cached by an older one is measured again."""
ENV_SWITCH = "FLOWRL_AUTO_PROFILE"
"""``0`` turns the automatic profile off (estimates then use the built-in figures)."""
TIMEOUT_S = 120


def machine_facts() -> dict:
    """What a measurement depends on: CPU model, logical core count, torch version (no torch import)."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "none"
    return {"cpu": model, "cores": os.cpu_count() or 1, "torch_version": torch_version}


def machine_key(facts: dict) -> str:
    """A short stable hash of ``facts`` (key order does not matter), of the benchmark's version and of the
    figures it keeps from :data:`~flowrl.catalog.hardware.CPU_FALLBACK` (new figures there measure again)."""
    kept = {k: v for k, v in CPU_FALLBACK.to_dict().items() if k != "source"}
    return hashlib.sha256(json.dumps({**facts, "kept": kept, "bench": QUICK_VERSION},
                                     sort_keys=True).encode()).hexdigest()[:16]


def cache_dir() -> Path:
    """``$FLOWRL_CACHE/profiles`` if set, else ``~/.cache/flowrl/profiles``."""
    return cache_root() / "profiles"


def cached_path(facts: dict | None = None) -> Path:
    """Where the automatic profile of the machine ``facts`` (default: this one) is cached."""
    return cache_dir() / f"cpu-{machine_key(facts or machine_facts())}.json"


def enabled() -> bool:
    """Whether the automatic profile applies: not switched off, no explicit profile in effect, and torch
    installed to measure with (the compiler alone runs without it: plans then use the built-in figures)."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or os.environ.get("FLOWRL_PROFILE"):
        return False
    return not profile_path().exists() and can_measure()


def measures(gpu: str) -> bool:
    """Whether a cluster's ``gpu`` kind is this machine (the profile the benchmark measures), not a
    data sheet's GPU."""
    return gpu == CPU_FALLBACK.name


def auto_profile(facts: dict | None = None, bench=None) -> tuple[Path, bool]:
    """``(path, measured_now)``: the cached profile of this machine, measured first on a miss.

    ``bench(path)`` writes a profile to ``path`` (default :func:`run_quick_bench`, a child process).
    A cached file that cannot be read is measured again.
    """
    facts = facts or machine_facts()
    path = cached_path(facts)
    if path.exists():
        try:
            load_profile(path)
            return path, False
        except ProfileError:
            pass
    path.parent.mkdir(parents=True, exist_ok=True)
    (bench or run_quick_bench)(path)
    prof = load_profile(path)
    note = (f"measured automatically on {facts['cpu']} ({facts['cores']} cores, torch {facts['torch_version']}), "
            f"cached at {path}; `flowrl profile` measures more, FLOWRL_AUTO_PROFILE=0 turns this off")
    save_profile(replace(prof, source=note), path)
    return path, True


def use_auto_profile(bench=None, cached_only: bool = False) -> Path | None:
    """Make the automatic profile the ``cpu`` profile of this process (``$FLOWRL_PROFILE``) when
    :func:`enabled`; returns its path (None when it does not apply). ``cached_only``: only a profile
    measured before, never a benchmark now (``flowrl plan`` measures only for a plan on ``cpu``)."""
    if not enabled() or (cached_only and not cached_path().exists()):
        return None
    path, _ = auto_profile(bench=bench)
    os.environ["FLOWRL_PROFILE"] = str(path)
    return path


def run_quick_bench(path: Path) -> None:
    """Run :func:`quick_measure` in a child process (torch stays out of this one); writes ``path``."""
    try:
        from flowrl.runtime.environment import GIVEN, scrubbed

        r = subprocess.run([sys.executable, "-m", "flowrl.cost.autoprofile", str(path)], capture_output=True,
                           text=True, timeout=TIMEOUT_S, env=scrubbed(given=GIVEN["tool"]))
    except subprocess.TimeoutExpired:
        raise ProfileError(f"the automatic CPU benchmark took over {TIMEOUT_S} s; hint: run `flowrl profile` "
                           f"or set {ENV_SWITCH}=0") from None
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ProfileError(f"the automatic CPU benchmark failed ({tail[0]}); hint: run `flowrl profile` "
                           f"or set {ENV_SWITCH}=0")


def quick_measure():
    """The quick benchmark itself (imports torch): matmul, memcpy and the train engine's passes, no gloo
    allreduce."""
    from flowrl.cost.profiles import measure

    return measure(QUICK_SIZE, QUICK_COPY_MB, repeat=QUICK_REPEAT, with_allreduce=False)


if __name__ == "__main__":  # the child process of run_quick_bench
    save_profile(quick_measure(), sys.argv[1])

__all__ = ["machine_facts", "machine_key", "cache_dir", "cached_path", "enabled", "measures", "auto_profile",
           "use_auto_profile", "run_quick_bench", "quick_measure", "QUICK_SIZE", "QUICK_COPY_MB", "QUICK_VERSION",
           "ENV_SWITCH"]
