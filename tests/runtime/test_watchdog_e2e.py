"""A generate that never returns stops the run through the watchdog, named, and nothing is lost.

Real Ray actors, the torch rollout engine (``hf_generate``: no vLLM start-up) and the torch
trainer on the tiny model. ``Faults(hang_at_step=1)`` makes the rollout replica sleep an hour in
step 2's generate (the instruction travels with the generate call); the setting makes the deadline
``max(3 s, 10 x step 1's generate)``, so the run stops within seconds of the hang.
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("ray")

from e2e_kit import make_workdir, write_flow  # noqa: E402

from flowrl.launch import run_file  # noqa: E402
from flowrl.runtime.errors import user_error  # noqa: E402
from flowrl.runtime.fleet import Faults  # noqa: E402
from flowrl.runtime.watchdog import ENV_VAR, EngineHung  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SCHEDULE = """
schedule main on cluster(nodes = 1, gpus_per_node = 1) {
  policy.rollout = hf_generate()
}
"""


def test_a_hung_generate_stops_the_run_naming_engine_op_and_step(tmp_path, monkeypatch):
    # first=600: start-up and every first call on a loaded 2-core machine; floor=3, factor=10: step 2's
    # generate may take 10x step 1's before it counts as hung (an hour's sleep is far past that)
    monkeypatch.setenv(ENV_VAR, "first=600,floor=3,factor=10")
    workdir = make_workdir(tmp_path)
    path = write_flow(workdir / "hang.flow", "grpo(policy, prompts, sevens, batch = 4, group = 2, max_tokens = 4, "
                                             "lr = 3e-3, kl = 0.0, seed = 1)", steps=3, schedule=SCHEDULE)
    out = workdir / "run"
    with pytest.raises(Exception) as info:
        run_file(str(path), out=str(out), save_every=1, faults=Faults(hang_at_step=1))
    message = user_error(info.value)
    assert isinstance(info.value, EngineHung) and message is not None, info.value
    assert re.match(r"watchdog: engine `policy\.rollout` \(replica 0\) did not finish `generate` of op "
                    r"`grpo\.rollouts` \(stdlib/grpo\.flow:\d+:\d+\) at step 2 within ", message), message
    assert "measured: 1 earlier call(s), the slowest" in message, message
    assert f"`flowrl run --resume {out}` continues from its checkpoint of step 1" in message, message
    # what finished is kept: step 1's metrics, its summary and its checkpoint
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["step"] >= 1] == [1]
    assert json.loads((out / "summary.json").read_text())["steps_done"] == 1
    assert (out / "checkpoints" / "step_000001" / "manifest.json").is_file()
