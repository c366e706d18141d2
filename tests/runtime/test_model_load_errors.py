"""A model an engine cannot load is the user's error, naming the model, its directory and the cause.

Before any engine starts, the runtime reads the checkpoint as ``flowrl check`` does
(:mod:`flowrl.model_files`: the files may have changed since the check); an engine whose loader still
refuses the files (a config.json of another size than the weights: every file whole, the tensors the
wrong shape) is :class:`~flowrl.runtime.errors.ModelLoadError`, never "internal error".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_kit import make_workdir, shared_ray, write_flow  # noqa: E402

from flowrl.compiler.pipeline import compile_file  # noqa: E402
from flowrl.compiler.lower import lower  # noqa: E402
from flowrl.runtime.errors import ModelLoadError, RuntimeFlowError, innermost, user_error  # noqa: E402
from flowrl.runtime.materialize import hf  # noqa: E402

SCHEDULE = """
schedule main on cluster(nodes = 1, gpus_per_node = 1) {
  policy.rollout = hf_generate()
}
"""
BODY = "grpo(policy, prompts, sevens, batch = 4, group = 2, max_tokens = 4, lr = 3e-3, kl = 0.0, seed = 1)"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return make_workdir(tmp_path_factory.mktemp("load"), rows=20, train=16)


def test_files_removed_after_check_are_refused_before_any_engine_starts(workdir):
    path = write_flow(workdir / "f.flow", BODY, steps=1, schedule=SCHEDULE)
    model = next(m for m in lower(compile_file(str(path)).graph).models if m.id == "policy")
    assert hf(model, {}, print, 0) == workdir / "model"
    tokenizer = workdir / "model" / "tokenizer.json"
    kept = tokenizer.read_bytes()
    tokenizer.unlink()
    try:
        with pytest.raises(RuntimeFlowError) as info:
            hf(model, {}, print, 0)
    finally:
        tokenizer.write_bytes(kept)
    message = user_error(info.value)
    assert message.startswith(f"{path}:2:16: model `policy`: {workdir / 'model'} cannot be loaded: no tokenizer"), message
    assert "hint: save the model's tokenizer next to it" in message


def test_innermost_reads_the_loaders_error_through_rays_wrapping():
    class Wrapped(Exception):
        def __init__(self, cause):
            super().__init__("ray::TrainWorker.__init__() (pid=1)\n  File ...")
            self.cause = cause

    assert innermost(Wrapped(RuntimeError("size mismatch for lm_head.weight\nmore"))) == \
        "RuntimeError: size mismatch for lm_head.weight"


@pytest.mark.slow
def test_an_engine_that_cannot_load_its_model_names_model_directory_and_cause(workdir, tmp_path):
    """The policy's config.json says intermediate_size is twice what its weights hold: check accepts the files
    (each whole, a config flowrl knows), the engines' loader refuses the tensors at start-up."""
    import shutil

    bad = tmp_path / "work"
    shutil.copytree(workdir, bad)
    cfg = json.loads((bad / "model" / "config.json").read_text())
    (bad / "model" / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 2 * cfg["intermediate_size"]}))
    path = write_flow(bad / "f.flow", BODY, steps=1, schedule=SCHEDULE)
    compile_file(str(path))  # check accepts it
    with pytest.raises(Exception) as info:
        from flowrl.launch import run_file

        run_file(str(path), out=str(bad / "run"), ray_address=shared_ray())
    assert isinstance(info.value, ModelLoadError), repr(info.value)
    message = user_error(info.value)
    assert message is not None and message.startswith(f"{path}:"), message
    assert f"model `policy` could not be loaded from {bad / 'model'} by its engine `policy." in message, message
    assert "RuntimeError: " in message and "ignore_mismatched_sizes" in message, message
    assert "save_pretrained(dir)" in message


def test_a_tokenizer_its_loader_refuses_is_a_user_error_naming_the_directory(tmp_path):
    """tokenizer.json present (check's reading) but not one the loader takes: the driver's load is the user's error."""
    from model_dirs import write_planned_checkpoint

    from flowrl.runtime.materialize import load_tokenizer

    ckpt = write_planned_checkpoint(tmp_path / "m", {"architectures": ["LlamaForCausalLM"]})
    (ckpt / "tokenizer.json").write_text('{"model": {"type": "WordLevel", "vocab": 7}}')
    with pytest.raises(RuntimeFlowError) as info:
        load_tokenizer(ckpt, "f.flow:1:16: model `policy`: ")
    message = user_error(info.value)
    assert message.startswith(f"f.flow:1:16: model `policy`: the tokenizer in {ckpt} cannot be loaded: "), message
    assert "AutoTokenizer.from_pretrained(src).save_pretrained(dir)" in message
