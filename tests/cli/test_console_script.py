"""The installed `flowrl` console script, run as a real process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cli_flows import GRPO, UNKNOWN_NAME

SCRIPT = Path(sys.executable).parent / "flowrl"


@pytest.mark.skipif(not SCRIPT.exists(), reason=f"console script not installed at {SCRIPT} (pip install -e .)")
def test_console_script_check(write_flow):
    good, bad = write_flow("good.flow", GRPO), write_flow("bad.flow", UNKNOWN_NAME)
    ok = subprocess.run([str(SCRIPT), "check", str(good)], capture_output=True, text=True, timeout=120)
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, f"ok: {good} (2 flows)\n", "")
    fail = subprocess.run([str(SCRIPT), "check", str(bad)], capture_output=True, text=True, timeout=120)
    assert fail.returncode == 1 and fail.stdout == ""
    assert f"{bad}:4:13: error[E101]: unknown name `rolouts`" in fail.stderr
    usage = subprocess.run([str(SCRIPT), "check"], capture_output=True, text=True, timeout=120)
    assert usage.returncode == 2 and "usage: flowrl check" in usage.stderr


@pytest.mark.skipif(not SCRIPT.exists(), reason=f"console script not installed at {SCRIPT}")
def test_cli_imports_no_heavy_modules():
    # `flowrl check` must start fast: the CLI and the compiler never import torch, ray or vllm.
    code = ("import sys, flowrl.cli, flowrl.compiler.pipeline, flowrl.views, flowrl.syntax.fmt; "
            "print(sorted(m for m in ('torch', 'ray', 'vllm', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr
