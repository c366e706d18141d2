"""write_hf_checkpoint: an engine's named weights become a directory transformers loads back exactly."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from flowrl.engines.hf_export import write_hf_checkpoint
from flowrl.models.tiny import build_tiny_model


def test_round_trip_with_changed_weights(tmp_path):
    src = build_tiny_model(tmp_path / "src", hidden=64, heads=2, kv_heads=1, layers=1, seed=0)
    model = AutoModelForCausalLM.from_pretrained(src)
    new = {k: v + 0.5 for k, v in model.state_dict().items()}  # "trained" weights
    out = write_hf_checkpoint(src, tmp_path / "out", new.items())
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert any(p.name.startswith("tokenizer") for p in out.iterdir())  # tokenizer files come along
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for k, v in new.items():
        assert torch.equal(loaded[k], v), k


def test_tied_head_is_left_to_the_loader(tmp_path):
    from safetensors.torch import load_file

    src = build_tiny_model(tmp_path / "src", hidden=64, heads=2, kv_heads=1, layers=1, seed=0)
    weights = dict(AutoModelForCausalLM.from_pretrained(src).state_dict())
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # shared storage, as a tied model has
    out = write_hf_checkpoint(src, tmp_path / "out", weights.items(), tied=True)
    assert "lm_head.weight" not in load_file(str(out / "model.safetensors"))
