"""LoRA on fsdp(dp=2) (and so torch with dp > 1, which runs on fsdp's ranks): PEFT wraps the model in each rank
before FSDP2 shards it; only the adapters train (their gradients summed over the ranks); the step, the
adapters a resync gathers and the log-probs equal the one-process torch engine's (fp32, 1e-5); the base
model's log-probs with the adapters disabled equal a plain engine's of the same checkpoint exactly; a
checkpoint keeps the adapters and AdamW state alone and a resumed engine continues as the saved one."""

from __future__ import annotations

import pytest
import torch
from engine_testkit import random_batch, sft_loss

from flowrl.engines.base import EngineConfigError
from flowrl.engines.fsdp import FsdpTrainEngine
from flowrl.engines.torch_train import OptimConfig, TorchTrainEngine

pytest.importorskip("peft")

LORA = {"r": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["q_proj", "v_proj", "down_proj"]}
OPTIM = OptimConfig(lr=1e-2, max_grad_norm=1.0, eps=1e-3)  # eps: see test_fsdp_engine.OPTIM
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # three engines of 2 forked ranks each: ~50 s on 2 idle cores
def test_lora_dp2_trains_adapters_as_one_process_does_and_disables_them_for_the_base(tiny_model_dir, tmp_path):
    batches = [random_batch(rows=5, seed=s) for s in (3, 4)]
    torch.manual_seed(0)
    one = TorchTrainEngine(tiny_model_dir, optim=OPTIM, lora=LORA)
    base = TorchTrainEngine(tiny_model_dir, optim=OPTIM)  # no adapters: the checkpoint's model
    one_stats = [one.train_step(b, sft_loss, micro_batch_size=2) for b in batches]
    one_lp = one.forward(batches[0])["logprobs"]
    with FsdpTrainEngine(tiny_model_dir, optim=OPTIM, dp=2, lora=LORA) as eng:
        before = eng.forward(batches[0], adapters=False)["logprobs"]
        stats = [eng.train_step(b, sft_loss, micro_batch_size=2) for b in batches]
        lp = eng.forward(batches[0], micro_batch_size=1)["logprobs"]
        off = eng.forward(batches[0], adapters=False)["logprobs"]
        sent = dict(eng.named_weights())
        eng.save_pretrained(str(tmp_path / "merged"))  # the base with the adapters merged in, in checkpoint names
        eng.save(str(tmp_path / "ckpt"))
        after_save = eng.train_step(batches[1], sft_loss, micro_batch_size=2)
        lp_after = eng.forward(batches[0])["logprobs"]
    for got, want in zip(stats, one_stats):
        for key in ("loss", "grad_norm", "lr", "step"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    torch.testing.assert_close(lp, one_lp, **TOL)
    want_sent = dict(one.named_weights())
    assert sent.keys() == want_sent.keys() and all(".lora_" in n for n in sent)  # the adapters alone
    for name, t in want_sent.items():
        torch.testing.assert_close(sent[name], t, **TOL, msg=name)
    assert any(float(t.abs().max()) > 0 for n, t in sent.items() if ".lora_B." in n)  # they moved
    one.save_pretrained(str(tmp_path / "one"))  # PEFT's merge_and_unload
    from safetensors.torch import load_file

    exported, want_exported = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("merged", "one"))
    assert exported.keys() == want_exported.keys()
    for name, t in want_exported.items():
        torch.testing.assert_close(exported[name], t, **TOL, msg=name)
    # the reference pass: the base's log-probs, bit for bit the same before and after training
    base_lp = base.forward(batches[0])["logprobs"]
    assert torch.equal(off, before)
    torch.testing.assert_close(off, base_lp, rtol=0, atol=1e-6)
    assert (lp - off).abs().max() > 1e-3  # the adapters change the policy: the comparison has teeth

    # the checkpoint holds the adapters (not the base) and AdamW's state; a fresh engine resumes exactly
    with FsdpTrainEngine(tiny_model_dir, optim=OPTIM, dp=2, lora=LORA, seed=7) as again:
        again.load(str(tmp_path / "ckpt"))
        resumed = again.train_step(batches[1], sft_loss, micro_batch_size=2)
        torch.testing.assert_close(again.forward(batches[0])["logprobs"], lp_after, rtol=0, atol=0)
    assert resumed["loss"] == after_save["loss"] and resumed["grad_norm"] == after_save["grad_norm"]
    from flowrl.engines.fsdp_rank import DCP_DIR

    saved = sum(f.stat().st_size for f in (tmp_path / "ckpt" / DCP_DIR).iterdir())
    full = sum(p.numel() * 4 for p in base.model.parameters())
    assert saved < full / 2, (saved, full)  # adapters + their Adam moments, no copy of the base


def test_adapters_off_needs_adapters(tiny_model_dir):
    eng = TorchTrainEngine(tiny_model_dir, optim=OPTIM)
    with pytest.raises(EngineConfigError, match="trains no LoRA adapters"):
        eng.forward(random_batch(rows=2), adapters=False)
    with pytest.raises(EngineConfigError, match="lora is for actors"):
        FsdpTrainEngine(tiny_model_dir, role="critic", dp=2, lora=LORA)


LORA_FLOW_SCHEDULE = """
schedule main on cluster(nodes = 1, gpus_per_node = 2) {
  policy.train = fsdp(dp = 2)
  policy.rollout = hf_generate()
}
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lora_grpo_on_fsdp_dp2_through_ray_shares_the_base_and_resumes_exactly(tmp_path, monkeypatch):
    """GRPO with a KL term, LoRA on fsdp(dp = 2) rank actors under Ray: each resync sends the adapters alone,
    the reference pass runs on the policy's engine with the adapters off (the plan has no reference engine,
    KL 0 before the first update, > 0 after), and a run resumed from step 1's checkpoint (adapters and AdamW
    state) reproduces steps 2 and 3."""
    pytest.importorskip("ray")
    import json
    from pathlib import Path

    from flowrl.catalog.models import from_config
    from flowrl.launch import run_file

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "runtime"))  # e2e_kit, e2e_rewards
    from e2e_kit import flow_text, make_workdir, resume_copy, shared_ray, stable

    make_workdir(tmp_path, rows=40, train=32)
    body = "grpo(policy, prompts, sevens, batch = 4, group = 4, max_tokens = 6, lr = 1e-2, kl = 0.05, seed = 1)"
    text = flow_text(body, 3, LORA_FLOW_SCHEDULE).replace(
        'hf("model")', 'hf("model", lora = lora(r = 4, alpha = 8, targets = ["q_proj", "v_proj"]))')
    path = tmp_path / "lora_fsdp.flow"
    path.write_text(text)
    run = run_file(str(path), out=str(tmp_path / "run"), save_every=1, ray_address=shared_ray())
    plan = json.loads((run.out / "plan.json").read_text())
    engines = {f"{m['id']}.{r}": m[f"{r}_engine"] for m in plan["models"] for r in ("train", "rollout")
               if m[f"{r}_engine"]}
    assert sorted(engines) == ["policy.rollout", "policy.train"]  # no reference engine
    assert engines["policy.train"]["kind"] == "fsdp" and engines["policy.train"]["dp"] == 2
    ref_op, = [o for o in plan["ops"] if o["options"].get("adapters") == "off"]
    assert ref_op["model"] == "policy" and ref_op["options"]["reference"] == "grpo.ref"
    placed = json.loads((run.out / "placement.json").read_text())
    assert sum(1 for r in placed if r["engine"] == "policy.train" and r.get("rank") is not None) >= 2
    rows = run.rows
    layers = from_config(str(tmp_path / "model")).layers
    for row in rows:
        assert row["sync/tensors"] == layers * 2 * 2  # lora_A and lora_B of q and v per layer, nothing else
    assert rows[0]["kl/ref"] == pytest.approx(0.0, abs=1e-6)  # before any update: the policy is its base
    assert rows[1]["kl/ref"] > 0  # after one the adapters moved it off the base, which the reference stays
    resumed = resume_copy(run.out, tmp_path / "resumed", 1, ray_address=shared_ray())
    assert len(resumed.rows) == 3 and stable(resumed.rows) == stable(rows)  # step 1's row kept, 2 and 3 again
