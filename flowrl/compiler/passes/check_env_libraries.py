"""Check the environments a flow takes from libraries (TextArena, Gymnasium, OpenEnv, MCP, verifiers), without importing them.

Requires: check_edge_types (options of resources have their defaults).

Guarantees, for every environment declared with a library's op
(:data:`flowrl.catalog.env_libraries.ENV_LIBRARIES`) in a flow file on disk:

* the library is installed: its top-level module is found (``importlib.util.find_spec``, which
  runs none of its code); else E640 with the ``pip install`` that adds it;
* the environment id exists in the library's registry (``registry`` of its record): the
  registry's source is read with :mod:`ast` (TextArena's ``register``/``register_with_versions``
  calls, Gymnasium's ``register`` calls, in the library or in the module of a
  ``"module:EnvId"``); an unknown id is E641 with the nearest ids;
* the module that defines the environment (TextArena's entry point, a Gymnasium
  ``"module:EnvId"``'s module) compiles on this Python; else E642 (some of TextArena's games use
  Python 3.12 syntax);
* an MCP server's command names a module (``python -m m``) or script that exists, or a program on
  ``PATH``, and an OpenEnv environment's ``action`` class is defined where it says; else E644;
* a verifiers taskset is a module found there, or one of verifiers' own tasksets; else E641.

The tools an MCP server offers are listed and their schemas checked (E643) when the run starts,
before any engine: listing them means running the server, which ``check`` never does.

>>> from flowrl.compiler.pipeline import compile_text
>>> from flowrl.diagnostics import FlowError
>>> try:
...     compile_text('''
... model m = tiny()
... env g = textarena("GuessTheNumbr-v0")
... flow main(d: dataset) { c = generate(m, sample(d))  o = env_step(g, c)  return o }''',
...                  "doc.flow", options={"resources": True}, until="check_env_libraries")
... except FlowError as e:
...     print(str(e).splitlines()[0])
doc.flow:3:19: error[E641]: `GuessTheNumbr-v0` is not a textarena environment id
"""

from __future__ import annotations

import ast
import difflib
import os
import shlex
import shutil
from pathlib import Path

from flowrl.catalog.env_libraries import ENV_LIBRARIES, EnvLibrary
from flowrl.compiler.context import CompileContext
from flowrl.compiler.resources import checked, folder_of, shown_folder
from flowrl.diagnostics import Collector
from flowrl.ir.graph import Const, FlowGraph, Node
from flowrl.pyrefs import RefError, defined_names, find_module, split_ref
from flowrl.userfiles import read_bounded

SOURCE_MAX_BYTES = 8 << 20
"""The largest registry or environment module read."""


def check_env_libraries(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    errors = Collector(ctx.sources)
    for node in graph.nodes():
        lib = ENV_LIBRARIES.get(node.op)
        if lib is None or not checked(node, ctx) or not node.args or not isinstance(node.args[0], Const):
            continue
        folder = folder_of(node)
        installed = find_module(lib.module, folder)
        if installed is None:
            errors.error("E640", f"`{node.op}(...)` needs the `{lib.module}` package, which is not installed",
                         node.span, f"install it: pip install '{lib.pip}' (or: pip install 'flowrl[envs]')")
            continue
        _CHECKS[lib.check](node, lib, installed.source, folder, errors)
    errors.raise_if_any()
    return graph


# ---- registries read from source ---------------------------------------------------------------


def _const(node: ast.AST):
    return node.value if isinstance(node, ast.Constant) else None


def registered(source: str) -> tuple[dict[str, str | None], bool]:
    """Environment ids a module's source registers -> their entry point (``"module:Class"`` or None),
    and whether some registration's id is not a constant (then other ids may exist).

    >>> registered('register(id="A-v0", entry_point="m:A")\\nregister_with_versions(id="B-v0", '
    ...            'entry_point="m:B", wrappers={"default": [], "-train": []})')
    ({'A-v0': 'm:A', 'B-v0': 'm:B', 'B-v0-train': 'm:B', 'B-v0-raw': 'm:B'}, False)
    """
    ids: dict[str, str | None] = {}
    open_ended = False
    for call in ast.walk(ast.parse(source)):
        if not isinstance(call, ast.Call):
            continue
        name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)
        if name not in ("register", "register_with_versions"):
            continue
        kw = {k.arg: k.value for k in call.keywords if k.arg}
        first = kw.get("id", call.args[0] if call.args else None)
        env_id = _const(first) if first is not None else None
        if not isinstance(env_id, str):
            open_ended = True
            continue
        entry = _const(kw["entry_point"]) if "entry_point" in kw else None
        entry = entry if isinstance(entry, str) else None
        ids[env_id] = entry
        if name == "register_with_versions":
            wrappers = kw.get("wrappers")
            keys = [_const(k) for k in wrappers.keys] if isinstance(wrappers, ast.Dict) else []
            for key in [k for k in keys if isinstance(k, str) and k != "default"] + ["-raw"]:
                ids[env_id + key] = entry
    return ids, open_ended


