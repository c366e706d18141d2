"""A compilation unit: the entry file, every file it imports, and the standard library.

Files are parsed once and cached by resolved path. Import resolution:

* ``import "x.flow"``: relative to the importing file's directory;
* ``import stdlib.grpo``: ``<stdlib>/grpo.flow`` (the package's ``flowrl/stdlib/``, or
  ``$FLOWRL_STDLIB``).

An imported file's flows are visible by name, or as ``alias.name`` with ``as alias``.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from flowrl.diagnostics import Collector, Diagnostic, FlowError, SourceMap, Span
from flowrl.syntax import ast
from flowrl.syntax.parser import MAX_BYTES, parse
from flowrl.userfiles import NOT_REGULAR, open_regular


SOURCE_SUFFIX = ".flow"
"""The only files the compiler opens as sources: an entry file and every import name one.
Diagnostics quote the lines of these alone (:func:`flowrl.diagnostics.quotable`), so a
flow that names ``/etc/shadow`` or ``/proc/self/environ`` learns nothing of them."""


def source_problem(path: str | Path) -> str | None:
    """Why ``path`` may not be opened as a flow source, or None when it may.

    Decided without opening anything: the name must end in ``.flow`` and so must the file a
    link leads to; what the name reaches must be a regular file (not a directory, a device, a
    FIFO, a socket: reading one could block forever, never end, or be a secret).
    """
    p = Path(path)
    try:
        real = os.path.realpath(p)
        st = os.stat(real)
    except FileNotFoundError:
        st = None  # the caller's "no such file" says it better, once the name is right
    except (OSError, ValueError):
        return "not a readable path"
    if st is not None and stat.S_ISDIR(st.st_mode):
        return "a directory, not a .flow file"
    if not p.name.endswith(SOURCE_SUFFIX):
        return "not a .flow file"
    if not real.endswith(SOURCE_SUFFIX):
        return "a link to a file that is not a .flow file"
    if st is not None and not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    return None


def read_source(path: str | Path, shown: str | None = None, at: Span | None = None) -> bytes:
    """The bytes of a source file, read with a bound; FlowError E124 if it cannot be read.

    Only a regular file whose name (and, through links, whose target's name) ends in ``.flow``
    is opened (:func:`source_problem`); it is opened without blocking and checked again once
    open, so a FIFO or device swapped in meanwhile is refused too. At most 4 bytes per allowed
    character are read: anything longer is too large whatever its encoding, so it is rejected
    (E003) without being read whole. ``at``: where the error points (an import), else the file.
    """
    shown = shown or str(path)
    span = at or Span.point(shown, 1, 1)
    problem = source_problem(path)
    if problem is not None:
        raise FlowError([Diagnostic("E124", f"{shown} is {problem}", span,
                                    "flowrl reads flow sources only: pass a .flow file")])
    try:
        with open_regular(path) as f:  # a FIFO or device swapped in since the check above is refused
            data = f.read(4 * MAX_BYTES + 1)
    except FileNotFoundError:
        raise FlowError([Diagnostic("E124", f"no such file: {shown}", span, "check the path")]) from None
    except OSError as e:
        if e.strerror == NOT_REGULAR:
            raise FlowError([Diagnostic("E124", f"{shown} is not a regular file", span,
                                        "flowrl reads flow sources only: pass a .flow file")]) from None
        raise FlowError([Diagnostic("E124", f"cannot read {shown}: {e.strerror}", span,
                                    "check the file's permissions")]) from None
    if len(data) > 4 * MAX_BYTES:
        raise FlowError([Diagnostic("E003", f"file is too large (over {4 * MAX_BYTES:,} bytes; the limit is "
                                            f"{MAX_BYTES:,} characters)", span,
                                    "split the program into files and use `import`")])
    return data


def stdlib_dir() -> Path:
    """``$FLOWRL_STDLIB``, else the ``.flow`` files shipped inside the package (``flowrl/stdlib/``: package
    data, so an installed wheel has them; the repository's ``stdlib/`` is a link to it)."""
    env = os.environ.get("FLOWRL_STDLIB")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "stdlib"


@dataclass
class Visible:
    """What a module can name: its own flows and declarations plus imported flows."""

    flows: dict[str, tuple[ast.Module, ast.FlowDef]] = field(default_factory=dict)
    decls: dict[str, ast.Decl] = field(default_factory=dict)


class Unit:
    """Loads and caches modules; answers what each module can see."""

    def __init__(self, sources: SourceMap | None = None, stdlib: Path | None = None):
        self.sources = sources if sources is not None else SourceMap()
        self.stdlib = stdlib or stdlib_dir()
        self.modules: dict[str, ast.Module] = {}
        self._visible: dict[str, Visible] = {}
        self._loading: list[str] = []

    def add_text(self, text: str | bytes, path: str) -> ast.Module:
        module = parse(text, path, self.sources)
        self.modules[path] = module
        return module

    def load(self, path: Path, display: str, at: Span | None = None) -> ast.Module:
        key = display
        if key not in self.modules:
            self.modules[key] = parse(read_source(path, display, at), display, self.sources)
        return self.modules[key]

    def visible(self, module: ast.Module) -> Visible:
        """Flows and declarations visible in ``module``; raises FlowError on bad imports."""
        if module.path in self._visible:
            return self._visible[module.path]
        errors = Collector(self.sources)
        vis = Visible()
        self._loading.append(module.path)
        try:
            for item in module.items:
                if isinstance(item, ast.Import):
                    self._import(module, item, vis, errors)
            imported = dict(vis.flows)
            for item in module.items:
                if isinstance(item, ast.FlowDef):
                    if item.name in vis.flows and vis.flows[item.name][0] is module:
                        first = vis.flows[item.name][1]
                        errors.error("E112", f"flow `{item.name}` is defined twice", item.name_span,
                                     "rename one of them", notes=(("first defined", first.name_span),))
                    elif item.name in imported:  # a local flow would silently hide the imported one
                        errors.error("E112", f"flow `{item.name}` is defined here and imported from "
                                             f"{imported[item.name][0].path}", item.name_span,
                                     "rename it, or import the file under an alias (`import ... as lib`: "
                                     f"`lib.{item.name}`)",
                                     notes=(("the imported flow is defined", imported[item.name][1].name_span),))
                    vis.flows[item.name] = (module, item)
                elif isinstance(item, ast.Decl):
                    if item.name in vis.decls:
                        errors.error("E113", f"`{item.name}` is declared twice", item.name_span,
                                     "rename one of them", notes=(("first declared", vis.decls[item.name].name_span),))
                    vis.decls[item.name] = item
            for name in sorted(set(vis.decls) & set(vis.flows)):  # a call would mean the flow, a name the declaration
                flow_module, flow = vis.flows[name]
                errors.error("E113", f"`{name}` is declared here and is also a flow", vis.decls[name].name_span,
                             "rename one of them", notes=(("the flow is defined", flow.name_span),))
        finally:
            self._loading.pop()
        errors.raise_if_any()
        self._visible[module.path] = vis
        return vis

    def _import(self, module: ast.Module, imp: ast.Import, vis: Visible, errors: Collector) -> None:
        if imp.is_path:
            base = Path(module.path).parent if not module.path.startswith("<") else Path.cwd()
            path = (base / imp.target)
            display = os.path.normpath(str(path))
        else:
            parts = imp.target.split(".")
            if parts[0] != "stdlib" or len(parts) != 2:
                errors.error("E102", f"cannot import `{imp.target}`", imp.span,
                             "import a standard-library flow file as `import stdlib.NAME` "
                             "or a file as `import \"path/to/file.flow\"`")
                return
            path = self.stdlib / f"{parts[1]}.flow"
            display = f"stdlib/{parts[1]}.flow"
        problem = source_problem(path) if imp.is_path else None
        if problem is not None:  # decided by name and file type: nothing is opened
            errors.error("E131", f"cannot import `{imp.target}`: {display} is {problem}", imp.span,
                         "`import` names a flow module: a .flow file (`import \"lib/x.flow\"`) or a "
                         "standard-library flow (`import stdlib.grpo`)")
            return
        if not path.is_file():
            hint = (f"the standard library has: {', '.join(sorted(p.stem for p in self.stdlib.glob('*.flow')))}"
                    if not imp.is_path else "the path is relative to the importing file")
            errors.error("E102", f"cannot import `{imp.target}`: no file {display}", imp.span, hint)
            return
        if display in self._loading:
            errors.error("E103", f"import cycle: {' -> '.join(self._loading + [display])}", imp.span,
                         "move the shared flows into a third file that both import")
            return
        try:
            sub = self.load(path, display, imp.span)
            sub_vis = self.visible(sub)
        except FlowError as e:
            errors.items.extend(e.diagnostics)
            return
        for name, (mod, flow) in sub_vis.flows.items():
            if mod is not sub:
                continue  # imports are not re-exported
            key = f"{imp.alias}.{name}" if imp.alias else name
            if key in vis.flows and vis.flows[key][0] is not mod:  # the later import would silently win
                errors.error("E112", f"flow `{key}` is imported from both {vis.flows[key][0].path} and {mod.path}",
                             imp.span, f"import one of the files under an alias (`import ... as lib`: `lib.{name}`)",
                             notes=(("the other is defined", vis.flows[key][1].name_span),))
            vis.flows[key] = (mod, flow)
