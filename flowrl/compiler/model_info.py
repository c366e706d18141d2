"""The facts of a flow's model nodes (:class:`~flowrl.catalog.models.ModelFacts`): which source each comes from.

Layout checks (tp divides heads, pp divides layers), the memory model and the cost model
need these numbers, and ``flowrl plan`` must answer without a model hub or torch. So
facts come from, in this order:

* ``tiny(...)``: the constructor's options (``hidden``, ``layers``, ``heads``, ``kv_heads``)
  and the task's character set (vocab = 4 special tokens + one per character);
* ``hf("dir")``: the ``config.json`` in that local directory (relative paths are relative
  to the flow file, as for datasets);
* ``hf("org/name")`` that is not a local directory: the ``config.json`` of its snapshot in the
  local Hugging Face cache (:mod:`flowrl.hub`, offline);
* ``hf("Qwen/Qwen2.5-7B")``: a built-in table of public configs (:data:`PRESETS`), so a
  plan for a cluster can be made on a laptop that does not hold the checkpoint;
* ``frozen(m)`` / ``critic(m)``: the facts of ``m`` (a critic's value head, ``hidden + 1``
  parameters, is negligible and not counted).

Anything else (a flow parameter without a value, an ``hf`` path with no ``config.json``
that is not a preset) has no facts: the checks that need them are skipped, and
``flowrl plan`` says so (``flowrl check`` refuses such an ``hf`` path: check_resources).
Which of these a model constructor is comes from its catalogue record
(:attr:`~flowrl.catalog.ops.OpSpec.facts_from`).

:func:`prompt_counter` counts a prompt's tokens the way the model's tokenizer will, where
that is cheap: a tiny model's character-level tokenizer, or a checkpoint's ``tokenizer.json``
of at most :data:`TOKENIZER_MAX_BYTES` (with the ``tokenizers`` library, no torch);
:func:`writes_answers` says whether a model's responses are its dataset's answers;
:func:`tokenizer_of` names a model's tokenizer as data (``check_tokenizers`` compares them).

>>> from flowrl.catalog.models import PRESETS
>>> PRESETS["qwen/qwen2.5-7b"].layers
28
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from flowrl.catalog.models import (ConfigError, ModelFacts, from_config, preset, tiny_facts, tiny_prompt_tokens,
                                   tiny_writes_answers)
from flowrl.catalog.ops import OPS, FactsFrom, OpKind
from flowrl.hub import find_checkpoint
from flowrl.ir.graph import Const, FlowGraph, Node, Ref, plain
from flowrl.model_files import tokenizer_fingerprint
from flowrl.tasks import TASKS

TOKENIZER_MAX_BYTES = 2 << 20
"""Largest ``tokenizer.json`` :func:`prompt_counter` loads. Loading one builds its merge table:
about 0.25 s for GPT-2's 50k-token vocabulary (1.4 MB) and most of a second for 150k-token
ones (7-11 MB, Qwen2 / Llama 3), too slow for a check that answers in milliseconds."""


MAX_BASES = 8
"""Links of a chain of bases (``frozen(critic(m))`` ...) followed before a model counts as unknown."""


def source_node(graph: FlowGraph, model_id: str) -> Node | None:
    """The model node whose own options or checkpoint make ``model_id``: itself, or the end of its
    chain of bases (``frozen(m)``, ``critic(m)``); None when the chain leaves the model nodes or
    is longer than :data:`MAX_BASES`."""
    for _ in range(MAX_BASES + 1):
        node: Node = graph.node(model_id)
        if node.kind != OpKind.MODEL:
            return None
        if _facts_from(node) != FactsFrom.BASE:
            return node
        model_id = _base(graph, node)
        if model_id is None:
            return None
    return None


def facts_of(graph: FlowGraph, model_id: str) -> ModelFacts | None:
    """The facts of a model node of ``graph`` (None when nothing is known)."""
    node = source_node(graph, model_id)
    if node is None:
        return None
    source = _facts_from(node)
    attrs = {k: plain(v) for k, v in node.attrs if k != "lora"}  # an adapter leaves the shape as it is
    if source == FactsFrom.OPTIONS:
        if not _concrete(attrs):
            return None  # an abstract option (a symbol): shape unknown
        return tiny_facts(attrs)
    if source == FactsFrom.CHECKPOINT and node.args and isinstance(node.args[0], Const):
        return _hf_facts(node, str(node.args[0].value))
    return None


def _facts_from(node: Node) -> str | None:
    spec = OPS.get(node.op)
    return spec.facts_from if spec is not None and spec.kind == OpKind.MODEL else None


def _base(graph: FlowGraph, node: Node) -> str | None:
    base = node.args[0] if node.args else None
    return base.target if isinstance(base, Ref) and base.target in graph else None


def local_path(node: Node, path: str) -> str:
    """A path written in ``node``'s flow file, resolved against that file's folder (as lowering does)."""
    if os.path.isabs(path) or node.span.path.startswith("<"):
        return path
    return os.path.join(os.path.dirname(os.path.abspath(node.span.path)), path)


def shown_path(node: Node, path: str) -> str:
    """:func:`local_path` as the user sees it: relative to the current directory when the flow
    file was named relative to it (diagnostics quote paths so, and golden outputs stay the same
    on every machine)."""
    if os.path.isabs(path) or node.span.path.startswith("<"):
        return os.path.normpath(path)
    return os.path.normpath(os.path.join(os.path.dirname(node.span.path), path))


def checkpoint_dir(graph: FlowGraph, model_id: str) -> Path | None:
    """The local checkpoint directory (holding a ``config.json``) a model is loaded from, if any."""
    node = source_node(graph, model_id)
    if node is None:
        return None
    if _facts_from(node) == FactsFrom.CHECKPOINT and node.args and isinstance(node.args[0], Const):
        written = str(node.args[0].value)
        return find_checkpoint(written, shown_path(node, written))
    return None


def _hf_facts(node: Node, path: str) -> ModelFacts | None:
    local = find_checkpoint(path, local_path(node, path))  # a local directory, else the hub cache's snapshot
    facts = None
    if local is not None:
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


def prompt_counter(graph: FlowGraph, model_id: str) -> Callable[[str], int] | None:
    """``count(text) -> tokens`` of a prompt as the model's tokenizer encodes it (special tokens
    included), or None where that is not known cheaply (see :data:`TOKENIZER_MAX_BYTES`)."""
    node = source_node(graph, model_id)
    if node is None:
        return None
    if _facts_from(node) == FactsFrom.OPTIONS:
        return tiny_prompt_tokens
    folder = checkpoint_dir(graph, node.id)
    tokenizer = folder / "tokenizer.json" if folder is not None else None
    if tokenizer is None or not tokenizer.is_file() or tokenizer.stat().st_size > TOKENIZER_MAX_BYTES:
        return None
    return _tokenizer_counter(str(tokenizer), tokenizer.stat().st_mtime_ns)


@dataclass(frozen=True)
class TokenizerId:
    """What a model's tokenizer is, as data: equal ``key``s tokenize alike."""

    key: str
    """A tiny model's task characters, or a hash of a checkpoint's tokenizer files
    (:func:`flowrl.model_files.tokenizer_fingerprint`)."""
    words: str
    """Where it comes from, for messages."""


