"""No module outside ``flowrl/catalog/`` dispatches on an engine, protocol, op or loss name.

The catalogue (``flowrl/catalog/``) is the single source of truth: code reads a record's fields
(``ENGINES[kind].axes``, ``PROTOCOLS[p].routes``...) instead of comparing its name with a string.
An AST scan of every module of ``flowrl/`` outside the catalogue finds a string constant equal
to a catalogue name (``flowrl.catalog.NAMES``) used

* in a comparison: ``kind == "vllm"``, ``p != "nccl"``, ``kind in ("megatron", "fsdp")``
  (the constant itself, or inside a literal tuple / list / set);
* as a key of a dict literal: ``{"megatron": ...}``;
* as a subscript: ``ENGINES["vllm"]``, ``table["delta"]``.

Assigning a name to a variable, a default value, or text in a message are not dispatch and are
not flagged. Two things share words with the names without being names, and are told apart by
what they are compared with or keyed by:

* a record field with a vocabulary of its own (:data:`FIELD_VOCABULARIES`): ``role == "critic"``
  compares a model's role, not the ``critic`` op; only constants of that vocabulary are let
  through (``role == "vllm"`` is still a name dispatch);
* a dict literal whose keys are all fields of the experience table (``flowrl.catalog.ops.FIELDS``:
  ``logprobs``, ``values``...) is keyed by fields, and a subscript by such a field reads a field.

Anything else that is genuinely not a name dispatch goes into :data:`ALLOWED` with the reason.
:data:`PENDING` lists modules whose owners are converting them now (issue 9); it is strict: a
listed module with nothing left to convert fails the test until it is taken off the list.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from flowrl.catalog import ENGINES, LOSSES, NAMES, OPS, PROTOCOLS
from flowrl.catalog.ops import FIELDS, FactsFrom
from flowrl.catalog.schedule import ROLES
from flowrl.views import STYLES

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "flowrl"
CATALOGUE = PACKAGE / "catalog"
CATALOGUE_NAMES = frozenset().union(*NAMES.values())

_ROLES = frozenset({s.role for s in OPS.values() if s.role} | {s.serves_model for s in OPS.values() if s.serves_model}
                   | set(ROLES) | {loss.model_role for loss in LOSSES.values()}
                   | {r for e in ENGINES.values() for r in e.extra_roles})
"""Every role the catalogue gives a model or an engine: ``trainable``, ``frozen``, ``critic``
(OpSpec.role), ``reward`` (OpSpec.serves_model, EngineSpec.extra_roles), ``train``/``rollout``
(the schedule's engine roles), LossSpec.model_role."""

FIELD_VOCABULARIES: dict[str, tuple[frozenset[str], str]] = {
    "role": (_ROLES, "a model's or an engine's role (OpSpec.role / Node.role / ModelPlan.role / a train "
                     "engine's role); `frozen` and `critic` are also the ops that make such models"),
    "model_role": (_ROLES, "LossSpec.model_role: the role of the model a loss trains"),
    "needs_old": (frozenset(FIELDS), "LossSpec.needs_old: a field of the experience table (`logprobs`, "
                                     "`values`), not an op"),
    "needs_targets": (frozenset(FIELDS), "LossSpec.needs_targets: a field of the experience table, not an op"),
    "facts_from": (frozenset(f.value for f in FactsFrom),
                   "OpSpec.facts_from: where a model resource's facts come from (a `checkpoint` directory, "
                   "the `tiny` options...), not the `checkpoint` protocol"),
    "style": (frozenset(STYLES), "Look.style (flowrl/views.py): how a graph view draws a node, chosen from "
                                 "the node's kind and role; not an op"),
    "css": (frozenset(STYLES), "the Mermaid writer's CSS classes (flowrl/views.py), named after Look.style"),
}
"""Record fields whose values are a vocabulary of their own that shares words with catalogue names:
field -> (its vocabulary, read from the catalogue or the module that owns it; what it is). A
comparison of such a field with a constant of that vocabulary is not a name dispatch; with any
other constant (``role == "vllm"``) it is."""

ALLOWED: dict[tuple[str, str], str] = {
    ("flowrl/launch.py", "torch"): "REQUIRED is keyed by Python packages `flowrl run` imports (the torch "
                                   "package), not by the `torch` engine",
    ("flowrl/engines/vllm_engine.py", "vllm"): "the vLLM adapter reads its own record (the CPU KV cache size the "
                                               "compiler's memory model counts), dispatching on nothing",
    ("flowrl/runtime/statefile.py", "torch"): "a value's Python module (a torch tensor is stored in safetensors), "
                                              "not the `torch` engine",
    ("flowrl/engines/fsdp_rank.py", "torch"): "the restricted unpickler of DCP metadata admits the `torch` module's "
                                              "dtypes and layouts, not the `torch` engine",
    ("flowrl/data/sources.py", "parquet"): "which pyarrow module to import (`pyarrow.parquet`), not the `parquet` "
                                           "dataset op",
    ("flowrl/compiler/library_checks.py", "reasoning_gym"): "keyed by `OpSpec.library`, a Python package's "
                                                            "import name (the `reasoning_gym` package), not the op",
    ("flowrl/rewards/verifiers.py", "reasoning_gym"): "a verifier's name (`verifier(\"reasoning_gym\")`, a value of "
                                                      "the verifier's `name` argument), not the dataset op",
    ("flowrl/tasks/rg.py", "reasoning_gym"): "a key of the task's own description (which Reasoning Gym task "
                                             "it draws from), not a dispatch on the dataset op",
    ("flowrl/runtime/endpoint.py", "logprobs"): "the OpenAI API's `logprobs` fields of the rollout endpoint's "
                                                "responses (its wire format), not the `logprobs` op",
    ("flowrl/runtime/endpoint.py", "delta"): "the OpenAI API's streamed chunks carry their text in `delta`, not the "
                                             "`delta` weight-sync protocol",
}
"""``(module path, constant)`` -> why it is not a name dispatch."""

PENDING: dict[str, str] = {}
"""Module or package (path from the repository root) -> who is converting it. Strict: each must
still have a hit (else take it off); everything else must have none."""


def _constants(node: ast.AST) -> list[ast.Constant]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _field_name(node: ast.AST) -> str | None:
    """The record field or variable an operand reads: ``n.role`` -> ``role``; ``role`` -> ``role``."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def name_uses(source: str, filename: str = "<source>") -> list[tuple[int, str, str]]:
    """``(line, constant, what)`` for every catalogue name used as a dispatch in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            fields = {_field_name(o) for o in operands} & set(FIELD_VOCABULARIES)
            for operand in operands:
                # a constant of the compared field's own vocabulary (a role...) is not a name
                out += [(c.lineno, c.value, "comparison") for c in _constants(operand)
                        if not any(c.value in FIELD_VOCABULARIES[f][0] for f in fields)]
        elif isinstance(node, ast.Dict):
            keys = [c for k in node.keys if k is not None for c in _constants(k)]
            if keys and all(c.value in FIELDS for c in keys):
                continue  # a table keyed by fields of the experience table
            out += [(c.lineno, c.value, "dict key") for c in keys]
        elif isinstance(node, ast.Subscript):
            # A field of the experience table read from a step value (``value["logprobs"]``) is not a name.
            out += [(c.lineno, c.value, "subscript") for c in _constants(node.slice) if c.value not in FIELDS]
    return sorted((line, value, what) for line, value, what in out if value in CATALOGUE_NAMES)


def _scanned() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if CATALOGUE not in p.parents)


