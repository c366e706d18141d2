"""cpu_shims/flowrl_cpu_shims.py: the CPU-machine hook that lets PyPI's CUDA torchvision import (for SGLang).

Each case runs a fresh interpreter of this venv, where the package's .pth file has
already installed the hook at start-up, as in SGLang's and Ray's child processes.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

shims = pytest.importorskip("flowrl_cpu_shims", reason="cpu_shims/ is installed on CPU machines only (Makefile)")
pytest.importorskip("torchvision")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_hook_is_installed_at_startup_and_torchvision_imports():
    out = _run(
        "import sys, flowrl_cpu_shims as s\n"
        "assert any(isinstance(f, s.TorchvisionHook) for f in sys.meta_path)\n"
        "import torchvision.transforms, torch\n"
        "assert not any(isinstance(f, s.TorchvisionHook) for f in sys.meta_path)  # ran once\n"
        "print(torchvision.extension._has_ops(), hasattr(torch.ops.torchvision, 'nms'))\n"
        "try:\n"
        "    torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)\n"
        "except RuntimeError as e:\n"
        "    print('nms raises:', 'custom C++ ops' in str(e))\n"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    has_ops, has_nms = out.stdout.splitlines()[0].split()
    if has_ops == "True":
        pytest.skip("this torchvision's own ops library loads: the shim defines nothing here")
    assert has_nms == "True"  # the schema the import needs is defined...
    assert out.stdout.splitlines()[1] == "nms raises: True"  # ...but the op stays unimplemented


def test_without_the_hook_torchvision_fails_as_the_shim_says():
    out = _run(
        "import sys, flowrl_cpu_shims as s\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, s.TorchvisionHook)]\n"
        "import importlib.util\n"
        "if s.torchvision_ops_load(importlib.util.find_spec('torchvision').submodule_search_locations[0]):\n"
        "    print('ops load'); raise SystemExit\n"
        "import torchvision\n"
    )
    if out.stdout.strip() == "ops load":
        pytest.skip("this torchvision's own ops library loads: nothing to shim")
    assert out.returncode != 0 and "operator torchvision::nms does not exist" in out.stderr


def test_install_is_idempotent_and_skips_once_torchvision_is_loaded():
    out = _run(
        "import sys, flowrl_cpu_shims as s\n"
        "print(s.install())\n"  # already installed by the .pth file
        "import torchvision\n"
        "print(s.install())\n"  # torchvision is imported: nothing to do
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"]
