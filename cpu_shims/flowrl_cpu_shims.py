"""CPU-machine shim: lets PyPI's CUDA-built torchvision import on the CPU build of torch.

Installed by the Makefile on CPU machines only (``pip install ./cpu_shims``), never
part of the ``flowrl`` package or of a GPU install. SGLang imports torchvision on
every start (image preprocessing of its vision models), and PyPI has no CPU
torchvision wheel: the CUDA one's C++ ops library fails to load next to the CPU
torch (it needs libcudart), after which ``import torchvision`` stops at
``torch.library.register_fake("torchvision::nms")`` with "operator torchvision::nms
does not exist". Those are the only two ops torchvision registers fake kernels
for whether or not its library loaded (``nms`` and ``qnms``).

The ``.pth`` file of this package runs :func:`install` at interpreter start-up (in
every process: SGLang spawns its scheduler; Ray starts workers). It adds an import
hook that costs nothing until torchvision is first imported; then, only if
torchvision's ops library cannot be loaded, it defines the two schemas. The ops
stay unimplemented: calling ``torchvision.ops.nms`` still raises torchvision's own
"Couldn't load custom C++ ops" error. Nothing else is replaced (SGLang runs its
plain-torch layers on CPU without any ``sgl_kernel`` package).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

TORCHVISION_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
"""Op name -> schema, as torchvision's C++ library defines them (csrc/ops/nms.cpp, quantized/cpu/qnms_kernel.cpp)."""

_library = None
"""The ``torch.library.Library`` holding our definitions (they are dropped if it is garbage-collected)."""


def torchvision_ops_load(package_dir: str) -> bool:
    """Whether torchvision's own C++ ops library (``_C*.so`` in ``package_dir``) loads in this process."""
    import torch

    for lib in sorted(Path(package_dir).glob("_C*.so")):
        try:
            torch.ops.load_library(str(lib))
            return True
        except OSError:
            return False
    return False


def define_torchvision_schemas(package_dir: str) -> list[str]:
    """Define the schemas torchvision's import needs when its ops library cannot load; return the names defined."""
    global _library
    import torch

    if torchvision_ops_load(package_dir):
        return []
    missing = [name for name in TORCHVISION_SCHEMAS if not hasattr(torch.ops.torchvision, name)]
    if missing:
        _library = _library or torch.library.Library("torchvision", "FRAGMENT")
        for name in missing:
            _library.define(TORCHVISION_SCHEMAS[name])
    return missing


class TorchvisionHook(importlib.abc.MetaPathFinder):
    """Runs :func:`define_torchvision_schemas` once, just before torchvision is first imported."""

    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)  # once; the lookup below must not come back here
        spec = importlib.util.find_spec("torchvision")
        if spec is not None and spec.submodule_search_locations:
            define_torchvision_schemas(next(iter(spec.submodule_search_locations)))
        return spec


def install() -> bool:
    """Add the import hook (idempotent; a no-op once torchvision is imported). Returns whether it was added."""
    if "torchvision" in sys.modules or any(isinstance(f, TorchvisionHook) for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, TorchvisionHook())
    return True
