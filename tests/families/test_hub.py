"""`hf("org/name")` from the local Hugging Face cache, offline (flowrl.hub).

Each test builds a fake cache in a temporary folder with huggingface_hub's layout
(``models--org--name/refs/main``, ``snapshots/<commit>/`` linking into ``blobs/``) holding a
tiny checkpoint, points ``HF_HUB_CACHE`` / ``HF_HOME`` at it, and checks what ``flowrl check``
reads at compile time (by hand, without importing huggingface_hub) agrees with what
huggingface_hub itself finds at run time, and that a missing model names the download command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.compiler.pipeline import check_file, compile_file
from flowrl.compiler.lower import lower
from flowrl.diagnostics import FlowError
from flowrl.hub import HubError, cache_dir, cached_snapshot, find_checkpoint, is_hub_id, snapshot_path
from flowrl.models.tiny import build_tiny_model

from family_cases import COMMIT, fake_cache
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("source"), arch="qwen3", seed=0)


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "hf_home" / "hub"
    root.mkdir(parents=True)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


def test_hub_ids_and_the_cache_folder(tmp_path, monkeypatch):
    assert [is_hub_id(s) for s in ("Qwen/Qwen3-0.6B", "meta-llama/Llama-3.1-8B", "ckpt", "./a/b", "/a/b",
                                   "a/b/c", "~/x", "data/train.jsonl")] == [True, True, False, False, False,
                                                                           False, False, False]
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere"


@pytest.mark.parametrize("env", [{"HF_HOME": "/x/home"}, {"HF_HOME": "/x/home", "HF_HUB_CACHE": "/y/cache"},
                                 {"XDG_CACHE_HOME": "/z/xdg"}, {}])
def test_cache_folder_is_huggingface_hubs(env):
    """Read in a fresh interpreter, as huggingface_hub reads its environment once at import."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME")}
    code = "import huggingface_hub.constants as c, flowrl.hub as h; print(c.HF_HUB_CACHE); print(h.cache_dir())"
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         check=True).stdout.split()
    assert Path(out[0]) == Path(out[1])


def test_compile_time_reading_agrees_with_huggingface_hub(hub, tiny_source):
    snapshot = fake_cache(hub, "acme/tiny-qwen3", tiny_source)
    assert cached_snapshot("acme/tiny-qwen3") == snapshot
    assert cached_snapshot("acme/tiny-qwen3", COMMIT) == snapshot
    assert cached_snapshot("acme/other") is None and cached_snapshot("acme/tiny-qwen3", "dev") is None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache("acme/tiny-qwen3", "config.json", cache_dir=str(hub))
    assert Path(found) == snapshot / "config.json"
    assert snapshot_path("acme/tiny-qwen3") == snapshot
    # A local directory of the same spelling wins (it is what the flow file's folder holds).
    local = hub.parent / "acme" / "tiny-qwen3"
    assert find_checkpoint("acme/tiny-qwen3", local) == snapshot
    build_tiny_model(local, seed=1)
    assert find_checkpoint("acme/tiny-qwen3", local) == local


def test_missing_model_or_weights_name_the_download_command(hub, tiny_source):
    with pytest.raises(HubError, match=r"`acme/none` is not a local directory nor in the local Hugging Face cache; "
                                       r"flowrl never downloads: put it in the local Hugging Face cache with "
                                       r"`hf download acme/none`"):
        snapshot_path("acme/none")
    fake_cache(hub, "acme/partial", tiny_source, skip=("model.safetensors",))
    assert cached_snapshot("acme/partial") is not None  # config.json is there: check can plan it
    with pytest.raises(HubError, match=r"has no weights \(\*.safetensors\): the download was partial"):
        snapshot_path("acme/partial")


FLOW = """model policy = hf("{model}")
dataset d = jsonl("train.jsonl")
reward r = verifier("exact")
flow main() {{
  x = generate(policy, sample(d, size = 2), n = 2, max_tokens = 8)
  update(policy, x, group_advantage(r(x), group = 2), logprobs(policy, x))
}}
"""


def _flow(tmp: Path, model: str) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "train.jsonl").write_text(json.dumps({"prompt": "1+2=", "answer": "3"}) + "\n")
    path = tmp / "f.flow"
    path.write_text(FLOW.format(model=model))
    return path


def test_check_plans_a_cached_hub_id_from_its_config(hub, tiny_source, tmp_path):
    fake_cache(hub, "acme/tiny-qwen3", tiny_source)
    compiled = compile_file(str(_flow(tmp_path / "flows", "acme/tiny-qwen3")))
    facts = compiled.graph.sched.facts["policy"]
    assert (facts.architecture, facts.hidden, facts.max_len) == ("Qwen3ForCausalLM", 128, 128)
    model = next(m for m in lower(compiled.graph).models if m.id == "policy")
    assert model.args["hub_id"] == "acme/tiny-qwen3" and model.facts["architecture"] == "Qwen3ForCausalLM"
    from flowrl.runtime.materialize import hf

    logged = []
    assert hf(model, {}, logged.append, 0) == cached_snapshot("acme/tiny-qwen3")
    assert "from the local Hugging Face cache" in logged[0]


def test_check_names_the_download_command_for_a_missing_hub_id(hub, tmp_path):
    with pytest.raises(FlowError) as e:
        check_file(str(_flow(tmp_path / "flows", "acme/not-downloaded")))
    [d] = e.value.diagnostics
    assert d.code == "E603" and "is not in the local Hugging Face cache nor a model flowrl knows" in d.message
    assert "`hf download acme/not-downloaded`" in d.hint


def test_run_time_names_the_download_command(hub, tiny_source, tmp_path):
    """A preset hub id plans without the checkpoint; running it needs the cache."""
    compiled = compile_file(str(_flow(tmp_path / "flows2", "Qwen/Qwen2.5-0.5B")))
    model = next(m for m in lower(compiled.graph).models if m.id == "policy")
    from flowrl.runtime.errors import RuntimeFlowError
    from flowrl.runtime.materialize import hf

    with pytest.raises(RuntimeFlowError, match="hf download Qwen/Qwen2.5-0.5B"):
        hf(model, {}, print, 0)


def test_check_reads_the_cache_without_importing_huggingface_hub(hub, tiny_source, tmp_path):
    fake_cache(hub, "acme/tiny-qwen3", tiny_source)
    path = _flow(tmp_path / "flows", "acme/tiny-qwen3")
    code = ("import sys; from flowrl.compiler.pipeline import check_file; check_file(sys.argv[1]); "
            "heavy = sorted(m for m in ('torch', 'huggingface_hub', 'transformers', 'ray', 'vllm') if m in sys.modules); "
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code, str(path)], env=dict(os.environ), capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
