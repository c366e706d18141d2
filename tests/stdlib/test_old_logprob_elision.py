"""Lowering drops the log-prob passes an update makes redundant (the elide_logprobs pass), and only those."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.compiler.explain import describe_plan
from flowrl.compiler.lower import lower
from flowrl.compiler.pipeline import compile_text

ROOT = Path(__file__).resolve().parents[2]
ARITH = (ROOT / "flows/arith_grpo.flow").read_text()
WITH_KL = {"kl: float = 0.0,": "kl: float = 0.001,"}


ONE_UPDATE = {"minibatches: int = 2,": "minibatches: int = 1,"}
"""The default flow takes two optimiser steps a batch; these tests start from one update a batch."""


def _plan(text: str = ARITH, **replace: str):
    for old, new in {**(ONE_UPDATE if text is ARITH else {}), **replace}.items():
        assert old in text, old
        text = text.replace(old, new)
    return lower(compile_text(text, str(ROOT / "flows/arith_grpo.flow")))


def _ops(plan) -> dict:
    return {op.id: op for op in plan.ops}


@pytest.mark.parametrize("staleness", [1, 2, 4])
def test_single_update_elides_the_old_logprobs(staleness):
    """The pass runs right before the update with the same weights, at any staleness."""
    ops = _ops(_plan(**WITH_KL, **{"staleness 1": f"staleness {staleness}"}))
    assert "grpo.old_lp" not in ops
    update = ops["grpo.update"]
    assert update.options["old_logprobs"] == "forward"
    assert update.options["elided"] == {"old": "grpo.old_lp"}
    assert "old" not in update.inputs
    assert update.inputs["ref_logprobs"] == "grpo.ref_lp"  # kl > 0: the reference pass stays


def test_without_kl_the_reference_pass_and_engine_go_too():
    plan = _plan()  # the default flow (kl = 0), one update a batch
    ops = _ops(plan)
    assert "grpo.ref_lp" not in ops and "grpo.old_lp" not in ops
    assert ops["grpo.update"].options["elided"] == {"old": "grpo.old_lp", "ref_logprobs": "grpo.ref_lp"}
    assert "ref_logprobs" not in ops["grpo.update"].inputs
    ref = plan.model("grpo.ref")
    assert ref.train_engine is None and ref.rollout_engine is None  # no actor is started for it
    assert plan.model("policy").train_engine is not None
    text = describe_plan(plan)
    assert "elided `grpo.ref_lp`: kl = 0" in text and "elided `grpo.old_lp`: old log-probs" in text


@pytest.mark.parametrize("change", [
    {"micro_batch = micro_batch,": "micro_batch = micro_batch,\n    epochs = 2,"},  # the 2nd epoch needs them
    {"minibatches: int = 1,": "minibatches: int = 2,"},
    {"micro_batch = micro_batch,": "micro_batch = micro_batch,\n    tis = 2.0,"},  # TIS weights before the loss
], ids=["epochs2", "minibatches2", "tis"])
def test_kept_where_the_forward_is_not_the_old_policy(change):
    ops = _ops(_plan(**change, **WITH_KL))
    assert ops["grpo.old_lp"].kind == "logprobs"
    assert ops["grpo.update"].inputs["old"] == "grpo.old_lp"
    assert "old_logprobs" not in ops["grpo.update"].options


def test_ppo_keeps_the_passes_that_kl_shaping_reads():
    """PPO's KL-in-reward reads the old and the reference log-probs before the update: both stay."""
    plan = _plan((ROOT / "flows/arith_ppo.flow").read_text())
    ops = _ops(plan)
    assert ops["ppo.shaped"].inputs["logprobs"] == "ppo.old_lp"
    assert ops["ppo.shaped"].inputs["ref_logprobs"] == "ppo.ref_lp"
    assert ops["ppo.actor_update"].inputs["old"] == "ppo.old_lp"
    assert ops["ppo.critic_update"].inputs["old"] == "ppo.old_values"  # a critic's old values: never elided
    assert plan.model("ppo.ref").train_engine is not None
