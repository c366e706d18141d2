"""Tiny local causal LMs with a character-level tokenizer.

No model hub is reachable, so every model flowrl tests or benchmarks on is built here:
a transformers causal LM of one of the tiny families (``LlamaForCausalLM`` by default, or
``arch``: :data:`~flowrl.catalog.architectures.TINY_ARCHS`) with random (seeded) fp32
weights, saved with ``save_pretrained`` next to a ``tokenizers``-backed tokenizer. The
directory loads in transformers and in vLLM (CPU build).

Constraints that come from vLLM's CPU backend:

* ``head_dim = hidden / heads`` must be >= 32 ("Unsupported CPU attention configuration").
* Untied embeddings (``tie_word_embeddings=False``, except GPT-2, tied by design): every parameter then has its own
  tensor in the checkpoint, so streaming weights into a running engine needs no special
  case for the shared ``lm_head``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from flowrl.catalog.architectures import TINY_ARCHS
from flowrl.models.families import family_config, model_class

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
"""Special tokens; their ids are 0..3 in this order."""

MIN_HEAD_DIM = 32
"""vLLM's CPU attention kernels reject smaller heads."""


class TinyModelError(ValueError):
    """A tiny-model request that cannot be built (bad shape, unknown arch, bad charset)."""


_ARCHS = TINY_ARCHS
"""Families a tiny model can be (``tiny(arch = ...)``): :mod:`flowrl.models.families` builds their configs."""


def build_tokenizer(chars: str) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character of ``chars`` plus 4 specials.

    Ids: ``<pad>``=0, ``<bos>``=1, ``<eos>``=2, ``<unk>``=3, then the characters of ``chars``
    in the given order. Encoding with special tokens prepends ``<bos>`` (so vLLM and
    transformers build the same prompt ids); decoding concatenates characters with no
    separator. No chat template is set: prompts are used verbatim.
    """
    if not chars:
        raise TinyModelError("build_tokenizer: empty charset; pass the characters the task uses, e.g. '0123456789+-='")
    dupes = sorted({c for c in chars if chars.count(c) > 1})
    if dupes:
        raise TinyModelError(f"build_tokenizer: charset {chars!r} repeats {dupes}; list each character once")
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for c in chars:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own pre-token ([\s\S] so that newlines are characters too).
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join tokens with no spaces in between
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        padding_side="left",  # batched generation needs prompts aligned on the right
    )


def tiny_config(
    vocab_size: int,
    *,
    arch: str = "llama",
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 256,
    max_position: int = 128,
):
    """The transformers config of a tiny model (fp32, specials 0..3; embeddings untied unless the
    family ties them: GPT-2)."""
    if arch not in _ARCHS:
        raise TinyModelError(f"unknown tiny model arch {arch!r}; choose one of {sorted(_ARCHS)}")
    if hidden % heads or heads % kv_heads:
        raise TinyModelError(
            f"hidden={hidden}, heads={heads}, kv_heads={kv_heads}: hidden must divide by heads and heads by kv_heads"
        )
    if hidden // heads < MIN_HEAD_DIM:
        raise TinyModelError(
            f"head_dim = hidden/heads = {hidden}/{heads} = {hidden // heads} < {MIN_HEAD_DIM}; "
            f"vLLM's CPU attention needs >= {MIN_HEAD_DIM}: use fewer heads or a larger hidden size"
        )
    return family_config(
        arch, vocab_size=vocab_size, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
        intermediate=intermediate, max_position=max_position,
        pad_id=SPECIALS.index(PAD), bos_id=SPECIALS.index(BOS), eos_id=SPECIALS.index(EOS),
    )


def build_tiny_model(
    out_dir: str | Path,
    *,
    chars: str = "0123456789+-=",
    arch: str = "llama",
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 256,
    max_position: int = 128,
    seed: int = 0,
) -> Path:
    """Write a randomly initialised tiny causal LM (config, safetensors, tokenizer) to ``out_dir``.

    ``chars`` is the tokenizer's character set (vocab = 4 specials + ``len(chars)``).
    Weights are fp32 and a function of ``seed`` only: the same arguments give a
    byte-identical ``model.safetensors``. Returns ``out_dir`` as a ``Path``.
    """
    tokenizer = build_tokenizer(chars)
    _check_charset_for_arch(chars, arch)
    config = tiny_config(
        len(tokenizer), arch=arch, hidden=hidden, layers=layers, heads=heads,
        kv_heads=kv_heads, intermediate=intermediate, max_position=max_position,
    )
    model_cls = model_class(arch)
    # A private generator state: building a model must not disturb the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "flowrl_tiny.json").write_text(json.dumps({"chars": chars, "arch": arch, "seed": seed}, indent=1))
    return out


def _check_charset_for_arch(chars: str, arch: str) -> None:
    """Reject charsets that a qwen2 checkpoint would silently mangle.

    transformers 5 (and vLLM, which loads tokenizers through ``AutoTokenizer``) ignores
    the saved tokenizer class for ``model_type == "qwen2"`` and rebuilds it as a
    byte-level BPE (``Qwen2Tokenizer``) over the saved vocabulary. For printable
    non-space ASCII that gives exactly the character-level ids; a space or a non-ASCII
    character would be dropped without an error.
    """
    if arch != "qwen2":
        return
    bad = sorted({c for c in chars if not 33 <= ord(c) <= 126})
    if bad:
        raise TinyModelError(
            f"arch='qwen2' cannot use characters {bad!r} in charset {chars!r}: transformers re-tokenizes qwen2 "
            "checkpoints byte-level and drops them; use arch='llama' or printable non-space ASCII only"
        )


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerFast:
    """The tokenizer saved in ``model_dir`` (left padding, as ``build_tokenizer`` sets it)."""
    tok = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    tok.padding_side = "left"
    return tok
