"""check_packing (E615) and the memory estimate of token-budget micro-batches."""

from __future__ import annotations

import pytest

from flowrl.compiler.pipeline import compile_text
from flowrl.diagnostics import FlowError

FLOW = '''
model m = tiny()
reward v = verifier("exact")
flow f(d: dataset) {
  r = generate(m, sample(d, size = 8), n = 4, max_tokens = 64)
  update(m, r, group_advantage(v(r), group = 4), logprobs(m, r), micro_batch = 16{extra}) }
schedule f on cluster(nodes = 1, gpus_per_node = 2) {
  colocate m.train, m.rollout on all
  m.train = {train}  m.rollout = vllm(tp = 1, dp = 2) }
'''


def _compile(extra: str = "", train: str = "fsdp(dp = 2)"):
    return compile_text(FLOW.replace("{extra}", extra).replace("{train}", train), "t.flow", allow_missing=True)


def test_token_budget_bounds_the_activation_estimate():
    padded = _compile().sched.engines["m.train"].memory
    budget = _compile(", micro_batch_tokens = 128, pack = true").sched.engines["m.train"].memory
    # 16 rows x (prompt + 64) tokens vs one micro-batch of 128 tokens: far fewer activations.
    assert 0 < budget.activations_gb < padded.activations_gb / 4
    assert budget.weights_gb == padded.weights_gb


@pytest.mark.parametrize("extra", [", pack = true", ", micro_batch_tokens = 256"])
def test_megatron_refuses_token_batches(extra):
    with pytest.raises(FlowError) as e:
        _compile(extra, "megatron(tp = 1, dp = 2)")
    assert "E615" in str(e.value) and "megatron" in str(e.value)


def test_torch_with_dp2_runs_them_on_fsdp_ranks():
    assert _compile(", micro_batch_tokens = 256, pack = true", "torch(dp = 2)").sched is not None


def _config_dir(tmp_path, **cfg):
    import json

    base = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 128, "vocab_size": 64, "max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps({**base, **cfg}))
    return tmp_path


@pytest.mark.parametrize("cfg, says", [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 16}, "sliding window of 16"),
    ({"architectures": ["MyOwnForCausalLM"], "model_type": "mine"}, "`MyOwnForCausalLM`"),
])
def test_pack_refused_for_models_whose_attention_a_packed_mask_breaks(tmp_path, cfg, says):
    path = _config_dir(tmp_path, **cfg)
    text = FLOW.replace("tiny()", f'hf("{path}")').replace("{extra}", ", pack = true").replace("{train}", "torch()")
    text = text.replace("gpus_per_node = 2", "gpus_per_node = 1").replace("dp = 2)", "dp = 1)")
    with pytest.raises(FlowError) as e:
        compile_text(text, "t.flow", allow_missing=True)
    assert "E615" in str(e.value) and says in str(e.value), str(e.value)


STDLIB_GRPO = '''import stdlib.grpo
model m = tiny()
dataset d = jsonl("train.jsonl")
reward v = verifier("exact")
flow main() {{
  grpo(m, d, v, batch = 8, group = 4, max_tokens = 64{extra})
}}
schedule main on cluster(nodes = 1, gpus_per_node = 2) {{
  m.train = {train}
}}
'''


def test_stdlib_grpo_passes_token_batches_and_packing_to_its_update(tmp_path):
    """`grpo(..., micro_batch_tokens = N, pack = true)` reaches the update op (a long-tailed task's padding is
    where its step goes), and check_packing judges it there: Megatron refuses it with E615."""
    from flowrl.launch import build_plan

    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    flow = tmp_path / "g.flow"
    flow.write_text(STDLIB_GRPO.format(extra=", micro_batch_tokens = 256, pack = true", train="fsdp(dp = 2)"))
    update = next(op for op in build_plan(str(flow)).ops if op.op == "update")
    assert update.options["micro_batch_tokens"] == 256 and update.options["pack"] is True
    flow.write_text(STDLIB_GRPO.format(extra="", train="fsdp(dp = 2)"))
    update = next(op for op in build_plan(str(flow)).ops if op.op == "update")
    assert update.options["micro_batch_tokens"] == 0 and update.options["pack"] is False  # by rows, padded
    flow.write_text(STDLIB_GRPO.format(extra=", pack = true", train="megatron(tp = 1, dp = 2)"))
    with pytest.raises(Exception) as e:
        build_plan(str(flow))
    assert "E615" in str(e.value)