def tokenizer_of(graph: FlowGraph, model_id: str) -> TokenizerId | None:
    """The tokenizer of a model node: a ``tiny``/``tiny_rm`` model's is one token per character of its task
    (4 special tokens first); a checkpoint's, its tokenizer files; None where not known without running
    (an abstract option, a preset that is not on disk)."""
    node = source_node(graph, model_id)
    if node is None:
        return None
    if _facts_from(node) == FactsFrom.OPTIONS:
        task = node.attr("task")
        name = str(task.value) if isinstance(task, Const) else "arith" if task is None else None
        chars = TASKS[name].chars if name in TASKS else None
        return TokenizerId(f"chars:{chars}", f"the character tokenizer of task `{name}`") if chars else None
    folder = checkpoint_dir(graph, node.id)
    key = tokenizer_fingerprint(folder) if folder is not None else None
    return TokenizerId(key, f"the tokenizer in {folder}") if key else None


def writes_answers(graph: FlowGraph, model_id: str) -> bool:
    """Whether the model's responses are a dataset row's answer alone, then end-of-sequence: a tiny
    policy warm-started on its task's answers (:func:`~flowrl.catalog.models.tiny_writes_answers`).
    False where that is not known (a checkpoint: what it writes is its training's, not the flow's)."""
    node = source_node(graph, model_id)
    if node is None or _facts_from(node) != FactsFrom.OPTIONS or OPS[node.op].role != "trainable":
        return False
    attrs = {k: plain(v) for k, v in node.attrs if k != "lora"}
    return _concrete(attrs) and tiny_writes_answers(attrs)


def _concrete(attrs: dict) -> bool:
    """Whether every option is a value (a number, a string, a flag), none a symbol a caller passes in."""
    return all(isinstance(v, (int, float, str, bool)) for v in attrs.values())


_COUNTERS: dict[tuple[str, int], Callable[[str], int] | None] = {}


def _tokenizer_counter(path: str, mtime: int) -> Callable[[str], int] | None:
    """A counter over ``tokenizer.json``, loaded once per file version (a check compiles every flow of a file)."""
    key = (path, mtime)
    if key not in _COUNTERS:
        try:
            from tokenizers import Tokenizer  # Rust, no torch: what transformers' fast tokenizers wrap

            tok = Tokenizer.from_file(path)
            _COUNTERS[key] = lambda text: len(tok.encode(text).ids)
        except Exception:  # noqa: BLE001 - not installed, or a file it cannot read: no estimate
            _COUNTERS[key] = None
    return _COUNTERS[key]


__all__ = ["facts_of", "source_node", "MAX_BASES", "model_facts", "checkpoint_dir", "local_path", "shown_path",
           "prompt_counter", "writes_answers", "TOKENIZER_MAX_BYTES", "TokenizerId", "tokenizer_of"]
