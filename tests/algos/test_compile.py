"""What the compiler knows of the algorithms: dynamic sampling's expected draws, the optimiser options."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.catalog.ops import PRODUCER_KINDS, OpKind
from flowrl.compiler.lower import lower
from flowrl.compiler.pipeline import compile_text
from flowrl.compiler.workload import workload

ROOT = Path(__file__).resolve().parents[2]

DAPO = """import stdlib.dapo
model policy = tiny(task = "arith")
dataset arith = jsonl("{root}/data/arith/train.jsonl")
reward exact = verifier("math")
flow main(steps: int = 10) {{
  dapo(policy, arith, exact, batch = 16, draw_batch = 16, group = 4, max_tokens = 5, overlong_buffer = 1, {extra})
}}
"""


def _dapo(extra: str = "lr = 1e-4"):
    return compile_text(DAPO.format(root=ROOT, extra=extra), str(ROOT / "flows" / "dapo_test.flow"))


def test_filter_groups_is_a_producer_op_that_keeps_size_groups():
    g = _dapo()
    kept = g.node("dapo.kept")
    assert kept.kind == OpKind.FILTER and kept.kind in PRODUCER_KINDS
    assert {"rewards", "response_ids", "group_ids"} <= kept.fields  # the rollouts' fields pass through
    w = workload(g)
    assert w.samples["dapo.kept"] == 16 * 4 and w.samples["dapo.update"] == 16 * 4


@pytest.mark.parametrize("extra, draws", [
    ("expect_keep = 0.5", 2.0),  # 16 groups a draw, half kept: two draws for 16
    ("expect_keep = 0.25", 4.0),
    ("expect_keep = 0.1", 4.0),  # capped by max_draws = 4
    ("expect_keep = 0.1, max_draws = 1", 1.0),
    ("expect_keep = 1.0", 1.0),
])
def test_the_workload_counts_the_expected_draws(extra, draws):
    w = workload(_dapo(extra))
    (gen,) = w.gens
    assert gen.draws == pytest.approx(draws)
    assert gen.samples == 64 and gen.generated == round(64 * draws)  # trained vs generated completions
    assert w.samples["dapo.rollouts"] == round(64 * draws)  # the generate and score ops run once per draw
    assert w.samples["dapo.scores"] == round(64 * draws)


def test_the_estimate_pays_for_the_draws_but_trains_one_batch():
    one = _dapo("expect_keep = 0.25, max_draws = 1").sched.estimate
    four = _dapo("expect_keep = 0.25").sched.estimate
    assert four.breakdown["reward"] > 2 * one.breakdown["reward"]  # scoring four draws (plus a fixed cost per call)
    assert four.breakdown["update"] == pytest.approx(one.breakdown["update"], rel=0.05)  # one batch trained
    assert any("expected to run 4 times a step" in n for n in four.notes)
    assert not any("expected to run" in n for n in one.notes)


def test_optimiser_options_reach_the_plan_and_the_schedule_spans_the_run():
    plan = lower(_dapo('lr = 1e-4, lr_schedule = "cosine", warmup = 3, min_lr_ratio = 0.1, minibatches = 2'),
                 {"steps": 7})
    optim = plan.model("policy").optim
    assert optim == {"lr": 1e-4, "weight_decay": 0.0, "beta1": 0.9, "beta2": 0.999, "grad_clip": 1.0,
                     "lr_schedule": "cosine", "warmup": 3, "min_lr_ratio": 0.1, "schedule_steps": 14}


# ---- schedule auto never leaves stale samples uncorrected ----------------------------------------------

AUTO = (ROOT / "flows" / "grpo_auto.flow").read_text()


def _update(text: str):
    g = compile_text(text, str(ROOT / "flows" / "grpo_auto.flow"))
    (update,) = [n for n in g.nodes() if n.kind == OpKind.UPDATE]
    return g, update


def test_schedule_auto_adds_tis_when_it_picks_staleness_2_and_says_so():
    g, update = _update(AUTO)
    assert g.sched.staleness == 2 and g.sched.spec.auto
    assert update.attr("tis").value == 2.0
    assert any("`schedule auto` chose a staleness" in n and "tis = 2.0" in n for n in g.sched.notes)
    assert lower(g).ops[[op.id for op in lower(g).ops].index(update.id)].options["tis"] == 2.0


def test_schedule_auto_keeps_the_user_s_correction_or_opt_out():
    for extra, tis in (("mis = 3.0", 0.0), ("tis = 1.5", 1.5), ("auto_correct = false", 0.0)):
        text = _with_option(AUTO, extra)
        g, update = _update(text)
        assert g.sched.staleness == 2
        assert update.attr("tis").value == tis, extra
        assert not any("`schedule auto` chose a staleness" in n for n in g.sched.notes)
        uncorrected = any("without an off-policy correction" in n for n in g.sched.notes)
        assert uncorrected == (extra == "auto_correct = false")


def test_a_written_staleness_only_gets_the_note():
    text = AUTO.split("\nschedule main")[0] + "\nschedule main on cluster(nodes = 1, gpus_per_node = 1) { staleness 2 }\n"
    g, update = _update(text)
    assert g.sched.staleness == 2 and not g.sched.spec.auto
    assert update.attr("tis").value == 0.0
    assert any("without an off-policy correction" in n for n in g.sched.notes)


def _with_option(text: str, option: str) -> str:
    """``text`` with ``option`` added to its stdlib grpo call's keyword arguments."""
    head, call = text.split("grpo(", 1)
    return head + "grpo(" + call.replace("\n  )", f"\n    {option},\n  )", 1)
