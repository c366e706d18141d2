"""Each CPU shim is needed: the engine with that one shim left out fails at the Megatron call
site the shim names, in the phase where that call site runs. (With every shim the same
scenario passes: see the tp/pp/dp equivalence tests.) Plus the shim module's own contract."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
from mcore_cases import OPTIM, make_batch, pg_loss  # noqa: E402

from flowrl.engines.megatron import MegatronRankError, MegatronTrainEngine  # noqa: E402
from flowrl.engines.megatron import cpu_shims  # noqa: E402

PHASES = ("start", "forward", "train_step")
MOE = "moe"
"""A layout key: run the case on the tiny Qwen3-MoE (its MoE layers reach the shim's call site)."""

NEEDED = {
    # shim name: (layout that reaches the call site, phase that fails, error text)
    "current_device": ({}, "start", "Torch not compiled with CUDA"),
    "rng": ({}, "start", "Torch not compiled with CUDA"),
    "cuda_literals_optimizer": ({}, "start", "Torch not compiled with CUDA"),
    "cuda_literals_schedules": ({}, "forward", "Torch not compiled with CUDA"),
    "synchronize": ({"pp": 2}, "forward", "Torch not compiled with CUDA"),
    "current_stream": ({}, "train_step", "Torch not compiled with CUDA"),
    "cuda_literals_clip_grads": ({}, "train_step", "Torch not compiled with CUDA"),
    "cuda_literals_utils": ({}, "train_step", "Torch not compiled with CUDA"),
    "clip_type_check": ({}, "train_step", "AssertionError"),
    "dist_opt_type_check": ({"dp": 2}, "start", "Wrapped parameters must be one of torch.cuda.FloatTensor"),
    "cp_pos_emb": ({"cp": 2}, "forward", "pin_memory=True requires a CUDA or other accelerator"),
    # on the tiny mixture of experts (MOE: the layout's model)
    "moe_dtoh_stream": ({MOE: True}, "start", "torch.cuda.Stream requires CUDA support"),
    "moe_splits": ({MOE: True, "dp": 2, "ep": 2}, "forward", "all_to_all_single(): incompatible function arguments"),
}


def test_every_shim_has_a_case():
    assert sorted(NEEDED) == sorted(s.name for s in cpu_shims.SHIMS)


def _reached(path: str, layout: dict, skip: str) -> str:
    """Run start -> forward -> train_step without shim ``skip``; the phase that failed (or 'none')."""
    phase = "start"
    try:
        with MegatronTrainEngine(path, optim=OPTIM, skip_cpu_shims=(skip,), timeout_s=120, **layout) as eng:
            phase = "forward"
            eng.forward(make_batch(), entropy=True)
            phase = "train_step"
            eng.train_step(make_batch(), pg_loss, micro_batch_size=4)
    except MegatronRankError as exc:
        return f"{phase}: {exc}"
    return "none"


QUICK = ("current_device", "cuda_literals_schedules", "clip_type_check")
"""One case per phase in ``make test``; the other ten start a Megatron engine each (5-8 s on 2 cores) to
re-prove a fact about the pinned Megatron-core, so they run in ``make test-long`` (run it when Megatron
is upgraded)."""


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    from flowrl.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("shims_moe") / "m", arch="qwen3_moe", seed=0))


@pytest.mark.parametrize("name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.long) for n in sorted(NEEDED)])
def test_engine_fails_without_the_shim(name, tiny_dir, request):
    layout, phase, text = NEEDED[name]
    layout = dict(layout)
    path = request.getfixturevalue("moe_dir") if layout.pop(MOE, False) else tiny_dir
    outcome = _reached(path, layout, name)
    assert outcome.startswith(f"{phase}: ") and text in outcome, outcome


def test_apply_and_remove_restore_every_attribute():
    before = (torch.cuda.current_device, torch.cuda.get_rng_state, torch.Tensor.type)
    try:
        applied = cpu_shims.apply_cpu_shims(skip=("rng",))
        assert "rng" not in applied and "current_device" in applied
        assert cpu_shims.apply_cpu_shims() == applied  # idempotent: a second call changes nothing
        assert torch.cuda.current_device() == torch.device("cpu")
        import megatron.core.utils as mcu

        assert mcu.torch.zeros(2, device="cuda").device.type == "cpu"
        assert mcu.torch.Tensor is torch.Tensor  # everything else is torch's own
    finally:
        cpu_shims.remove_cpu_shims()
    assert (torch.cuda.current_device, torch.cuda.get_rng_state, torch.Tensor.type) == before
    import megatron.core.utils as mcu

    assert mcu.torch is torch and cpu_shims.active_cpu_shims() == ()


def test_no_shims_when_a_gpu_is_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_shims.apply_cpu_shims() == ()
    assert cpu_shims.active_cpu_shims() == ()


def test_unknown_shim_name_is_rejected():
    with pytest.raises(ValueError, match="unknown CPU shim"):
        cpu_shims.apply_cpu_shims(skip=("no_such_shim",))
    cpu_shims.remove_cpu_shims()
