"""The catalogue's records of the algorithms agree with the math in flowrl.algos."""

import torch

from flowrl.algos import IS_LEVELS, cispo_loss, gspo_loss, importance_correction, lr_factor
from flowrl.catalog import ops as catalog_ops
from flowrl.catalog.losses import LOSSES
from flowrl.catalog.ops import OPS


def test_is_levels_and_schedules_pair_with_the_catalogue():
    assert tuple(IS_LEVELS) == catalog_ops.IS_LEVELS
    update = OPS["update"].kwargs
    assert update["is_level"].choices == catalog_ops.IS_LEVELS
    assert update["lr_schedule"].choices == catalog_ops.LR_SCHEDULES
    assert set(catalog_ops.OPTIMIZER_OPTIONS) <= set(update)


def test_redraw_options_are_options_of_their_op():
    redrawing = [spec for spec in OPS.values() if spec.redraw is not None]
    assert [s.name for s in redrawing] == ["filter_groups"]
    for spec in redrawing:
        assert {spec.redraw.size, spec.redraw.max_draws, spec.redraw.keep} <= set(spec.kwargs)
        assert spec.group_option in spec.kwargs


def test_loss_defaults_run_in_their_functions():
    """A flow that writes `gspo()` or `cispo()` runs the catalogue's defaults through these functions."""
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(3, 4, generator=g).requires_grad_(True)
    old, adv, mask = torch.randn(3, 4, generator=g), torch.randn(3, generator=g), torch.ones(3, 4)
    defaults = {name: {k: s.default for k, s in LOSSES[name].params} for name in ("gspo", "cispo")}
    gspo_loss(lp, old, adv, mask, clip_low=defaults["gspo"]["clip"], clip_high=defaults["gspo"]["clip_high"],
              agg=defaults["gspo"]["agg"])[0].backward()
    cispo_loss(lp, old, adv, mask, clip_low=defaults["cispo"]["clip"], clip_high=defaults["cispo"]["clip_high"],
               agg=defaults["cispo"]["agg"])[0].backward()
    assert torch.isfinite(lp.grad).all()


def test_update_option_extremes_the_compiler_accepts_run():
    """Every value the catalogue's ranges admit is computable (nothing `check` accepts fails at run time)."""
    train, rollout, mask = torch.zeros(2, 3), torch.full((2, 3), -0.5), torch.ones(2, 3)
    for mis, mis_low in ((0.0, 0.0), (0.5, 0.0), (1.0, 0.0), (2.0, 3.0), (1e9, 0.0)):
        for level in IS_LEVELS:
            w, _ = importance_correction(train, rollout, mask, tis=0.0, mis=mis, mis_low=mis_low, level=level)
            assert w is None or torch.isfinite(w).all()
    for schedule in catalog_ops.LR_SCHEDULES:
        for warmup, total in ((0, 0), (3, 0), (3, 2), (0, 10)):
            assert 0.0 <= lr_factor(5, schedule=schedule, warmup=warmup, total=total, min_ratio=1.0) <= 1.0
