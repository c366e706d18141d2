"""A model whose output layer is its word embedding (``tie_word_embeddings``: every small Qwen2.5 and
Llama-3.2) on a train engine that cannot split the tie: ``flowrl check`` refuses what the engine would
refuse at start-up (E621), read from the engine's record (``EngineSpec.untied_axes``).

Megatron keeps the embedding on the first pipeline stage and the output layer on the last; its
adapter refuses a tied actor with pp > 1 (``flowrl/engines/megatron/worker.py``). A critic's value head
replaces the output layer, so a critic of a tied model splits over pp as any model does.
"""

from __future__ import annotations

import pytest

from flowrl.catalog.engines import ENGINES
from flowrl.compiler.pipeline import compile_text
from flowrl.diagnostics import FlowError

HEAD = 'model policy = hf("{model}")\ndataset d = jsonl("d.jsonl")\nreward r = verifier("exact")\n'
GRPO = """flow main() {
  x = generate(policy, sample(d, size = 2), n = 2, max_tokens = 8)
  update(policy, x, group_advantage(r(x), group = 2), logprobs(policy, x))
}
"""
PPO = """import stdlib.ppo
model policy = hf("Qwen/Qwen2.5-0.5B")
dataset d = jsonl("d.jsonl")
reward r = verifier("exact")
flow main() { ppo(policy, d, r, batch = 2, group = 1, max_tokens = 8) }
"""

def _codes(text: str) -> list:
    try:
        compile_text(text, "t.flow")
    except FlowError as e:
        return e.diagnostics
    return []


def _schedule(lines: str, gpus: int = 4) -> str:
    return f'schedule main on cluster(nodes = 1, gpus_per_node = {gpus}, gpu = "H100") {{\n{lines}}}\n'


def test_the_engine_record_carries_the_fact():
    assert ENGINES["megatron"].untied_axes == ("pp",)
    assert all(not ENGINES[e].untied_axes for e in ("fsdp", "torch"))


@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-0.5B", "meta-llama/Llama-3.2-1B"])
def test_a_tied_actor_with_pp_is_refused_at_the_layout(model):
    text = HEAD.format(model=model) + GRPO + _schedule("  policy.train = megatron(pp = 2)\n  policy.rollout = vllm()\n")
    d, = _codes(text)
    assert d.code == "E621" and (d.span.line, d.span.column) == (9, 3), (d.code, d.message)
    assert d.message == (f"`policy` ({model}) ties its output layer to its word embedding (tie_word_embeddings), and "
                         "`megatron` with pp = 2 would hold them on different stages: `megatron` runs tied embeddings "
                         "with pp = 1 only")
    assert d.hint.startswith("give `policy.train` pp = 1 (the other axes split it), or an engine that keeps the tie: ")
    assert "`fsdp(...)`" in d.hint


def test_tp_splits_a_tied_model_and_an_untied_one_takes_pp():
    tp = HEAD.format(model="Qwen/Qwen2.5-0.5B") + GRPO + _schedule("  policy.train = megatron(tp = 2)\n  policy.rollout = vllm()\n")
    assert _codes(tp) == []
    untied = HEAD.format(model="Qwen/Qwen2.5-7B") + GRPO + _schedule("  policy.train = megatron(pp = 2)\n  policy.rollout = vllm()\n")
    assert _codes(untied) == []


def test_ppo_reports_the_layout_once_and_its_critic_takes_pp():
    """PPO's reference (frozen(policy)) and critic (critic(policy)) follow the policy's Megatron layout: the
    reference computes the tied output layer (refused with the policy, at the layout, once), the critic's
    value head replaces it (accepted: the critic's engine takes pp = 2 with a tied checkpoint)."""
    text = PPO + _schedule("  policy.train = megatron(pp = 2)\n  policy.rollout = vllm()\n")
    d, = _codes(text)
    assert d.code == "E621" and d.message.startswith("`policy` ") and d.span.line == 7, (d.code, d.message)
    graph = compile_text(PPO + _schedule("  policy.train = megatron(tp = 2)\n  policy.rollout = vllm()\n"), "t.flow")
    assert {k: e.tp for k, e in graph.sched.engines.items() if e.role == "train"} == \
        {"policy.train": 2, "ppo.ref.train": 2, "ppo.critic.train": 2}


def test_a_critic_of_a_tied_model_is_not_refused():
    from flowrl.compiler.passes.check_model_fit import _computes_lm_head

    graph = compile_text(PPO + _schedule("  policy.train = megatron(tp = 2)\n  policy.rollout = vllm()\n"), "t.flow")
    assert _computes_lm_head(graph, "policy") and _computes_lm_head(graph, "ppo.ref")
    assert not _computes_lm_head(graph, "ppo.critic")
