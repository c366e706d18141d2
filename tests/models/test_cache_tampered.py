"""What flowrl keeps in its cache (``$FLOWRL_CACHE``: warm starts, reward models, cost profiles) runs no
code when read back: each file of a real warm-start entry (enumerated from the entry, so a new kind
is covered), and each profile, replaced by a pickle whose loading writes a marker, is read as flowrl
reads it (the entry's record, its weights, its config and tokenizer; the profile) and the marker never
appears; a record or profile that is not JSON is a clear error naming it."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest

from flowrl.models.warmstart import SFTConfig, TinyModelConfig, WarmStartError, warm_start

SHORT = SFTConfig(steps=5, batch_size=8)
SMALL = TinyModelConfig(hidden=32, heads=1, kv_heads=1, intermediate=64, layers=1)


class Payload:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def read_back(entry: Path, cache: Path) -> None:
    """Everything of a warm-start entry a run reads: its record (the cache hit), weights, config, tokenizer."""
    from transformers import AutoModelForCausalLM

    from flowrl.models.tiny import load_tokenizer

    warm_start("arith", model_cfg=SMALL, sft=SHORT, seed=0, cache_dir=cache)
    AutoModelForCausalLM.from_pretrained(str(entry))
    load_tokenizer(entry)


def test_every_file_of_a_warm_start_entry_replaced_by_a_pickle_runs_nothing(tmp_path):
    cache = tmp_path / "cache"
    built = warm_start("arith", model_cfg=SMALL, sft=SHORT, seed=0, cache_dir=cache)
    entry = built.path
    files = sorted(p.relative_to(entry).as_posix() for p in entry.rglob("*") if p.is_file())
    assert "warmstart.json" in files and any(f.endswith(".safetensors") for f in files)
    marker = tmp_path / "code-ran"
    refused = []
    for rel in files:
        copy = tmp_path / "copy"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(cache, copy)
        (copy / entry.name / rel).write_bytes(pickle.dumps(Payload(marker)))
        try:
            read_back(copy / entry.name, copy)
        except WarmStartError as e:
            assert f"{rel} cannot be read" in str(e) and "hint: delete" in str(e)
            refused.append(rel)
        except Exception:  # noqa: BLE001 - the weights' and tokenizer's loaders refuse in their own words
            refused.append(rel)
        assert not marker.exists(), f"reading a cache entry whose {rel} was replaced ran code"
    assert "warmstart.json" in refused and any(f.endswith(".safetensors") for f in refused), refused


def test_a_reward_model_record_and_profiles_replaced_by_a_pickle_run_nothing(tmp_path, monkeypatch):
    from flowrl.cost.profiles import ProfileError, cpu_profile, load_profile, profile_path
    from flowrl.warmcache import read_entry

    marker = tmp_path / "code-ran"
    payload = pickle.dumps(Payload(marker))
    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "reward.json").write_bytes(payload)
    with pytest.raises(WarmStartError, match=r"rm is damaged: reward.json cannot be read .*hint: delete"):
        read_entry(tmp_path / "rm" / "reward.json")
    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FLOWRL_PROFILE", raising=False)
    profile_path().parent.mkdir(parents=True)
    profile_path().write_bytes(payload)
    with pytest.raises(ProfileError, match="cannot read profile"):
        load_profile(profile_path())
    cpu_profile()  # falls back to the built-in profile
    assert not marker.exists()