def _read(path: Path) -> str:
    return read_bounded(path, SOURCE_MAX_BYTES).decode("utf-8")


def _unknown_id(node: Node, lib: EnvLibrary, env_id: str, ids: dict, where: str, errors: Collector) -> None:
    near = difflib.get_close_matches(env_id, sorted(ids), n=3, cutoff=0.6)
    errors.error("E641", f"`{env_id}` is not a {lib.op} environment id", node.args[0].span,
                 (f"did you mean {', '.join(f'`{n}`' for n in near)}? " if near else "")
                 + f"the ids are read from {where} ({len(ids)} registered)")


def _compiles(node: Node, what: str, path: Path | None, errors: Collector) -> None:
    """E642 when the module at ``path`` does not compile on this Python."""
    if path is None:
        return
    try:
        compile(_read(path), str(path), "exec", dont_inherit=True)
    except SyntaxError as e:
        import sys

        errors.error("E642", f"{what} does not import on this Python ({sys.version.split()[0]}): {path}:{e.lineno}: "
                             f"{e.msg}", node.args[0].span,
                     "it uses syntax of a newer Python; pick another environment, or run flowrl on that Python")
    except (OSError, UnicodeDecodeError, ValueError):
        return  # unreadable: the import at run time tells


def _entry_source(entry: str | None, folder: str) -> Path | None:
    if not entry:
        return None
    try:
        module, _ = split_ref(entry)
    except RefError:
        return None
    found = find_module(module, folder)
    return found.source if found is not None else None


def _textarena(node: Node, lib: EnvLibrary, package: Path | None, folder: str, errors: Collector) -> None:
    if package is None:
        return
    registry = package.parent / "envs" / "__init__.py"
    try:
        ids, open_ended = registered(_read(registry))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return  # a registry flowrl cannot read: the run's textarena.make tells
    game = str(node.args[0].value)
    if game not in ids:
        if not open_ended:
            _unknown_id(node, lib, game, ids, str(registry), errors)
        return
    _compiles(node, f"TextArena game `{game}` ({ids[game]})", _entry_source(ids[game], folder), errors)


def _gymnasium(node: Node, lib: EnvLibrary, package: Path | None, folder: str, errors: Collector) -> None:
    written = str(node.args[0].value)
    module, _, env_id = written.rpartition(":")
    if module:
        found = find_module(module, folder)
        if found is None:
            errors.error("E641", f"cannot find module `{module}` (for `{written}`): gymnasium imports it to register "
                                 f"`{env_id}`", node.args[0].span,
                         f"put `{module}.py` in {shown_folder(node)} or on PYTHONPATH")
            return
        source, where = found.source, f"module `{module}`"
    else:
        source, where = (package.parent / "envs" / "__init__.py" if package else None), "gymnasium's own registry"
    if source is None:
        return
    _compiles(node, f"module `{module}`", source if module else None, errors)
    try:
        ids, open_ended = registered(_read(source))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return
    if env_id not in ids and not open_ended:
        _unknown_id(node, lib, env_id, ids, where, errors)


