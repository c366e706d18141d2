"""Shared pieces of the model-family tests: the tiny checkpoint of each family, prompts, a loss.

A module of its own (not conftest) so that ``from family_cases import ...`` resolves in pytest
and in the Megatron engine's spawned rank processes alike (the loss is pickled by reference)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from flowrl.engines.types import TokenBatch

CHARS = "0123456789+-=abcdefgh"
"""The tokenizer's characters (vocab = 4 specials + 21)."""

PROMPTS = [[1, 4 + i, 14, 5 + i % 3, 16] for i in range(6)]
"""Six short prompts (``<bos>`` then characters)."""


def build_family(arch: str, out: Path, seed: int = 0) -> str:
    """A tiny random checkpoint of family ``arch`` (hidden 128, 2 layers, 4 heads, 2 KV heads, the
    family's own extras: :data:`~flowrl.catalog.architectures.TINY_ARCHS`).

    Initialised wider than transformers' default (std 0.1, not 0.02) so that next-token
    distributions are peaked: with near-uniform ones, a wrong RoPE or a missing QK-norm would
    move log-probs by less than the tolerance and go unseen.
    """
    from flowrl.models.families import model_class
    from flowrl.models.tiny import build_tokenizer, tiny_config

    tokenizer = build_tokenizer(CHARS)
    config = tiny_config(len(tokenizer), arch=arch)
    config.initializer_range = 0.1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(arch)(config).to(torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def pg_loss(outputs: dict, mb: TokenBatch, denom: dict) -> torch.Tensor:
    """A policy-gradient loss with fixed pseudo-advantages (+1 on even rows, -1 on odd rows):
    one step moves the weights in a direction that changes the log-probs visibly."""
    sign = (torch.arange(mb.size) % 2 * -2 + 1).float()[:, None]
    return -(outputs["logprobs"] * sign * mb.response_mask).sum() / denom["tokens"]


def max_gap(trainer_logprobs: torch.Tensor, batch: TokenBatch) -> tuple[float, float, int]:
    """(max, mean) |trainer - rollout| log-prob over the response tokens of ``batch``, and their count."""
    mask = batch.response_mask.bool()
    gap = (trainer_logprobs - batch.extras["rollout_logprobs"])[mask].abs()
    return float(gap.max()), float(gap.mean()), int(mask.sum())


# ---- tokenizers of the four families, built locally (tokenizers library, no hub) ---------------

CORPUS = ["What is 2+2? The answer is 4.", "Hello there, how are you today?", "Compute 12 * 7 = 84 please.",
          "The quick brown fox jumps over the lazy dog.", "system user assistant tool message"] * 4
"""Text a tiny byte-level BPE is trained on (deterministic: same merges every run)."""

LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
CHATML_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
MISTRAL_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{%- if message['role'] == 'user' %}"
    "{{- '[INST] ' + message['content'] + ' [/INST]' }}{%- else %}{{- message['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}")

TOKENIZER_FAMILIES = {
    # specials, bos, eos, pad, whether the tokenizer adds BOS, chat template, generation_config's eos
    "llama3": dict(specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                             "<|eot_id|>"], bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None, add_bos=True,
                   template=LLAMA3_TEMPLATE, stops=["<|end_of_text|>", "<|eot_id|>"]),
    "qwen": dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos=None, eos="<|im_end|>",
                 pad="<|endoftext|>", add_bos=False, template=CHATML_TEMPLATE, stops=["<|im_end|>", "<|endoftext|>"]),
    "mistral": dict(specials=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], bos="<s>", eos="</s>", pad=None,
                    add_bos=True, template=MISTRAL_TEMPLATE, stops=["</s>"]),
    "gpt2": dict(specials=["<|endoftext|>"], bos="<|endoftext|>", eos="<|endoftext|>", pad=None, add_bos=False,
                 template=None, stops=["<|endoftext|>"]),
}
"""How each family's real tokenizer treats its special tokens (Llama 3 instruct, Qwen2/3 instruct,
Mistral instruct, GPT-2), on a tiny byte-level BPE."""


def build_family_tokenizer(family: str):
    """A ``PreTrainedTokenizerFast`` with family ``family``'s special tokens, BOS rule and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    f = TOKENIZER_FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=f["specials"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    if f["add_bos"]:
        tok.post_processor = processors.TemplateProcessing(single=f"{f['bos']} $A", pair=f"{f['bos']} $A $B",
                                                           special_tokens=[(f["bos"], tok.token_to_id(f["bos"]))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    kwargs = {k: f[k] for k in ("bos", "eos", "pad") if f[k] is not None}
    out = PreTrainedTokenizerFast(tokenizer_object=tok, **{f"{k}_token": v for k, v in kwargs.items()})
    if f["template"]:
        out.chat_template = f["template"]
    return out


# ---- a local Hugging Face cache, as `hf download` lays it out ----------------------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"
"""The snapshot's commit hash (``refs/main`` points at it)."""


def fake_cache(root: Path, repo_id: str, source: Path, *, skip: tuple[str, ...] = ()) -> Path:
    """Put the files of ``source`` into a hub cache at ``root`` as ``hf download`` lays them out."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for f in sorted(source.iterdir()):
        if f.name in skip:
            continue
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot
