"""The wheels `make gpu-check` needs on a GPU machine that cannot reach a package index, made here.

    python3 bench/gpu_wheels.py --out .whl            # here, where pip reaches an index
    # there (CUDA torch and transformers installed, no network), with .whl copied beside the repo:
    python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site make gpu-check GPU_PYTHON=python3

It downloads, for the target's Python (``--python``, default 3.12) on x86-64 Linux, what such a
machine lacks: Ray and the requirements it has beyond a CUDA image's usual packages, Megatron-core,
lark and math-verify with theirs (:data:`WHEELS`). Ray's wheel (79 MB for 2.60) is repacked without
what flowrl never imports (:data:`RAY_UNUSED`: its Java jars, the dashboard's web client, RLlib,
Serve, Tune, the LLM library): 41 MB, so that everything fits a 64 MiB transfer beside the repo.
vLLM is not among them: its wheels are several hundred MB; `gpu_check.py` skips its rows and rolls
the GRPO check out with ``hf_generate`` where it is missing. Measured on an H200 (docs/engines.md,
"GPU check").
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

WHEELS = (
    "ray==2.60.0", "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "referencing==0.37.0",
    "rpds-py==2026.9.1",
    "megatron-core==0.19.2",
    "lark==1.2.2",
    "math-verify==0.9.0", "latex2sympy2_extended==1.11.0", "antlr4-python3-runtime==4.13.2",
)
"""Pinned to the versions `make test` runs on CPU (jsonschema and its three: Ray's requirements a CUDA
image lacks; latex2sympy2_extended and antlr4: math-verify's)."""

RAY_UNUSED = ("ray/jars/", "ray/dashboard/client/", "ray/rllib/", "ray/serve/", "ray/tune/", "ray/llm/")
"""Folders of Ray's wheel that ``flowrl run`` never imports (it starts Ray without the dashboard)."""

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def slim_wheel(src: Path, dst: Path, drop: tuple[str, ...]) -> int:
    """Repack wheel ``src`` as ``dst`` without the entries under ``drop`` (their lines left out of its
    RECORD too, so pip installs it cleanly); the bytes left out, uncompressed."""
    dropped = 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            if info.filename.startswith(drop):
                dropped += info.file_size
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = [line for line in data.decode().splitlines() if not line.startswith(drop)]
                data = ("\n".join(lines) + "\n").encode()
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return dropped


def download(out: Path, python: str) -> None:
    """``pip download`` of :data:`WHEELS` (binary wheels only, no requirements) into ``out``."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python, "--implementation", "cp", *platforms, "-d", str(out), *WHEELS],
                   check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".whl", help="folder the wheels are written to")
    ap.add_argument("--python", default="3.12", help="the GPU machine's Python version")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    download(out, args.python)
    for wheel in sorted(out.glob("ray-*.whl")):
        full = wheel.with_suffix(".full")
        wheel.rename(full)
        dropped = slim_wheel(full, wheel, RAY_UNUSED)
        full.unlink()
        print(f"{wheel.name}: {dropped / 1e6:.0f} MB of unused folders left out")
    total = sum(w.stat().st_size for w in out.glob("*.whl"))
    print(f"{len(list(out.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
