"""Metric names of a family with several producers: ``family/key``, or ``family/<owner>/key``.

Some metric families are written by one op or one model of the plan each: ``reward/*``
(a score op), ``filter/*`` (a dynamic-sampling op), ``adv/*`` (an advantage op), and per
trained policy ``staleness/*``, ``mismatch/*``, ``offpolicy/*``, ``kl/*`` and ``routing/*``, per generating model
``response/*``. A flow with two trained
models, or two score ops, has two producers of the same family: :func:`metric_name` gives
each its own name, so that neither overwrites the other in a step's row of ``metrics.jsonl``.
With a single producer the name stays plain (``reward/mean``: what the docs, the progress
line, the summary and the benchmarks read); with several it carries its owner (the op's id, or
the model's name), ``reward/<op id>/mean``, ``offpolicy/<model>/ratio_mean``.

>>> metric_name("reward", "mean", "grpo.scores", ["grpo.scores"])
'reward/mean'
>>> metric_name("reward", "mean", "grpo.scores", ["grpo.scores", "dapo.scores"])
'reward/grpo.scores/mean'
>>> metric_name("staleness", "hist/1", "policy", {"policy", "teacher"})
'staleness/policy/hist/1'
>>> owned_metrics({"filter/draws": 2.0, "perf/gen_tokens": 9}, "dapo.kept", ["dapo.kept", "b.kept"])
{'filter/dapo.kept/draws': 2.0, 'perf/gen_tokens': 9}
>>> unowned_name("reward/dapo.scores/mean", {"reward/mean"})
'reward/mean'
"""

from __future__ import annotations

from typing import Collection, Iterable, Mapping


def metric_name(family: str, key: str, owner: str, owners: Iterable[str]) -> str:
    """``family/key`` when ``owner`` is the family's only producer among ``owners`` (every
    producer of the family in the plan), else ``family/<owner>/key``. An owner missing from
    ``owners`` counts as one more producer (never a plain name that another one writes too)."""
    several = len(set(owners) | {owner}) > 1
    return f"{family}/{owner}/{key}" if several else f"{family}/{key}"


def owned_metrics(metrics: Mapping[str, object], owner: str, owners: Iterable[str]) -> dict[str, object]:
    """``metrics`` (``family/key`` names, as a function of :mod:`flowrl.algos` returns them) with
    each name of a family of :data:`OWNED_FAMILIES` through :func:`metric_name`; others unchanged."""
    owners = set(owners)
    out: dict[str, object] = {}
    for name, value in metrics.items():
        family, sep, key = name.partition("/")
        out[metric_name(family, key, owner, owners) if sep and family in OWNED_FAMILIES else name] = value
    return out


def unowned_name(name: str, plain: Collection[str]) -> str | None:
    """The plain name in ``plain`` that ``family/<owner>/key`` stands for (``reward/mean`` for
    ``reward/dapo.scores/mean``), ``name`` itself when it is plain, else None."""
    if name in plain:
        return name
    family, _, rest = name.partition("/")
    _, sep, key = rest.partition("/")
    if family in OWNED_FAMILIES and sep and f"{family}/{key}" in plain:
        return f"{family}/{key}"
    return None


OWNED_FAMILIES = frozenset({"reward", "filter", "adv", "staleness", "mismatch", "offpolicy", "kl", "response",
                            "routing"})
"""The families named by :func:`metric_name`: each written per op or per trained model."""


__all__ = ["metric_name", "owned_metrics", "unowned_name", "OWNED_FAMILIES"]
