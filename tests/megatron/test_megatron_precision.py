"""megatron with a bf16 model on gloo (CPU): mixed precision (the default) keeps fp32 main params and
fp32 Adam moments in Megatron's distributed optimizer (sharded over dp = 2) and computes in bf16, the
resync's weights bf16. (``precision = "pure"`` is refused: tests/megatron/test_megatron_errors.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
from mcore_cases import OPTIM, make_batch, pg_loss  # noqa: E402

from flowrl.engines.base import load_tensors_file  # noqa: E402
from flowrl.engines.megatron import MegatronTrainEngine  # noqa: E402


def _rank_states(path: Path) -> list[dict]:
    return [load_tensors_file(f) for f in sorted(path.glob("*.pt"))]


def _optimizer_dtypes(state: dict) -> tuple[set, set]:
    """(dtypes of the main params, dtypes of Adam's moments) in one rank's checkpoint."""
    mains, moments = set(), set()
    for entry in state["optimizer"]:
        mains |= {t.dtype for t in entry["main_params"]}
        for s in entry["inner"]["state"].values():
            moments |= {v.dtype for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")}
    return mains, moments


@pytest.mark.slow  # two gloo ranks of Megatron: a minute and more on a loaded 2-core machine
def test_bf16_trains_fp32_main_params_sharded_over_dp(tiny_dir, tmp_path):
    with MegatronTrainEngine(tiny_dir, optim=OPTIM, dp=2, dtype="bfloat16", threads=1) as eng:
        stats = eng.train_step(make_batch(seed=1), pg_loss, micro_batch_size=2)
        assert stats["skipped"] == 0 and stats["grad_norm"] > 0
        assert {t.dtype for _, t in eng.named_weights()} == {torch.bfloat16}  # what a resync sends
        eng.save(str(tmp_path))
    ranks = _rank_states(tmp_path)
    assert len(ranks) == 2
    for state in ranks:
        mains, moments = _optimizer_dtypes(state)
        assert mains == {torch.float32} and moments == {torch.float32}  # the masters and Adam in fp32
        assert torch.bfloat16 in {t.dtype for t in state["model"].values()}  # the model computes in bf16
    shards = [sum(t.numel() for e in s["optimizer"] for t in e["main_params"]) for s in ranks]
    params = sum(t.numel() for t in ranks[0]["model"].values())
    assert sum(shards) == params and max(shards) < params  # each dp rank holds its shard of the masters

