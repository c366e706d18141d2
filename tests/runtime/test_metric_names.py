"""Metric families with several producers get one name each; a single producer keeps the plain name.

The handlers' use of these names on a two-policy plan is tested in
``tests/algos/test_runtime_handlers.py`` (fake engines, no Ray).
"""

from __future__ import annotations

import pytest

from flowrl.runtime.metric_names import OWNED_FAMILIES, metric_name, owned_metrics, unowned_name
from flowrl.runtime.observe import SUMMARY_KEYS, summarize


@pytest.mark.parametrize("owners, expected", [
    (["a.scores"], "reward/mean"),                        # the only producer: plain
    ([], "reward/mean"),                                  # no list given: itself only
    (["a.scores", "a.scores"], "reward/mean"),            # the same producer listed twice
    (["a.scores", "b.scores"], "reward/a.scores/mean"),   # two: each its own
    (["b.scores"], "reward/a.scores/mean"),               # one other producer: never the plain name it writes
])
def test_metric_name(owners, expected):
    assert metric_name("reward", "mean", "a.scores", owners) == expected


def test_a_key_with_slashes_keeps_them_after_the_owner():
    assert metric_name("staleness", "hist/2", "policy", {"policy", "other"}) == "staleness/policy/hist/2"
    assert metric_name("staleness", "hist/2", "policy", {"policy"}) == "staleness/hist/2"


def test_owned_metrics_renames_only_the_owned_families():
    metrics = {"filter/draws": 3.0, "reward/mean": 0.5, "perf/gen_tokens": 7, "train/policy/pg_loss": 1.0}
    assert owned_metrics(metrics, "x", ["x"]) == metrics
    assert owned_metrics(metrics, "x", ["x", "y"]) == {"filter/x/draws": 3.0, "reward/x/mean": 0.5,
                                                       "perf/gen_tokens": 7, "train/policy/pg_loss": 1.0}


def test_unowned_name():
    plain = set(SUMMARY_KEYS)
    assert unowned_name("reward/mean", plain) == "reward/mean"
    assert unowned_name("reward/dapo#2.scores/mean", plain) == "reward/mean"
    assert unowned_name("mismatch/policy/abs_max", plain) == "mismatch/abs_max"
    assert unowned_name("reward/x/overlong_penalty", plain) is None  # not a summary key
    assert unowned_name("perf/x/step_s", plain) is None  # perf is not a family with owners
    assert unowned_name("kl/policy/ref", plain) == "kl/ref"
    assert {"reward", "filter", "adv", "staleness", "mismatch", "offpolicy", "kl", "response",
            "routing"} == OWNED_FAMILIES


def test_summarize_reports_each_owners_series():
    rows = [{"step": s, "reward/a.scores/mean": 0.1 * s, "reward/b.scores/mean": 0.5 - 0.1 * s,
             "mismatch/policy/kl": 1e-6 * s} for s in (1, 2, 3)]
    s = summarize(rows)
    assert "reward/mean" not in s
    assert s["reward/a.scores/mean"]["best"] == pytest.approx(0.3) and s["reward/a.scores/mean"]["best_step"] == 3
    assert s["reward/b.scores/mean"]["best"] == pytest.approx(0.4) and s["reward/b.scores/mean"]["best_step"] == 1
    assert s["mismatch/policy/kl"]["best_step"] == 1  # lower is better, as for mismatch/kl
