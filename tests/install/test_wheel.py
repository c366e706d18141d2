"""What users install, not only the checkout: a wheel built from the repository, installed into a fresh
virtual environment outside the checkout, checks and runs a flow that imports the standard library.

The wheel is installed with pip (no editable install, no checkout on ``sys.path``: the work directory is a
temporary folder and the test asserts where ``flowrl`` is imported from). Its dependencies (torch, vLLM, Ray:
3.5 GB, minutes to install) are not installed a second time: the fresh environment reads them from the test's
own environment through a ``.pth`` line, which adds that site-packages directory as a plain path; its
``.pth`` start-up hooks are copied over (the CPU shims), except the editable install's finder of the checkout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))
from e2e_kit import make_workdir  # noqa: E402

FLOW = """import stdlib.grpo

model policy = hf("model")
dataset prompts = jsonl("train.jsonl", eval = "test.jsonl")
reward sevens = python_reward("my_rewards:sevens", workers = 1)

flow main(steps: int = 2) {
  grpo(policy, prompts, sevens, batch = 4, group = 2, max_tokens = 6, lr = 3e-3, kl = 0.0, seed = 1)
}
"""

REWARDS = '''def sevens(completions, answers, prompts=None):
    return [c.count("7") / max(len(c), 1) for c in completions]
'''


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh virtual environment holding the wheel of this checkout (its ``bin/``)."""
    tmp = tmp_path_factory.mktemp("wheel")
    dist, venv = tmp / "dist", tmp / "venv"
    # --no-build-isolation: the build uses this environment's setuptools (no index needed)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(dist), str(ROOT)], check=True, cwd=tmp)
    wheel, = dist.glob("flowrl-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, cwd=tmp)
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    deps = Path(sysconfig.get_paths()["purelib"])
    Path(purelib, "00_dependencies.pth").write_text(f"{deps}\n")  # first: the .pth files below import from it
    for pth in deps.glob("*.pth"):  # the dependencies' own start-up hooks (the CPU shims), not the checkout's
        if not pth.name.startswith("__editable__"):
            Path(purelib, pth.name).write_text(pth.read_text())
    return venv / "bin"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "FLOWRL_STDLIB"))}
    return env


def test_the_installed_package_is_the_wheel_and_ships_the_standard_library(installed, tmp_path):
    out = subprocess.run([str(installed / "python"), "-c",
                          "import flowrl, json; from flowrl.compiler.unit import stdlib_dir; "
                          "print(json.dumps([flowrl.__file__, sorted(p.name for p in stdlib_dir().glob('*.flow'))]))"],
                         check=True, capture_output=True, text=True, cwd=tmp_path, env=_env()).stdout
    where, flows = json.loads(out)
    assert Path(where).is_relative_to(installed.parent), where  # not the checkout
    assert flows == sorted(p.name for p in (ROOT / "flowrl" / "stdlib").glob("*.flow")) and "grpo.flow" in flows


def test_the_installed_wheel_checks_and_runs_a_flow_importing_the_standard_library(installed, tmp_path):
    work = make_workdir(tmp_path / "project", rows=40, train=32)
    (work / "my_rewards.py").write_text(REWARDS)
    (work / "main.flow").write_text(FLOW)
    check = subprocess.run([str(installed / "flowrl"), "check", "main.flow"], capture_output=True, text=True,
                           cwd=work, env=_env())
    assert check.returncode == 0, check.stdout + check.stderr
    run = subprocess.run([str(installed / "flowrl"), "run", "main.flow", "--out", "run"], capture_output=True,
                         text=True, cwd=work, env=_env(), timeout=900)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # the held-out evaluation before RL, then two steps
    assert json.loads((work / "run" / "summary.json").read_text())["steps_done"] == 2
