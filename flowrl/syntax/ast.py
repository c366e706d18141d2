"""The abstract syntax tree: frozen dataclasses, each with the span it came from.

The parser's transformer builds these and does nothing else; the formatter prints
them back; ``flowrl.ir.build`` turns a module into a FlowGraph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from flowrl.diagnostics import Span

# ---- expressions -------------------------------------------------------------


@dataclass(frozen=True)
class Literal:
    """An int, float, str, bool or size (bytes) constant. ``text`` is how it was written."""

    value: object
    kind: str  # "int" | "float" | "str" | "bool" | "size"
    text: str
    span: Span


@dataclass(frozen=True)
class Name:
    """A reference; dotted for qualified names (``grpo.advantages``, ``policy.train``)."""

    id: str
    span: Span


@dataclass(frozen=True)
class ListExpr:
    items: tuple["Expr", ...]
    span: Span


@dataclass(frozen=True)
class KwArg:
    name: str
    value: "Expr"
    span: Span


@dataclass(frozen=True)
class Call:
    func: str
    args: tuple["Expr", ...]
    kwargs: tuple[KwArg, ...]
    span: Span
    func_span: Span


Expr = Union[Literal, Name, ListExpr, Call]

# ---- flow statements -----------------------------------------------------------


@dataclass(frozen=True)
class Binding:
    name: str
    value: Expr
    span: Span
    name_span: Span


@dataclass(frozen=True)
class CallStmt:
    call: Call
    span: Span


@dataclass(frozen=True)
class Return:
    value: Expr
    span: Span


@dataclass(frozen=True)
class Repeat:
    """``repeat COUNT [until FIELD] { ... }``: a multi-turn loop inside one step."""

    count: Expr
    until: str | None
    body: tuple["Stmt", ...]
    span: Span


Stmt = Union[Binding, CallStmt, Return, Repeat]


@dataclass(frozen=True)
class Param:
    name: str
    type: str
    default: Expr | None
    span: Span


@dataclass(frozen=True)
class FlowDef:
    name: str
    params: tuple[Param, ...]
    body: tuple[Stmt, ...]
    span: Span
    name_span: Span


# ---- top level -----------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    """``import "path.flow" [as x]`` or ``import stdlib.grpo [as x]``."""

    target: str
    is_path: bool
    alias: str | None
    span: Span


@dataclass(frozen=True)
class Decl:
    """``model policy = hf("...")`` and the same for dataset, reward, env."""

    kind: str
    name: str
    value: Expr
    span: Span
    kind_span: Span
    name_span: Span


# ---- schedules -----------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """An engine of a model in a schedule: ``policy.train``, ``policy.rollout``, ``ref``."""

    model: str
    role: str | None
    span: Span

    def __str__(self) -> str:
        return f"{self.model}.{self.role}" if self.role else self.model


@dataclass(frozen=True)
class Colocate:
    targets: tuple[Target, ...]
    pool: str | None
    span: Span


@dataclass(frozen=True)
class Place:
    targets: tuple[Target, ...]
    pool: str
    span: Span


@dataclass(frozen=True)
class Pool:
    name: str
    value: Call
    span: Span


@dataclass(frozen=True)
class Layout:
    target: Target
    engine: Call
    span: Span


@dataclass(frozen=True)
class Staleness:
    value: int
    bound_only: bool  # ``staleness <= N`` (a limit for ``auto``) vs ``staleness N``
    span: Span


@dataclass(frozen=True)
class Resync:
    model: str
    protocol: Call
    every: int | None
    span: Span


@dataclass(frozen=True)
class SchedCall:
    """A call statement in a schedule, e.g. ``partial_rollout(over_provision = 1.5)``."""

    call: Call
    span: Span


SchedStmt = Union[Colocate, Place, Pool, Layout, Staleness, Resync, SchedCall]


@dataclass(frozen=True)
class ScheduleDef:
    flow: str
    auto: bool
    cluster: Call | None
    body: tuple[SchedStmt, ...]
    span: Span
    flow_span: Span


@dataclass(frozen=True)
class Comment:
    text: str
    span: Span


Item = Union[Import, Decl, FlowDef, ScheduleDef]


@dataclass(frozen=True)
class Module:
    path: str
    items: tuple[Item, ...]
    comments: tuple[Comment, ...]
    span: Span
