"""Learning-rate schedules against transformers' schedulers, and the catalogue pairing."""

import pytest
import torch

from flowrl.algos import AlgoError, LR_SCHEDULES, lr_factor


def test_every_catalogue_schedule_has_a_shape():
    from flowrl.catalog.ops import LR_SCHEDULES as CATALOGUE

    assert tuple(LR_SCHEDULES) == CATALOGUE


def test_warmup_then_constant():
    assert [lr_factor(s, warmup=4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def _hf(factory, steps, **kw):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = factory(opt, **kw)
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("name", ["linear", "cosine"])
def test_decay_matches_transformers_after_the_warmup(name):
    """transformers warms up from 0 (step / warmup), flowrl from the first step ((step + 1) / warmup);
    after the warm-up both follow the same decay to the end of the schedule."""
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    factory = {"linear": get_linear_schedule_with_warmup, "cosine": get_cosine_schedule_with_warmup}[name]
    ref = _hf(factory, 25, num_warmup_steps=5, num_training_steps=20)
    ours = [lr_factor(s, schedule=name, warmup=5, total=20) for s in range(25)]
    assert ours[:5] == pytest.approx([(s + 1) / 5 for s in range(5)])
    assert ours[5:21] == pytest.approx(ref[5:21], abs=1e-9)
    assert ours[21:] == [0.0] * 4  # after the schedule's end the rate stays at its floor (transformers'
    # cosine would rise again)


def test_cosine_with_a_floor_matches_transformers_min_lr():
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    ref = _hf(get_cosine_with_min_lr_schedule_with_warmup, 12, num_warmup_steps=2, num_training_steps=10,
              min_lr_rate=0.1)
    ours = [lr_factor(s, schedule="cosine", warmup=2, total=10, min_ratio=0.1) for s in range(12)]
    assert ours[2:11] == pytest.approx(ref[2:11], abs=1e-9)
    assert ours[-1] == pytest.approx(0.1)
    # linear to a floor: halfway through the decay, halfway between 1 and the floor
    assert lr_factor(6, schedule="linear", warmup=2, total=10, min_ratio=0.2) == pytest.approx(0.6)


def test_bad_schedules_are_clear_errors():
    with pytest.raises(AlgoError, match="unknown schedule 'exp'"):
        lr_factor(0, schedule="exp")
    # a schedule no longer than its warm-up has decayed when the warm-up ends
    assert [lr_factor(s, schedule="cosine", warmup=2, total=2, min_ratio=0.1) for s in range(4)] == [0.5, 1.0, 0.1, 0.1]
    with pytest.raises(AlgoError, match="min_ratio=2"):
        lr_factor(0, min_ratio=2)
