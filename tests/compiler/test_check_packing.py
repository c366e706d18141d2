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