def _pending_of(rel: str) -> str | None:
    return next((k for k in PENDING if rel == k or rel.startswith(k + "/")), None)


def _hits() -> dict[str, list[tuple[int, str, str]]]:
    out = {}
    for path in _scanned():
        rel = path.relative_to(ROOT).as_posix()
        uses = [u for u in name_uses(path.read_text(encoding="utf-8"), rel) if (rel, u[1]) not in ALLOWED]
        if uses:
            out[rel] = uses
    return out


# ---- the scanner finds what it must ---------------------------------------------------------------------


# Names taken from the records (the scanner must flag whichever names the catalogue holds).
ROLLOUT, OTHER_ROLLOUT = sorted(n for n, e in ENGINES.items() if e.serves == "rollout")[:2]
TRAIN, OTHER_TRAIN = sorted(n for n, e in ENGINES.items() if e.serves == "train")[:2]
PROTOCOL = sorted(PROTOCOLS)[0]
LOSS = sorted(LOSSES)[0]
OP = sorted(OPS)[0]


@pytest.mark.parametrize("code", [
    f'if kind == "{ROLLOUT}": pass',
    f'ok = "{PROTOCOL}" != protocol',
    f'fused = engine in ("{TRAIN}", "{OTHER_ROLLOUT}")',
    f'fused = engine not in {{"{TRAIN}", "{OTHER_TRAIN}"}}',
    f'names = {{"{TRAIN}": "decoder", "x": 1}}',
    f'spec = ENGINES["{OTHER_ROLLOUT}"]',
    f'elided = loss.name != "{LOSS}"',
    f'if op.kind == "{OP}": pass',
    f'if role == "{ROLLOUT}": pass',                      # an engine name, whatever the operand is called
    f'if spec.model_role in ("critic", "{TRAIN}"): pass',  # `critic` is a role, an engine name is not
    f'if look.style != "{PROTOCOL}": pass',
    f'if loss.needs_old == "{LOSS}": pass',
])
def test_a_name_dispatch_is_found(code):
    assert name_uses(code), code


