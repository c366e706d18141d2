"""flows/family_lora.flow for 3 GRPO steps through Ray: the torch trainer trains PEFT adapters only, each
resync sends the adapter tensors only, vLLM serves them as a LoRA adapter (steps 2 and 3: the first and
second adapter, the second replacing the first), and its log-probs stay within 1e-4 of the trainer's
(fp32); the KL reference is the base model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray")
pytest.importorskip("peft")

from flowrl.catalog.adapters import lora_modules, lora_params  # noqa: E402
from flowrl.catalog.models import tiny_facts  # noqa: E402
from flowrl.launch import run_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_shipped_lora_flow_sends_adapters_and_matches_the_trainer(tmp_path):
    (tmp_path / "flows").mkdir()
    shutil.copy(ROOT / "flows/family_lora.flow", tmp_path / "flows")
    (tmp_path / "data").symlink_to(ROOT / "data")
    (tmp_path / "stdlib").symlink_to(ROOT / "stdlib")
    result = run_file(str(tmp_path / "flows/family_lora.flow"), sets={"eval_every": 0}, steps=3,
                      out=str(tmp_path / "run"))
    plan = json.loads((result.out / "plan.json").read_text())
    policy = next(m for m in plan["models"] if m["id"] == "policy")
    facts = tiny_facts({"task": "arith"})
    assert policy["args"]["lora"]["targets"] == list(lora_modules(facts))  # "all-linear", expanded
    adapters = lora_params(facts, 8, "all-linear")
    assert len(result.rows) == 3
    for row in result.rows:
        assert row["mismatch/abs_max"] < 1e-4, row  # vLLM's adapter vs the PEFT trainer after each resync, fp32
        assert row["sync/tensors"] == facts.layers * 7 * 2  # lora_A and lora_B of 7 modules per layer
        assert row["sync/bytes"] == 4 * adapters < 4 * facts.params / 5
    assert result.rows[0]["kl/ref"] == pytest.approx(0.0, abs=1e-6)  # before any update: policy = base = ref
    assert result.rows[1]["kl/ref"] > 0  # after one: the adapters moved the policy off the base
