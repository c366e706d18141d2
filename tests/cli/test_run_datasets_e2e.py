"""A real run (Ray, vLLM, the torch trainer) over an `hf_dataset` (a `save_to_disk` folder) whose prompts a
template writes, mixed with a streamed JSON-lines file: the prompts the policy saw are the template's, both
datasets were drawn from, and the held-out split is the DatasetDict's `test`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray")
datasets = pytest.importorskip("datasets")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from e2e_kit import make_workdir  # noqa: E402

from flowrl.launch import run_file  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_run_over_a_templated_hf_dataset_and_a_streamed_mixture(tmp_path):
    work = make_workdir(tmp_path, rows=40, train=32)
    rows = [json.loads(line) for line in (work / "train.jsonl").read_text().splitlines()]
    held = [json.loads(line) for line in (work / "test.jsonl").read_text().splitlines()]

    def table(rs):
        return datasets.Dataset.from_dict({"sum": [r["prompt"].rstrip("=") for r in rs],
                                           "result": [r["answer"] for r in rs]})

    datasets.DatasetDict({"train": table(rows), "test": table(held)}).save_to_disk(str(work / "hf"))
    (work / "flow.flow").write_text("""import stdlib.grpo
model policy = hf("model")
dataset sums = hf_dataset("hf", eval = "test", template = "{sum}=", answer = "result")
dataset raw = jsonl("train.jsonl", stream = "on")
dataset both = mix(sums, raw, weights = [3, 1])
reward sevens = python_reward("e2e_rewards:sevens", workers = 1)
flow main(steps: int = 2, eval_every: int = 2, log_samples: int = 1) {
  grpo(policy, both, sevens, batch = 4, group = 2, max_tokens = 4, lr = 3e-3, kl = 0.0, seed = 1)
}
""")
    out = work / "run"
    run_file(str(work / "flow.flow"), out=str(out))  # Ray of its own, as `flowrl run` starts it
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "reward/mean" in m] == [1, 2]
    assert any("eval/reward" in m for m in metrics)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    prompts = {s["prompt"] for s in samples}
    texts = {r["prompt"] for r in rows}
    assert prompts and prompts <= texts  # "{sum}=" writes the arithmetic prompts back, from either dataset
    plan = json.loads((out / "plan.json").read_text())
    by_id = {d["id"]: d for d in plan["datasets"]}
    assert by_id["sums"]["template"] == "{sum}=" and by_id["both"]["parts"] == ["sums", "raw"]
