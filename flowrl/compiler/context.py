"""What every pass receives besides the graph."""

from __future__ import annotations

from dataclasses import dataclass, field

from flowrl.compiler.unit import Unit
from flowrl.syntax import ast


@dataclass
class CompileContext:
    unit: Unit
    """Loaded modules and the source map for diagnostics."""
    module: ast.Module
    """The file the entry flow is defined in."""
    options: dict = field(default_factory=dict)
    """Command-line overrides and compiler switches (``lint``: lint after every pass)."""

    @property
    def sources(self):
        return self.unit.sources
