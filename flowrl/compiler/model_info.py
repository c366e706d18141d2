"""What the compiler knows about a model's shape: parameters, layers, heads, KV heads, hidden, vocab.

Layout checks (tp divides heads, pp divides layers), the memory model and the cost model
need these numbers, and ``flowrl plan`` must answer without a model hub or torch. So
facts come from, in this order:

* ``tiny(...)``: the constructor's options (``hidden``, ``layers``, ``heads``, ``kv_heads``)
  and the task's character set (vocab = 4 special tokens + one per character);
* ``hf("dir")``: the ``config.json`` in that local directory (relative paths are relative
  to the flow file, as for datasets);
* ``hf("Qwen/Qwen2.5-7B")``: a built-in table of public configs (:data:`PRESETS`), so a
  plan for a cluster can be made on a laptop that does not hold the checkpoint;
* ``frozen(m)`` / ``critic(m)``: the facts of ``m`` (a critic's value head, ``hidden + 1``
  parameters, is negligible and not counted).

Anything else (a flow parameter without a value, an ``hf`` path with no ``config.json``
that is not a preset) has no facts: the checks that need them are skipped, and
``flowrl plan`` says so.

>>> f = PRESETS["qwen/qwen2.5-7b"]
>>> round(f.params / 1e9, 2), f.layers, f.heads, f.kv_heads
(7.62, 28, 28, 4)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from flowrl.ir.graph import Const, FlowGraph, Node, Ref, plain
from flowrl.ir.ops import OpKind


@dataclass(frozen=True)
class ModelFacts:
    """The architecture numbers of a decoder-only transformer (Llama / Qwen2 family)."""

    name: str
    """Where the facts came from: ``tiny(arith)``, a preset name, or a config path."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = False
    """Input embedding and LM head share one tensor."""
    qkv_bias: bool = False
    """Qwen2 has biases on q/k/v projections."""
    head_dim: int = 0
    """0 means ``hidden // heads``."""
    dtype_bytes: int = 2
    """Bytes per weight in the checkpoint / engines (2 for bf16, 4 for fp32 tiny models)."""
    max_len: int = 4096
    """Longest sequence the model accepts (tokens)."""

    @property
    def hd(self) -> int:
        """Per-head dimension."""
        return self.head_dim or self.hidden // self.heads

    @property
    def params(self) -> int:
        """Parameter count: embeddings, LM head (if untied), attention, MLP, norms."""
        return self.embed_params * (1 if self.tied else 2) + self.layers * self.layer_params + self.hidden

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def layer_params(self) -> int:
        q, kv = self.heads * self.hd, self.kv_heads * self.hd
        attn = self.hidden * q + 2 * self.hidden * kv + q * self.hidden
        if self.qkv_bias:
            attn += q + 2 * kv
        mlp = 3 * self.hidden * self.intermediate
        return attn + mlp + 2 * self.hidden  # two RMSNorm weights

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int | None = None) -> int:
        """KV cache bytes per token over all layers (keys and values, unsharded)."""
        return 2 * self.layers * self.kv_heads * self.hd * (dtype_bytes or self.dtype_bytes)

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """HF checkpoint tensor names and shapes, one template per layer family (``{i}`` = layer).

        Used for bucket plans (the largest tensor) and resharding plans.
        """
        q, kv = self.heads * self.hd, self.kv_heads * self.hd
        out = [("model.embed_tokens.weight", (self.vocab, self.hidden))]
        layer = [("self_attn.q_proj.weight", (q, self.hidden)), ("self_attn.k_proj.weight", (kv, self.hidden)),
                 ("self_attn.v_proj.weight", (kv, self.hidden)), ("self_attn.o_proj.weight", (self.hidden, q)),
                 ("mlp.gate_proj.weight", (self.intermediate, self.hidden)),
                 ("mlp.up_proj.weight", (self.intermediate, self.hidden)),
                 ("mlp.down_proj.weight", (self.hidden, self.intermediate)),
                 ("input_layernorm.weight", (self.hidden,)), ("post_attention_layernorm.weight", (self.hidden,))]
        if self.qkv_bias:
            layer[3:3] = [("self_attn.q_proj.bias", (q,)), ("self_attn.k_proj.bias", (kv,)),
                          ("self_attn.v_proj.bias", (kv,))]
        out += [(f"model.layers.{{i}}.{name}", shape) for name, shape in layer]
        out.append(("model.norm.weight", (self.hidden,)))
        if not self.tied:
            out.append(("lm_head.weight", (self.vocab, self.hidden)))
        return out

    def to_dict(self) -> dict:
        """Plain values for the execution plan (JSON)."""
        return {"name": self.name, "params": self.params, "hidden": self.hidden, "layers": self.layers,
                "heads": self.heads, "kv_heads": self.kv_heads, "head_dim": self.hd,
                "intermediate": self.intermediate, "vocab": self.vocab, "tied": self.tied,
                "dtype_bytes": self.dtype_bytes, "max_len": self.max_len}


def _preset(name, hidden, layers, heads, kv, inter, vocab, tied, bias, max_len=32768) -> ModelFacts:
    return ModelFacts(name, hidden, layers, heads, kv, inter, vocab, tied, bias, max_len=max_len)


