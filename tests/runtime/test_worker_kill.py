"""Issue 14: ``kill -9`` of a reward worker or an environment worker mid-call loses nothing. The
pool replaces the worker; the sample is scored again, or the episode is replayed (reset, then its
earlier turns) and its call made again. The run goes on, says so (``reward/recovered``,
``env/recovered``, a warning, ``events.log``), and its metrics equal an undisturbed run's.

Each case is two 3-step runs of the tiny random-init model on one local Ray instance: one
undisturbed, one with the worker armed to SIGKILL itself at its first call.
"""

from __future__ import annotations

import io
import json
import shutil

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray")

from e2e_kit import RUNTIME_DIR, VOLATILE, local_ray, make_workdir  # noqa: E402

from flowrl.launch import run_file  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FLOWS = {
    "reward": """import stdlib.grpo
model policy = hf("model")
dataset prompts = jsonl("train.jsonl", eval = "test.jsonl")
reward sevens = python_reward("e2e_killers:sevens", workers = 2)
flow main(steps: int = 3, eval_every: int = 0) {
  grpo(policy, prompts, sevens, batch = 4, group = 2, max_tokens = 4, lr = 1e-3, kl = 0.0, seed = 1)
}
""",
    "env": """import stdlib.agentic
model policy = hf("model")
dataset prompts = jsonl("train.jsonl", eval = "test.jsonl")
env calc = python_env("e2e_killers:Calc", timeout = 60.0, workers = 1)
reward exact = verifier("math")
flow main(steps: int = 3, eval_every: int = 0) {
  agentic(policy, prompts, calc, exact, batch = 4, group = 2, max_turns = 2, max_tokens = 6, lr = 1e-3,
          kl = 0.0, seed = 1)
}
""",
}


@pytest.fixture(scope="module")
def ray_address():
    yield from local_ray(gpus=1)


def _stable(out, drop: str) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE + ("env/latency",)) and k != drop}
            for r in rows]


@pytest.mark.parametrize("kind", ["reward", "env"])
def test_a_killed_worker_loses_nothing(kind, tmp_path, ray_address):
    work = make_workdir(tmp_path)
    shutil.copy(RUNTIME_DIR / "e2e_killers.py", work / "e2e_killers.py")
    (work / "f.flow").write_text(FLOWS[kind])
    undisturbed = run_file(str(work / "f.flow"), out=str(work / "calm"), ray_address=ray_address, stream=io.StringIO())
    (work / "armed").touch()
    said = io.StringIO()
    killed = run_file(str(work / "f.flow"), out=str(work / "killed"), ray_address=ray_address, stream=said)
    assert (work / "fired").exists()  # the worker was killed
    metric = f"{kind}/recovered"
    assert sum(r.get(metric, 0) for r in killed.rows) >= 1
    assert f"{'reward' if kind == 'reward' else 'environment'} worker of" in said.getvalue()
    events = (killed.out / "events.log").read_text()
    assert f'"{kind}_recovered"' in events and "fresh worker" in events
    assert _stable(killed.out, metric) == _stable(undisturbed.out, metric)  # nothing lost, nothing changed
