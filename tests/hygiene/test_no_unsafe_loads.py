"""Nothing flowrl reads back may execute code: no call in flowrl/ deserialises with a format that can
(pickle and its relatives, ``torch.load`` without ``weights_only=True``, numpy with pickles, unsafe
YAML, ``eval``/``exec``). Run directories and caches are JSON, safetensors and ``torch.save`` files read
with ``weights_only=True`` (:mod:`flowrl.runtime.statefile`, :func:`flowrl.engines.base.load_tensors_file`).

Pickle between flowrl's own processes (never a file) is the one exception, listed in :data:`WIRES`.
(torch.distributed.checkpoint's ``.metadata``, a pickle torch writes, is read by the FSDP engine with an
unpickler that admits only DCP's own records: ``flowrl.engines.fsdp_rank._safe_metadata``.)
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "flowrl"

WIRES = {
    "sandbox/wire.py": "the pool <-> worker pipe: both ends are flowrl's processes",
    "engines/ranks.py": "a loss function sent to the train ranks (cloudpickle over Ray / a pipe)",
    "engines/rank_actors.py": "the same, in the ranks' Ray actors",
}
"""Module (relative to flowrl/) -> why it may unpickle: bytes another flowrl process just sent, not a file."""

UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "joblib", "shelve", "marshal", "cloudpickle"}
LOAD_NAMES = {"load", "loads", "Unpickler", "unsafe_load", "full_load", "load_all"}


def _unsafe_calls(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in ("eval", "exec"):
            found.append((node.lineno, f"{f.id}()"))
        if not isinstance(f, ast.Attribute) or not isinstance(f.value, (ast.Name, ast.Attribute)):
            continue
        owner = f.value.id if isinstance(f.value, ast.Name) else f.value.attr
        kw = {k.arg: k.value for k in node.keywords}
        if owner in UNSAFE_MODULES and f.attr in LOAD_NAMES:
            found.append((node.lineno, f"{owner}.{f.attr}"))
        elif owner == "torch" and f.attr == "load":
            safe = kw.get("weights_only")
            if not (isinstance(safe, ast.Constant) and safe.value is True):
                found.append((node.lineno, "torch.load without weights_only=True"))
        elif owner in ("np", "numpy") and f.attr == "load":
            allow = kw.get("allow_pickle")
            if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
                found.append((node.lineno, "np.load with allow_pickle"))
        elif owner == "yaml" and f.attr in ("load", "load_all", "unsafe_load", "full_load"):
            loader = kw.get("Loader")
            if not (loader is not None and "Safe" in ast.unparse(loader)):
                found.append((node.lineno, f"yaml.{f.attr} without a safe loader"))
    return found


def test_nothing_in_flowrl_deserialises_with_a_format_that_runs_code():
    problems = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in WIRES:
            continue
        for line, what in _unsafe_calls(ast.parse(path.read_text(encoding="utf-8"))):
            problems.append(f"flowrl/{rel}:{line}: {what}")
    assert not problems, ("formats that run code when read (use JSON, safetensors, torch.load(weights_only=True); "
                          "a pipe between flowrl's own processes goes in WIRES):\n" + "\n".join(problems))


def test_the_scan_finds_what_it_forbids():
    src = ("import pickle, torch, yaml, numpy as np\npickle.load(f)\ntorch.load(f)\ntorch.load(f, weights_only=False)\n"
           "np.load(f, allow_pickle=True)\nyaml.load(s)\neval(s)\n"
           "torch.load(f, weights_only=True)\nyaml.load(s, Loader=yaml.SafeLoader)\nnp.load(f)\n")
    assert [line for line, _ in _unsafe_calls(ast.parse(src))] == [2, 3, 4, 5, 6, 7]