PRESETS: dict[str, ModelFacts] = {f.name.lower(): f for f in (
    # Public config.json values (hidden, layers, heads, kv heads, intermediate, vocab, tied, qkv bias).
    _preset("Qwen/Qwen2.5-0.5B", 896, 24, 14, 2, 4864, 151936, True, True),
    _preset("Qwen/Qwen2.5-1.5B", 1536, 28, 12, 2, 8960, 151936, True, True),
    _preset("Qwen/Qwen2.5-3B", 2048, 36, 16, 2, 11008, 151936, True, True),
    _preset("Qwen/Qwen2.5-7B", 3584, 28, 28, 4, 18944, 152064, False, True),
    _preset("Qwen/Qwen2.5-14B", 5120, 48, 40, 8, 13824, 152064, False, True),
    _preset("Qwen/Qwen2.5-32B", 5120, 64, 40, 8, 27648, 152064, False, True),
    _preset("Qwen/Qwen2.5-72B", 8192, 80, 64, 8, 29568, 152064, False, True),
    _preset("meta-llama/Llama-3.2-1B", 2048, 16, 32, 8, 8192, 128256, True, False, 131072),
    _preset("meta-llama/Llama-3.2-3B", 3072, 28, 24, 8, 8192, 128256, True, False, 131072),
    _preset("meta-llama/Llama-3.1-8B", 4096, 32, 32, 8, 14336, 128256, False, False, 131072),
    _preset("meta-llama/Llama-3.1-70B", 8192, 80, 64, 8, 28672, 128256, False, False, 131072),
)}
"""Public configs by hub id (lower case). Short names (``Qwen2.5-7B``) match too."""

_SHORT = {k.split("/", 1)[1]: k for k in PRESETS}

TINY_DEFAULTS = {"hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2}
TINY_INTERMEDIATE = 256
"""``TinyModelConfig.intermediate`` (a flow's ``tiny(...)`` does not set it)."""
TINY_MAX_LEN = 128


class ConfigError(ValueError):
    """A ``config.json`` that exists but cannot be read as a decoder config."""


def preset(name: str) -> ModelFacts | None:
    """The built-in facts for a hub id or its short name (case-insensitive), else None."""
    key = name.lower()
    return PRESETS.get(key) or PRESETS.get(_SHORT.get(key, ""))


def from_config(path: str | Path) -> ModelFacts:
    """Facts from a transformers ``config.json`` (a file or the directory holding it)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {p}: {e}") from None
    try:
        heads = int(cfg["num_attention_heads"])
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        return ModelFacts(
            name=str(p.parent), hidden=int(cfg["hidden_size"]), layers=int(cfg["num_hidden_layers"]),
            heads=heads, kv_heads=int(cfg.get("num_key_value_heads") or heads),
            intermediate=int(cfg.get("intermediate_size") or 4 * int(cfg["hidden_size"])),
            vocab=int(cfg["vocab_size"]), tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=cfg.get("model_type") == "qwen2", head_dim=int(cfg.get("head_dim") or 0),
            dtype_bytes=4 if dtype == "float32" else 2,
            max_len=int(cfg.get("max_position_embeddings") or 4096))
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{p}: not a decoder config ({e})") from None


def tiny_facts(attrs: dict) -> ModelFacts:
    """Facts of ``tiny(task=..., hidden=..., layers=..., heads=..., kv_heads=...)`` (fp32)."""
    opts = {k: int(attrs.get(k, v)) for k, v in TINY_DEFAULTS.items()}
    task = str(attrs.get("task", "arith"))
    try:
        from flowrl.tasks import get_task  # light: the task table, no torch

        vocab = 4 + len(get_task(task).chars)
    except (ImportError, KeyError):
        vocab = 64  # an unknown task is reported when the model is built; the size barely matters here
    return ModelFacts(f"tiny({task})", opts["hidden"], opts["layers"], opts["heads"], opts["kv_heads"],
                      TINY_INTERMEDIATE, vocab, tied=False, dtype_bytes=4, max_len=TINY_MAX_LEN)


def facts_of(graph: FlowGraph, model_id: str, _depth: int = 0) -> ModelFacts | None:
    """The facts of a model node of ``graph`` (None when nothing is known)."""
    node: Node = graph.node(model_id)
    if node.kind != OpKind.MODEL or _depth > 8:
        return None
    if node.op in ("frozen", "critic"):
        base = node.args[0] if node.args else None
        return facts_of(graph, base.target, _depth + 1) if isinstance(base, Ref) and base.target in graph else None
    attrs = {k: plain(v) for k, v in node.attrs}
    if node.op == "tiny":
        if not all(isinstance(v, (int, str)) for v in attrs.values()):
            return None  # an abstract option (a symbol): shape unknown
        return tiny_facts(attrs)
    if node.op == "hf" and node.args and isinstance(node.args[0], Const):
        return _hf_facts(node, str(node.args[0].value))
    return None


def _hf_facts(node: Node, path: str) -> ModelFacts | None:
    local = path if os.path.isabs(path) or node.span.path.startswith("<") else \
        os.path.join(os.path.dirname(os.path.abspath(node.span.path)), path)
    facts = None
    if os.path.isfile(os.path.join(local, "config.json")):
        try:
            facts = from_config(local)
        except ConfigError:
            facts = None
    if facts is None:
        facts = preset(path)
    return facts  # bytes per weight are the cluster's (bf16 on GPUs, fp32 on CPU): see flowrl.cost.model


def model_facts(graph: FlowGraph) -> dict[str, ModelFacts | None]:
    """Facts of every model node of ``graph`` (None where unknown)."""
    return {n.id: facts_of(graph, n.id) for n in graph.nodes() if n.kind == OpKind.MODEL}


__all__ = ["ModelFacts", "PRESETS", "ConfigError", "preset", "from_config", "tiny_facts", "facts_of",
           "model_facts"]
