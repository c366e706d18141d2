"""The rank processes of a multi-process train engine (megatron, fsdp) end by themselves when the
process that owns the engine is killed (``kill -9`` of its Ray actor, an OOM kill). A rank waits on
an inbox whose pipe it holds both ends of, so before ``ranks.exit_with_owner`` such ranks lived on as
orphans, holding their memory (four FSDP ranks of 430 MB each were found after a killed run)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

OWNER = """
import json, sys, time
sys.path.insert(0, {here!r})
from rank_workers import PidWorker
from flowrl.engines.ranks import ForkedRanks
group = ForkedRanks(PidWorker, None, 2, 120.0, name="probe")
print(json.dumps([c["pid"] for c in group.coords]), flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's zombie waits for a reaper that may not come)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_ranks_exit_when_the_process_owning_their_engine_is_killed():
    owner = subprocess.Popen([sys.executable, "-c", OWNER.format(here=str(HERE))], stdout=subprocess.PIPE,
                             text=True)
    try:
        pids = json.loads(owner.stdout.readline())
        assert len(pids) == 2 and os.getpid() not in pids and all(_running(p) for p in pids)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=30)
        deadline = time.monotonic() + 30  # ranks check their owner every second
        while any(_running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_running(p) for p in pids), f"rank processes {pids} outlived their engine's process"
    finally:
        owner.kill()
        owner.wait(timeout=30)
