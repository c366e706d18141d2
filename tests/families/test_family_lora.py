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
def test_shipped_lora_flow_sends_adapters_and_matches_the_trainer(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "runtime"))
    from e2e_kit import shared_ray  # one local Ray instance for the in-process runs of every module

    (tmp_path / "flows").mkdir()
    shutil.copy(ROOT / "flows/family_lora.flow", tmp_path / "flows")
    (tmp_path / "data").symlink_to(ROOT / "data")
    (tmp_path / "stdlib").symlink_to(ROOT / "stdlib")
    result = run_file(str(tmp_path / "flows/family_lora.flow"), sets={"eval_every": 0}, steps=3,
                      out=str(tmp_path / "run"), ray_address=shared_ray())
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


@pytest.mark.long
@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3", "mistral"])
def test_each_dense_family_serves_its_adapter_in_vllm(arch, tmp_path):
    """Every dense family `check_adapters` accepts (all-linear, r = 8): the trainer's PEFT adapters, loaded
    into vLLM as a LoRA adapter, give vLLM's processed log-probs within 1e-4 of the trainer's (fp32)."""
    from family_cases import PROMPTS, build_family, max_gap, pg_loss

    from flowrl.engines.torch_train import OptimConfig, TorchTrainEngine
    from flowrl.engines.types import SamplingSpec, TokenBatch
    from flowrl.engines.vllm_engine import VLLMRolloutEngine

    lora = {"r": 8, "alpha": 16.0, "dropout": 0.0, "targets": "all-linear"}
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=12, seed=5)
    path = build_family(arch, tmp_path / arch)
    trainer = TorchTrainEngine(path, optim=OptimConfig(lr=1e-2, max_grad_norm=1.0), lora=lora)
    rollout = VLLMRolloutEngine(path, dtype="float32", max_model_len=64, lora=lora)
    try:
        before = TokenBatch.from_completions([c for g in rollout.generate(PROMPTS, spec) for c in g], pad_id=0)
        for _ in range(2):
            trainer.train_step(before, pg_loss, micro_batch_size=4)
        rollout.load_adapter(trainer.named_weights())
        after = TokenBatch.from_completions([c for g in rollout.generate(PROMPTS, spec) for c in g], pad_id=0)
        resynced = max_gap(trainer.forward(after)["logprobs"], after)
        stale = max_gap(trainer.forward(before)["logprobs"], before)
    finally:
        rollout.shutdown()
    print(f"\n{arch} LoRA: after the adapter's resync {resynced}, the base's rollouts {stale}")
    assert resynced[2] > 40 and resynced[0] <= 1e-4, resynced
    assert stale[0] > 1e-3, stale  # the adapters moved the policy: the comparison has teeth
