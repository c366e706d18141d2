"""`routing = "replay"` (R3) at `flowrl check`: accepted for a mixture of experts on engines that return
and replay routes (the generate then records them: its value carries `routed_experts`), refused with
E612 at the option as written everywhere else."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from flowrl.catalog.ops import ROUTES
from flowrl.compiler.lower import lower
from flowrl.compiler.passes.check_routing import _engine_replays
from flowrl.compiler.pipeline import compile_file
from flowrl.diagnostics import Collector, FlowError, Span

ROOT = Path(__file__).resolve().parents[2]

FLOW = """model policy = tiny(task = "arith", arch = "{arch}", warm_start = 0)
dataset d = jsonl("{data}")
reward r = verifier("math")

flow main() {{
  ref = frozen(policy)
  x = generate(policy, sample(d, size = 2), n = 2, max_tokens = 5)
  old = logprobs(policy, x, routing = "{old}")
  ref_lp = logprobs(ref, x, routing = "{ref}")
  update(policy, x, group_advantage(r(x), group = 2), old, ref_lp, kl = 0.1, routing = "{new}")
}}

schedule main on cluster(gpus_per_node = 1) {{
  policy.rollout = {rollout}
  policy.train = torch()
  {extra}
}}
"""


def _compile(tmp_path: Path, arch: str = "qwen3_moe", old: str = "replay", ref: str = "native", new: str = "replay",
             rollout: str = "vllm(tp = 1)", extra: str = ""):
    path = tmp_path / "r3.flow"
    path.write_text(FLOW.format(arch=arch, old=old, ref=ref, new=new, rollout=rollout, extra=extra,
                                data=ROOT / "data/arith/train.jsonl"))
    return compile_file(str(path))


def _errors(tmp_path: Path, **kw) -> list:
    with pytest.raises(FlowError) as e:
        _compile(tmp_path, **kw)
    return [d for d in e.value.diagnostics if d.code == "E612"]


def test_replay_is_accepted_and_the_generate_records_routes(tmp_path):
    plan = lower(_compile(tmp_path).graph)
    ops = {o.id: o for o in plan.ops}
    assert ROUTES in ops["x"].fields
    # `old` is elided (the update's first forward computes it, routed as the update routes)
    assert "old" not in ops and ops["update"].options["routing"] == "replay"
    assert ops["ref_lp"].options["routing"] == "native"
    native = lower(_compile(tmp_path, old="native", new="native").graph)
    assert all(ROUTES not in o.fields for o in native.ops)
    assert next(o for o in native.ops if o.op == "update").options["routing"] == "native"  # the default


def test_a_dense_model_is_refused_where_replay_is_written(tmp_path):
    errors = _errors(tmp_path, arch="llama")
    assert len(errors) == 2, errors
    assert [(e.span.line, e.span.column) for e in errors] == [(8, 39), (10, 88)]
    assert "`policy` is a dense model" in errors[0].message
    assert "drop `routing = \"replay\"`" in errors[0].hint


@pytest.mark.parametrize("rollout", ["sglang(tp = 1)", "hf_generate()"])
def test_a_rollout_engine_that_cannot_return_routes_is_refused(tmp_path, rollout):
    errors = _errors(tmp_path, rollout=rollout)
    assert len(errors) == 2 and errors[0].span.line == 8, errors
    engine = rollout.split("(")[0]
    assert (f"needs a rollout engine that returns the experts it routes each token to; `policy.rollout` is "
            f"`{engine}`, which does not") in errors[0].message
    assert errors[0].hint == "give `policy.rollout` `vllm(...)`, or use routing = \"native\""


def test_a_train_engine_that_cannot_replay_is_refused():
    """Called on a schedule state: fsdp and torch with 2 ranks (which run on fsdp's) take no mixture of
    experts (E607 first in a flow), and Megatron trains one without replaying routes."""
    span = Span("r3.flow", 3, 5, 3, 20)
    for kind, ranks in (("fsdp", 2), ("torch", 2), ("torch", 1), ("megatron", 2)):
        errors = Collector(None)
        st = SimpleNamespace(engines={"policy.train": SimpleNamespace(kind=kind, world_size=ranks)})
        ok = _engine_replays(st, "policy.train", "routes its forward by given experts", span, errors)
        assert ok == (kind == "torch" and ranks == 1)
        if not ok:
            (d,) = errors.items
            assert d.code == "E612" and d.span == span
            assert "`policy.train` is `" + kind + "`" in d.message and "`torch(...)` with one rank" in d.hint


def test_update_and_its_old_logprobs_must_route_alike(tmp_path):
    (error,) = _errors(tmp_path, old="native")
    assert (error.span.line, error.span.column) == (10, 88)
    assert "`update` replays the rollout engine's routes but `old` routes natively" in error.message
    (error,) = _errors(tmp_path, new="native")
    assert (error.span.line, error.span.column) == (8, 39)
    assert error.hint == "write routing = \"replay\" in `update` too, or in neither"


def test_replaying_the_policys_routes_in_another_model_is_refused(tmp_path):
    (error,) = _errors(tmp_path, ref="replay")
    assert error.span.line == 9
    assert "`ref_lp` replays in `ref` the routes `policy` chose for `x`" in error.message


def test_partial_rollouts_are_refused(tmp_path):
    errors = _errors(tmp_path, extra="partial_rollout(over_provision = 1.5, recycle = false)")
    assert len(errors) == 2 and "partial_rollout" in errors[0].message


def test_an_unknown_routing_is_an_error(tmp_path):
    with pytest.raises(FlowError) as e:
        _compile(tmp_path, old="replays")
    (d,) = [d for d in e.value.diagnostics if d.code == "E209"]
    assert "must be one of \"native\", \"replay\", got \"replays\"" in d.message and d.span.line == 8
