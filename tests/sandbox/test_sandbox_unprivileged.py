"""The containment tests again, as an ordinary user (``nobody``), when the suite runs as root.

Without root a worker cannot switch to a uid of its own; the other layers (rlimits, a
network namespace through a user namespace, seccomp, bubblewrap, the process-tree
sweep) must still hold: with bubblewrap the one uid test must be the only one skipped. The child
runs ``/usr/bin/python3`` on a world-readable copy of ``flowrl/sandbox`` and of the few
pure-Python packages pytest needs (a virtualenv under ``/root`` is unreadable to nobody).
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import subprocess
import tempfile
from xml.etree import ElementTree
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pyseccomp", "py")


def _copy_module(name: str, dest: Path) -> None:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        return  # optional (e.g. `py`, absent from new pytest releases)
    origin = Path(spec.origin)
    if origin.name == "__init__.py":
        shutil.copytree(origin.parent, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        shutil.copy2(origin, dest / origin.name)


@pytest.mark.skipif(os.geteuid() != 0, reason="already unprivileged: test_containment.py itself is that run")
def test_containment_suite_passes_as_nobody():
    if not shutil.which("setpriv") or not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("needs setpriv (util-linux) and /usr/bin/python3")
    nobody = pwd.getpwnam("nobody")
    top = Path(tempfile.mkdtemp(prefix="flowrl-sandbox-nobody-"))  # pytest's tmp_path is root-only (0700)
    try:
        _run_as(nobody, top)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _run_as(nobody, top: Path) -> None:
    top.chmod(0o755)
    copy = top / "copy"
    shutil.copytree(ROOT / "flowrl" / "sandbox", copy / "flowrl" / "sandbox",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "flowrl" / "__init__.py", copy / "flowrl" / "__init__.py")
    (copy / "tests").mkdir()
    shutil.copy2(ROOT / "tests" / "sandbox" / "test_containment.py", copy / "tests" / "test_containment.py")
    site = copy / "site"
    site.mkdir()
    for name in PACKAGES:
        _copy_module(name, site)
    subprocess.run(["chmod", "-R", "a+rX", str(copy)], check=True)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(copy), "PYTHONPATH": f"{copy}:{site}",
           "PYTHONDONTWRITEBYTECODE": "1"}
    out = top / "out"  # the only folder nobody may write
    out.mkdir()
    os.chown(out, nobody.pw_uid, nobody.pw_gid)
    report_xml = out / "report.xml"
    cmd = ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups",
           "/usr/bin/python3", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={report_xml}",
           "tests/test_containment.py"]
    res = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=600)
    report = res.stdout[-6000:] + res.stderr[-2000:]
    assert res.returncode == 0, report
    cases = ElementTree.parse(report_xml).getroot().iter("testcase")
    skipped = {c.get("name"): c.find("skipped").get("message") for c in cases if c.find("skipped") is not None}
    # With bubblewrap, only the uid test may skip; without it, the tests that need its
    # filesystem view or pid namespace skip too (no uid of its own to fall back on).
    with_bwrap = {name: why for name, why in skipped.items() if name.endswith("[bubblewrap]")}
    assert list(with_bwrap) == ["test_uid_is_unprivileged_and_per_worker[bubblewrap]"], report
    assert "isolation layer 'uid' is not active here: not root" in with_bwrap[list(with_bwrap)[0]]
    for name, why in skipped.items():
        assert name.endswith("[bubblewrap]") or "'uid'" in why or "'filesystem'" in why or "neither a uid" in why, (
            name, why)
