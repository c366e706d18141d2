"""transformers configs of the tiny model families (``tiny(arch = ...)``), built locally.

Each variant of :data:`~flowrl.catalog.architectures.TINY_ARCHS` names an architecture record
(its ``config.json`` keys: GPT-2 says ``n_embd`` where Llama says ``hidden_size``) and the
config entries that make the variant (Llama 3.x's RoPE scaling, Qwen3's head size). This
module turns a shape into that family's transformers config and model class; the tokenizer
and the weights are :mod:`flowrl.models.tiny`'s.

>>> cfg = family_config("gpt2", vocab_size=20, hidden=64, layers=1, heads=2, kv_heads=2,
...                     intermediate=128, max_position=32, pad_id=0, bos_id=1, eos_id=2)
>>> type(cfg).__name__, cfg.n_embd, cfg.n_positions, cfg.tie_word_embeddings
('GPT2Config', 64, 32, True)

A mixture of experts' expert entries are its variant's (Qwen3-MoE: 8 experts of width 64, 2 per token);
``intermediate`` sizes the dense MLP of layers without experts (none in the tiny variant):

>>> cfg = family_config("qwen3_moe", vocab_size=20, hidden=64, layers=1, heads=2, kv_heads=1,
...                     intermediate=128, max_position=32, pad_id=0, bos_id=1, eos_id=2)
>>> cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.head_dim
(8, 2, 64, 64)
"""

from __future__ import annotations

from flowrl.catalog.architectures import TINY_ARCHS, TinyArch


class UnknownFamily(ValueError):
    """A ``tiny(arch = ...)`` name that is not a variant of :data:`TINY_ARCHS`."""


def variant(arch: str) -> TinyArch:
    """The record of tiny variant ``arch``; :class:`UnknownFamily` naming the known ones otherwise."""
    if arch not in TINY_ARCHS:
        raise UnknownFamily(f"unknown tiny model arch {arch!r}; choose one of {sorted(TINY_ARCHS)}")
    return TINY_ARCHS[arch]


def family_config(arch: str, *, vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int,
                  intermediate: int, max_position: int, pad_id: int, bos_id: int, eos_id: int):
    """The transformers config (fp32) of tiny variant ``arch`` with this shape and these special ids.

    Embeddings are untied unless the family ties them by design (GPT-2); families without
    grouped-query attention (GPT-2) ignore ``kv_heads``.
    """
    from transformers import AutoConfig

    v = variant(arch)
    spec = v.spec
    shape = {"hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads,
             "intermediate": intermediate, "max_positions": max_position}
    entries = {spec.key(fact): value for fact, value in shape.items() if spec.key(fact)}
    entries.update(v.config)
    return AutoConfig.for_model(
        spec.family, **entries, vocab_size=vocab_size, tie_word_embeddings=spec.tied_default,
        pad_token_id=pad_id, bos_token_id=bos_id, eos_token_id=eos_id, architectures=[spec.name],
        torch_dtype="float32")


def model_class(arch: str):
    """The transformers causal-LM class of tiny variant ``arch`` (``Qwen3ForCausalLM``...)."""
    import transformers

    return getattr(transformers, variant(arch).architecture)


__all__ = ["family_config", "model_class", "variant", "UnknownFamily"]
