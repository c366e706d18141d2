"""A real run (Ray, the torch rollout engine: no vLLM start-up, the torch trainer) with ``export_every`` and checkpoint retention (``keep_last``,
``keep_best``): the exports land in ``RUN/exports/step_N``, load in transformers, equal what ``flowrl
export`` writes from the same checkpoint, and are listed as flowrl's; retention leaves the newest
checkpoint and the best by held-out accuracy, and the run directory holds nothing flowrl did not list.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("ray")

from e2e_kit import local_ray, make_workdir  # noqa: E402

from flowrl.launch import run_file  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def ray_address():
    yield from local_ray()


def test_a_run_exports_every_n_steps_and_keeps_the_last_and_the_best(tmp_path, ray_address):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from flowrl.runtime import rundir
    from flowrl.runtime.checkpoints import complete_checkpoints, step_of
    from flowrl.runtime.export import export_run

    work = make_workdir(tmp_path, rows=40, train=32)
    (work / "f.flow").write_text("""import stdlib.grpo
model policy = hf("model")
dataset prompts = jsonl("train.jsonl", eval = "test.jsonl")
reward exact = verifier("math")
flow main(steps: int = 2, eval_every: int = 1, keep_last: int = 1, keep_best: int = 1, export_every: int = 1) {
  grpo(policy, prompts, exact, batch = 4, group = 2, max_tokens = 4, lr = 1e-3, kl = 0.0)
}
schedule main on cluster(nodes = 1, gpus_per_node = 1) {
  policy.rollout = hf_generate()
}
""")
    out = work / "run"
    run_file(str(work / "f.flow"), out=str(out), save_every=1, ray_address=ray_address)

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    scores = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r and r["step"] >= 1}
    assert sorted(scores) == [1, 2]
    best = min(scores, key=lambda s: (-scores[s], s))
    assert [step_of(p) for p in complete_checkpoints(out)] == sorted({best, 2})

    exports = sorted(p.name for p in (out / "exports").iterdir())
    assert exports == ["step_000001", "step_000002"]
    model = AutoModelForCausalLM.from_pretrained(str(out / "exports" / "step_000002"))
    assert model.config.vocab_size > 0
    again = export_run(out, tmp_path / "again", step=2)
    ours, theirs = load_file(str(out / "exports" / "step_000002" / "model.safetensors")), \
        load_file(str(again.path / "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(ours[k].equal(theirs[k]) for k in ours)

    listed = rundir.listed(out)
    assert listed.get("exports/step_000001") == rundir.PATH and listed.get("exports/step_000002") == rundir.PATH
    assert rundir.first_foreign(out) is None  # all of it flowrl's: --overwrite may replace it
