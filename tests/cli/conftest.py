"""Fixtures for the CLI tests: flow files written to tmp_path."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import pytest


@pytest.fixture
def write_flow(tmp_path: Path) -> Callable[[str, str], Path]:
    """``write_flow(name, text)`` -> the path of a new file under tmp_path."""

    def write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        write_resources(path.parent, text)
        return path

    return write


def write_resources(folder: Path, text: str) -> None:
    """The files a flow's resources name, next to it (`flowrl check` looks for them): each
    `jsonl("x")` a one-row dataset, each `python_env("m:C")` / `python_reward("m:f")` a module
    defining that name."""
    for rel in re.findall(r'jsonl\("([^"]+)"', text) + re.findall(r'eval = "([^"]+)"', text):
        data = folder / rel
        if not data.exists():
            data.parent.mkdir(parents=True, exist_ok=True)
            data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    for module, name in re.findall(r'python_(?:env|reward)\("([\w.]+):(\w+)"', text):
        source = folder / (module.replace(".", "/") + ".py")
        if not source.exists():
            source.parent.mkdir(parents=True, exist_ok=True)
            source.write_text(f"class {name}:\n    pass\n" if name[0].isupper() else f"def {name}(*args):\n    return 0.0\n")


@pytest.fixture
def env_step_allowed(monkeypatch):
    """Lift the catalogue's refusal of `env_step` (not built yet, so `check` refuses it on every
    platform): these tests draw, print and check multi-turn graphs, which do not depend on it."""
    import dataclasses

    from flowrl.catalog import ops
    from flowrl.catalog.platforms import PLATFORMS
    from flowrl.catalog.spec import RUNS

    monkeypatch.setitem(ops.OPS, "env_step", dataclasses.replace(ops.OPS["env_step"],
                                                                 platforms=dict.fromkeys(PLATFORMS, RUNS)))
