"""Tiny local causal LMs with a character-level tokenizer.

No model hub is reachable, so every model flowrl tests or benchmarks on is built here:
a transformers causal LM of one of the tiny families (``LlamaForCausalLM`` by default, or
``arch``: :data:`~flowrl.catalog.architectures.TINY_ARCHS`) with random (seeded) fp32
weights, saved with ``save_pretrained`` next to a ``tokenizers``-backed tokenizer. The
directory loads in transformers and in vLLM (CPU build).

The shape and charset rules (``hidden`` divides by ``heads``, ``heads`` by ``kv_heads``, heads of
at least 32 channels for vLLM's CPU attention, qwen2's printable-ASCII charset) are stated
once, in :func:`flowrl.catalog.models.tiny_shape_problems` and
:func:`~flowrl.catalog.models.tiny_charset_problems`: the builder raises the first problem
they find, ``flowrl check`` reports them at the flow's ``tiny(...)`` options (E611).

Another constraint from vLLM:

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

from flowrl.catalog.models import tiny_charset_problems, tiny_shape_problems
from flowrl.models.families import family_config, model_class

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
"""Special tokens; their ids are 0..3 in this order."""


class TinyModelError(ValueError):
    """A tiny-model request that cannot be built (bad shape, unknown arch, bad charset)."""


def build_tokenizer(chars: str) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character of ``chars`` plus 4 specials.

    Ids: ``<pad>``=0, ``<bos>``=1, ``<eos>``=2, ``<unk>``=3, then the characters of ``chars``
    in the given order. Encoding with special tokens prepends ``<bos>`` (so vLLM and
    transformers build the same prompt ids); decoding concatenates characters with no
    separator. No chat template is set: prompts are used verbatim.
    """
    for problem in tiny_charset_problems(chars):
        raise TinyModelError(f"build_tokenizer: {problem}")
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
    for problem in tiny_shape_problems(arch, hidden, heads, kv_heads):
        raise TinyModelError(str(problem))
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
    """Reject charsets that a qwen2 checkpoint would silently mangle
    (:func:`~flowrl.catalog.models.tiny_charset_problems`)."""
    for problem in tiny_charset_problems(chars, arch):
        raise TinyModelError(str(problem))


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerFast:
    """The tokenizer saved in ``model_dir`` (left padding, as ``build_tokenizer`` sets it)."""
    tok = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    tok.padding_side = "left"
    return tok
