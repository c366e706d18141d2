"""One error type for every stage: a code, a message, a source span and a hint.

Rendered like rustc::

    flows/bad.flow:3:14: error[E101]: unknown name `rolouts`
      |
    3 |   scores = reward(rolouts)
      |                   ^^^^^^^
      = hint: did you mean `rollouts`?

Every diagnostic carries a position. A diagnostic is an *error* (code ``E###``: the
program is refused) or a *warning* (code ``W###``: the program compiles, but probably
not as meant, e.g. a value nothing reads). Stages collect all their diagnostics and
raise them together as one :class:`FlowError` when any is an error; warnings of a stage
that succeeds travel with its result (``FlowGraph.warnings``).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Iterable


@dataclass(frozen=True)
class Span:
    """A region of source text. Lines and columns start at 1; ``end_column`` is exclusive."""

    path: str
    line: int
    column: int
    end_line: int
    end_column: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.column}"

    @staticmethod
    def point(path: str, line: int, column: int, width: int = 1) -> "Span":
        return Span(path, line, column, line, column + max(width, 1))


@dataclass(frozen=True)
class Diagnostic:
    code: str
    """``E`` (error) or ``W`` (warning) + three digits; the catalogue is in docs/language.md."""
    message: str
    span: Span
    hint: str | None = None
    severity: str = "error"
    """``error`` (the program is refused) or ``warning`` (it compiles; flowrl check exits 0)."""
    notes: tuple[tuple[str, Span], ...] = ()
    """Secondary positions, e.g. where a conflicting name was first defined."""

    @property
    def is_error(self) -> bool:
        return self.severity == "error"


def quotable(path: str) -> bool:
    """Whether a diagnostic may quote the lines of the source at ``path``: a ``.flow`` file, or a
    text given in memory (``<stdin>``, ``<input>``). The parser records no other file's text,
    so no file named by a flow (``import "/etc/shadow"``) is ever shown."""
    return path.endswith(".flow") or (path.startswith("<") and path.endswith(">"))


class SourceMap:
    """The texts of every file a compilation read, so diagnostics can quote them."""

    def __init__(self) -> None:
        self._texts: dict[str, str] = {}

    def add(self, path: str, text: str) -> None:
        self._texts[path] = text

    def line(self, path: str, line: int) -> str | None:
        text = self._texts.get(path)
        if text is None:
            return None
        lines = text.splitlines()
        if 1 <= line <= len(lines):
            return lines[line - 1]
        return "" if line == len(lines) + 1 else None


class FlowError(Exception):
    """Raised with every diagnostic a stage found (its errors, and the warnings found with
    them). ``str()`` renders them all, in source order."""

    def __init__(self, diagnostics: Iterable[Diagnostic], sources: SourceMap | None = None):
        self.diagnostics = in_source_order(diagnostics)
        self.sources = sources or SourceMap()
        super().__init__(self.render())

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.is_error]

    @property
    def warnings(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if not d.is_error]

    def render(self) -> str:
        return render_all(self.diagnostics, self.sources)


def in_source_order(diagnostics: Iterable[Diagnostic]) -> list[Diagnostic]:
    return sorted(diagnostics, key=lambda d: (d.span.path, d.span.line, d.span.column, d.code))


def render_all(diagnostics: Iterable[Diagnostic], sources: SourceMap) -> str:
    """Render several diagnostics (e.g. the warnings of a compilation that succeeded)."""
    return "\n".join(render(d, sources) for d in diagnostics)


def report_warnings(warnings: Iterable[Diagnostic], sources: SourceMap, stream) -> int:
    """Write warnings to ``stream`` (once each, in source order: flows that inline the same
    callee find the same ones); return how many were written."""
    unique = in_source_order(dict.fromkeys(warnings))
    if unique:
        stream.write(render_all(unique, sources) + "\n")
    return len(unique)


def render(diag: Diagnostic, sources: SourceMap) -> str:
    """Render one diagnostic with the quoted source line and a caret under the span."""
    s = diag.span
    out = [f"{s}: {diag.severity}[{diag.code}]: {diag.message}"]
    out += _quote(s, sources)
    for text, span in diag.notes:
        out.append(f"  = note: {text} at {span}")
    if diag.hint:
        out.append(f"  = hint: {diag.hint}")
    return "\n".join(out) + "\n"


def _quote(s: Span, sources: SourceMap) -> list[str]:
    line = sources.line(s.path, s.line)
    if line is None:
        return []
    line = line.expandtabs(1)
    if len(line) > 160:  # keep rendered errors readable for minified / huge lines
        start = max(0, s.column - 60)
        shown, col = line[start : start + 160], s.column - start
    else:
        shown, col = line, s.column
    width = (s.end_column - s.column) if s.end_line == s.line else len(shown) - col + 1
    width = max(1, min(width, len(shown) - col + 2))
    gutter = " " * len(str(s.line))
    return [
        f"{gutter} |",
        f"{s.line} | {shown}",
        f"{gutter} | {' ' * (col - 1)}{'^' * width}",
    ]


def did_you_mean(name: str, candidates: Iterable[str]) -> str | None:
    """A 'did you mean' hint for a misspelt name, or None when nothing is close."""
    close = difflib.get_close_matches(name, sorted(set(candidates)), n=1, cutoff=0.6)
    return f"did you mean `{close[0]}`?" if close else None


@dataclass
class Collector:
    """Collects the diagnostics of one stage; ``raise_if_any`` ends the stage on an error."""

    sources: SourceMap
    items: list[Diagnostic] = field(default_factory=list)

    def error(self, code: str, message: str, span: Span, hint: str | None = None,
              notes: tuple[tuple[str, Span], ...] = ()) -> None:
        self.items.append(Diagnostic(code, message, span, hint, notes=notes))

    def warning(self, code: str, message: str, span: Span, hint: str | None = None,
                notes: tuple[tuple[str, Span], ...] = ()) -> None:
        self.items.append(Diagnostic(code, message, span, hint, "warning", notes))

    @property
    def has_errors(self) -> bool:
        return any(d.is_error for d in self.items)

    @property
    def warnings(self) -> tuple[Diagnostic, ...]:
        return tuple(d for d in self.items if not d.is_error)

    def raise_if_any(self) -> None:
        """Raise every diagnostic collected (warnings too) if any of them is an error."""
        if self.has_errors:
            raise FlowError(self.items, self.sources)


PYTHON_VALUES = {"True": ("true", "did you mean `true`?"), "False": ("false", "did you mean `false`?"),
                 "None": (None, "flowrl has no `None`: leave the option out to get its default, "
                                "or write the value you mean")}
"""Python's value names, which a flow may not use as values: what flowrl writes instead."""
