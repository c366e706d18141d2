"""A model's facts come from the end of its chain of bases: ``frozen(m)`` and ``critic(m)`` are ``m``'s."""

from __future__ import annotations

from pathlib import Path

from flowrl.catalog.ops import OpKind
from flowrl.compiler.model_info import checkpoint_dir, facts_of, prompt_counter, source_node
from flowrl.compiler.pipeline import compile_text

ROOT = Path(__file__).resolve().parents[2]
FLOW = f"""import stdlib.ppo
import stdlib.grpo
model policy = tiny(task = "arith", hidden = 64, heads = 2)
model big = hf("Qwen/Qwen2.5-0.5B")
dataset arith = jsonl("{ROOT}/data/arith/train.jsonl")
reward exact = verifier("exact")
flow main(steps: int = 3) {{
  ppo(policy, arith, exact, batch = 4, max_tokens = 5)
  grpo(big, arith, exact, batch = 4, max_tokens = 5)
}}
schedule main on cluster(nodes = 1, gpus_per_node = 8, gpu = "H100") {{
  policy.rollout = hf_generate()
  big.rollout = hf_generate()
}}
"""


def test_frozen_and_critic_models_take_their_bases_facts():
    graph = compile_text(FLOW, str(ROOT / "flows" / "model_info.flow"))
    models = {n.id: n.op for n in graph.nodes() if n.kind == OpKind.MODEL}
    assert models == {"policy": "tiny", "ppo.ref": "frozen", "ppo.critic": "critic", "big": "hf", "grpo.ref": "frozen"}
    base = {"policy": "policy", "ppo.ref": "policy", "ppo.critic": "policy", "big": "big", "grpo.ref": "big"}
    assert {m: source_node(graph, m).id for m in models} == base
    assert facts_of(graph, "policy").hidden == 64 and facts_of(graph, "big").layers == 24  # a preset's facts
    for model, root in base.items():
        assert facts_of(graph, model) == facts_of(graph, root)
        assert checkpoint_dir(graph, model) == checkpoint_dir(graph, root)
        assert (prompt_counter(graph, model) is None) == (prompt_counter(graph, root) is None)
    assert prompt_counter(graph, "ppo.critic")("1+2=") == prompt_counter(graph, "policy")("1+2=")
    assert source_node(graph, "arith") is None and facts_of(graph, "arith") is None  # not a model
