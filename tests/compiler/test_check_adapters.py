"""`lora = lora(...)` at `flowrl check`: accepted on a dense Llama-style model trained by `torch` or `fsdp` (any
number of ranks) and served by vLLM (adapters) or SGLang / hf_generate (merged); refused with E613 at the option as
written everywhere else. The builder writes the same value as the text."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.builder import Flow, ctor
from flowrl.catalog.engines import ENGINES
from flowrl.compiler.lower import lower
from flowrl.compiler.pipeline import compile_file
from flowrl.diagnostics import FlowError

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data/arith/train.jsonl"

FLOW = """model policy = tiny(task = "arith", arch = "{arch}", warm_start = 0, lora = {lora})
dataset d = jsonl("{data}")
reward r = verifier("math")

flow main() {{
  x = generate(policy, sample(d, size = 2), n = 2, max_tokens = 5)
  update(policy, x, group_advantage(r(x), group = 2), logprobs(policy, x), logprobs(frozen(policy), x), kl = 0.1)
}}

schedule main on cluster(gpus_per_node = {gpus}) {{
  policy.rollout = {rollout}
  policy.train = {train}
}}
"""
LORA = 'lora(r = 8, alpha = 16, targets = ["q_proj", "v_proj"])'


def _compile(tmp_path: Path, arch: str = "llama", lora: str = LORA, rollout: str = "vllm(tp = 1)",
             train: str = "torch()", gpus: int = 1):
    path = tmp_path / "lora.flow"
    path.write_text(FLOW.format(arch=arch, lora=lora, rollout=rollout, train=train, gpus=gpus, data=DATA))
    return compile_file(str(path))


def _errors(tmp_path: Path, **kw) -> list:
    with pytest.raises(FlowError) as e:
        _compile(tmp_path, **kw)
    return [(d.span.line, d.span.column, d.message, d.hint) for d in e.value.diagnostics if d.code == "E613"]


@pytest.mark.parametrize("rollout", ["vllm(tp = 1)", "sglang(tp = 1)", "hf_generate()"])
def test_lora_is_accepted_and_lowered_with_its_targets(tmp_path, rollout):
    plan = lower(_compile(tmp_path, rollout=rollout).graph)
    policy = next(m for m in plan.models if m.id == "policy")
    assert policy.args["lora"] == {"r": 8, "alpha": 16.0, "dropout": 0.0, "targets": ["q_proj", "v_proj"]}
    ref = next(m for m in plan.models if m.role == "frozen")
    assert ref.base == "policy" and "lora" not in ref.args  # the KL reference is the base, without adapters
    resync, = plan.resyncs  # the adapters only: A [8, in] and B [out, 8] of q and v in 2 layers, fp32, no resharding
    assert resync.total_bytes == 4 * 2 * 8 * ((128 + 128) + (128 + 64)) and resync.reshard is None
    assert resync.largest_tensor == "base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight"
    every = lower(_compile(tmp_path, lora='lora(4, 8, 0.1)').graph)  # positional; targets: "all-linear"
    assert next(m for m in every.models if m.id == "policy").args["lora"]["targets"] == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_unknown_targets_are_refused_naming_the_modules(tmp_path):
    (line, col, message, hint), = _errors(tmp_path, lora='lora(targets = ["q_proj", "c_attn"])')
    first = (tmp_path / "lora.flow").read_text().splitlines()[0]
    assert (line, col) == (1, first.index('"c_attn"') + 1) and "targets `c_attn`" in message  # at the name
    assert hint.startswith("its modules: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj")
    assert "targets no module" in _errors(tmp_path, lora="lora(targets = [])")[0][2]
    assert "must be \"all-linear\" or a list" in _errors(tmp_path, lora="lora(targets = [8])")[0][2]


def test_families_without_adaptable_layers_are_refused(tmp_path):
    errors = _errors(tmp_path, arch="gpt2", lora="lora()", train="torch()")
    assert len(errors) == 1 and "no linear modules flowrl adapts" in errors[0][2], errors


def test_a_mixture_of_experts_adapts_its_attention_served_merged_not_by_vllm(tmp_path):
    """A MoE's attention layers take adapters (its experts are fused tensors: not targets); vLLM cannot serve
    them (its Triton MoE-LoRA kernels), the engines that get them merged can."""
    plan = lower(_compile(tmp_path, arch="qwen3_moe", rollout="hf_generate()").graph)
    assert plan.model("policy").args["lora"]["targets"] == ["q_proj", "v_proj"]
    (_, _, message, hint), = _errors(tmp_path, arch="qwen3_moe", rollout="vllm(tp = 1)")
    assert "is a mixture of experts (8 experts) with LoRA adapters, which its rollout engine `vllm` cannot " \
           "serve: vLLM 0.32 serves a mixture of experts' adapters with its Triton MoE-LoRA kernels" in message
    assert hint.startswith("give `policy.rollout` `hf_generate(...)` or `sglang(...)`")
    (_, _, message, hint), = _errors(tmp_path, arch="qwen3_moe", rollout="hf_generate()",
                                     lora='lora(targets = ["q_proj", "gate_proj"])')
    assert "targets `gate_proj`" in message and "experts are fused tensors" in message
    assert hint.startswith("its modules: q_proj, k_proj, v_proj, o_proj")


def test_megatron_cannot_train_adapters_and_says_why(tmp_path):
    (line, col, message, hint), = _errors(tmp_path, train="megatron(tp = 1)")
    first = (tmp_path / "lora.flow").read_text().splitlines()[0]
    assert (line, col) == (1, first.index("lora(") + 1)  # at the option's value
    assert "its train engine `megatron` cannot train them: megatron-core 0.19 has no LoRA layers" in message
    assert hint == "give `policy.train` `fsdp(...)` or `torch(...)`, or drop `lora` to train the full weights"


@pytest.mark.parametrize("train, gpus", [("fsdp(dp = 2)", 2), ("torch(dp = 2)", 2), ("fsdp(dp = 1)", 1)])
def test_fsdp_and_torch_with_several_ranks_train_adapters(tmp_path, train, gpus):
    plan = lower(_compile(tmp_path, train=train, gpus=gpus).graph)
    policy = plan.model("policy")
    assert policy.args["lora"]["r"] == 8 and policy.train_engine.world_size == gpus


def test_a_rank_vllm_cannot_load_is_refused(tmp_path):
    (_, _, message, hint), = _errors(tmp_path, lora="lora(r = 1024)")
    assert "r = 1024, above the 512" in message and hint == "use r <= 512"
    _compile(tmp_path, lora="lora(r = 1024)", rollout="hf_generate()")  # merged: any rank


def test_the_builder_writes_the_same_lora_value(tmp_path):
    f = Flow("main")
    policy = f.declare("model", "policy", "tiny", task="arith", warm_start=0,
                       lora=ctor("lora", r=8, alpha=16, targets=["q_proj", "v_proj"]))
    d = f.declare("dataset", "d", "jsonl", str(DATA))
    r = f.declare("reward", "r", "verifier", "math")
    x = f.generate(policy, f.sample(d, size=2), n=2, max_tokens=5)
    f.update(policy, x, f.group_advantage(r(x), group=2), f.logprobs(policy, x))
    built = lower(f.compile())
    text = lower(_compile(tmp_path).graph)
    assert next(m for m in built.models if m.id == "policy").args == next(m for m in text.models
                                                                          if m.id == "policy").args


def test_schedule_auto_keeps_to_engines_that_train_adapters(tmp_path):
    """With LoRA, `schedule auto` on 2 GPUs rejects the engines that cannot train adapters (E613, counted in
    its report: every train engine whose record's `lora` is not `train` refused: megatron) and picks one that
    does (torch on 2 ranks: fsdp's); for the full model an engine with model-parallel axes (megatron) is a
    candidate again."""
    text = FLOW.split("schedule")[0] + "schedule main auto on cluster(gpus_per_node = 2) {{}}\n"
    path = tmp_path / "auto.flow"
    path.write_text(text.format(arch="llama", lora=LORA, data=DATA))
    plan = lower(compile_file(str(path)).graph)
    train = plan.model("policy").train_engine
    assert ENGINES[train.kind].lora == "train"
    assert any(reason.startswith("E613") for reason in plan.search.rejected)
    verdicts = {v.engine: v.verdict for v in plan.search.engines if v.role == "train"}
    no_lora = {name for name in verdicts if ENGINES[name].lora != "train"}
    assert no_lora and all(verdicts[name] == "refused" for name in no_lora), verdicts
    path.write_text(text.replace(", lora = {lora}", "").format(arch="llama", data=DATA))
    full = lower(compile_file(str(path)).graph).search
    assert not any(reason.startswith("E613") for reason in full.rejected)
    assert any(v.verdict in ("chosen", "feasible") and "tp" in ENGINES[v.engine].axes
               for v in full.engines if v.role == "train"), full.engines


def test_lora_options_are_checked_against_the_record(tmp_path):
    """`lora(...)`'s options are checked like an op's (its record in flowrl.catalog.adapters), at the value."""
    with pytest.raises(FlowError) as e:
        _compile(tmp_path, lora="lora(r = 0, dropout = 1.5, rank = 4)")
    first = (tmp_path / "lora.flow").read_text().splitlines()[0]
    got = {(d.code, d.span.column) for d in e.value.diagnostics}
    assert got == {("E208", first.index("r = 0") + 5), ("E208", first.index("1.5") + 1),
                   ("E206", first.index("rank = 4") + 8)}, got  # an unknown option: at its value, as for losses
    with pytest.raises(FlowError, match=r"E211.*unknown adapter \"qlora\""):
        _compile(tmp_path, lora='"qlora"')