def test_a_field_of_its_own_vocabulary_hides_only_that_vocabulary():
    """The comparison is skipped constant by constant: a role is not flagged, an engine name next to it is."""
    assert name_uses(f'ok = role in ("critic", "{ROLLOUT}")') == [(1, ROLLOUT, "comparison")]
    assert name_uses(f'if n.role == "frozen" and kind == "{OTHER_ROLLOUT}": pass') == \
        [(1, OTHER_ROLLOUT, "comparison")]
    for field, (vocabulary, why) in FIELD_VOCABULARIES.items():
        assert vocabulary and why.strip(), field


@pytest.mark.parametrize("code", [
    f'DEFAULT = "{ROLLOUT}"',                             # a value, not a dispatch
    'raise KeyError(f"unknown engine {name!r}")',
    'if n.role == "frozen": pass',                        # a role
    'if role in ("frozen", "critic"): pass',
    'hints = {"logprobs": "compute them", "values": "from a critic"}',  # keyed by fields
    'lp = value["logprobs"]',                              # a field read from a step value
    'if spec.facts_from == "checkpoint": pass',
    'if look.style == "resync": pass',                   # a drawing style (views)
    'if kind == OpKind.GENERATE: pass',                   # the closed enum
    'x = table[name]',
])
def test_what_is_not_a_name_dispatch_is_not_flagged(code):
    assert not name_uses(code), code


# ---- the tree ----------------------------------------------------------------------------------------------


def test_no_name_comparisons_outside_the_catalogue():
    found = {rel: uses for rel, uses in _hits().items() if _pending_of(rel) is None}
    report = [f"{rel}:{line}: {what} with {value!r}" for rel, uses in found.items() for line, value, what in uses]
    assert not report, ("compare a record's field instead of a catalogue name "
                        "(or, when it is not a name dispatch, say why in ALLOWED):\n  " + "\n  ".join(report))


def test_pending_modules_still_have_work():
    hits = _hits()
    done = [k for k in PENDING if not any(rel == k or rel.startswith(k + "/") for rel in hits)]
    assert not done, f"take these off PENDING (nothing left to convert): {done}"


def test_compiler_cost_model_and_gantt_are_converted():
    """The compiler (but the modules listed as pending), the cost model and the Gantt charts."""
    for rel in _hits():
        if rel.startswith(("flowrl/compiler/", "flowrl/cost/")) or rel == "flowrl/gantt.py":
            assert _pending_of(rel) is not None, rel
    assert not any(rel.startswith("flowrl/cost/") or rel == "flowrl/gantt.py" for rel in PENDING)


def test_allowed_entries_say_why_and_still_apply():
    for (rel, value), why in ALLOWED.items():
        assert why.strip(), (rel, value)
        assert any(u[1] == value for u in name_uses((ROOT / rel).read_text(encoding="utf-8"))), (rel, value)