def _openenv(node: Node, lib: EnvLibrary, package: Path | None, folder: str, errors: Collector) -> None:
    action = node.attr("action")
    if action is None or not isinstance(action, Const):
        return
    try:
        module, attr = split_ref(str(action.value))
    except RefError as e:
        errors.error("E644", f"`action` needs \"module:Class\": {e}", action.span, "e.g. action = \"my_env:MyAction\"")
        return
    found = find_module(module, folder)
    if found is None:
        errors.error("E644", f"cannot find module `{module}` (for the action class `{action.value}`)", action.span,
                     f"put `{module}.py` in {shown_folder(node)} or on PYTHONPATH")
        return
    if found.source is None:
        return
    try:
        names, open_ended = defined_names(found.source)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return  # check_resources reports the environment module's own problems
    if attr.split(".")[0] not in names and not open_ended:
        errors.error("E644", f"module `{module}` defines no `{attr}` (the action class)", action.span,
                     f"it defines {', '.join(sorted(n for n in names if not n.startswith('_'))[:12])}")


def _mcp(node: Node, lib: EnvLibrary, package: Path | None, folder: str, errors: Collector) -> None:
    command = str(node.args[0].value)
    try:
        argv = shlex.split(command)
    except ValueError as e:
        argv, why = [], str(e)
    else:
        why = "it is empty"
    if not argv:
        errors.error("E644", f"the MCP server command `{command}` cannot be split into a program and its arguments: "
                             f"{why}", node.args[0].span, "e.g. mcp(\"python -m my_server\")")
        return
    if argv[0] in ("python", "python3"):
        if len(argv) >= 3 and argv[1] == "-m":
            if find_module(argv[2], folder) is None:
                errors.error("E644", f"cannot find the MCP server's module `{argv[2]}`", node.args[0].span,
                             f"put `{argv[2]}.py` in {shown_folder(node)} or on PYTHONPATH, or install it")
        elif len(argv) >= 2 and argv[1].endswith(".py") and not os.path.isfile(os.path.join(folder, argv[1])):
            errors.error("E644", f"cannot find the MCP server's script `{argv[1]}`", node.args[0].span,
                         f"the server starts in the flow file's folder, {shown_folder(node)}")
        return
    if shutil.which(argv[0]) is None and not os.path.isfile(os.path.join(folder, argv[0])):
        errors.error("E644", f"cannot find the MCP server's program `{argv[0]}`", node.args[0].span,
                     "give a program on PATH, or `python -m module`")


def _verifiers(node: Node, lib: EnvLibrary, package: Path | None, folder: str, errors: Collector) -> None:
    taskset = str(node.args[0].value)
    if find_module(taskset, folder) is not None:
        return
    builtin = sorted(p.name for p in (package.parent / "v1" / "tasksets").iterdir()
                     if p.is_dir() and (p / "__init__.py").is_file()) if package is not None else []
    if taskset in builtin:
        return
    errors.error("E641", f"`{taskset}` is not a verifiers taskset: no module of that name", node.args[0].span,
                 f"a taskset is a module exporting its Taskset subclass in `__all__`, in {shown_folder(node)}, "
                 f"on PYTHONPATH or installed" + (f"; verifiers' own: {', '.join(builtin)}" if builtin else ""))


_CHECKS = {"game_ids": _textarena, "env_ids": _gymnasium, "action_class": _openenv, "server_command": _mcp,
           "taskset_module": _verifiers}
"""A library record's ``check`` -> the function reading it (a test pairs them)."""


__all__ = ["check_env_libraries", "registered"]
