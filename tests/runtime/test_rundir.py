"""flowrl deletes only what it wrote in a run directory (flowrl/runtime/rundir.py, launch.claim_out_dir,
launch.after_failed_run): the list is written ahead, `--overwrite` and the clean-up after a failed run
delete listed entries only, a `.git` or an unlisted entry is refused by name, links are unlinked and
never followed, and a tampered list cannot reach outside the directory.

No engine starts: the driver's `run_plan` is replaced by one that records and writes as the driver does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from flowrl.cli import main
from flowrl.launch import RunError, claim_out_dir
from flowrl.runtime import rundir

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = str(ROOT / "flows" / "arith_grpo.flow")


def tree(d: Path) -> dict[str, str]:
    """Every path under ``d`` (links not followed) -> its contents, ``<dir>`` or ``-> target``."""
    out = {}
    for root, dirs, files in os.walk(d):
        for name in dirs + files:
            p = Path(root, name)
            rel = str(p.relative_to(d))
            out[rel] = (f"-> {os.readlink(p)}" if p.is_symlink() else "<dir>" if p.is_dir() else p.read_text())
    return out


@pytest.fixture
def fake_driver(monkeypatch):
    """`flowrl run` with a driver that records and writes plan.json, metrics.jsonl and a checkpoint with
    rank files, then does what the test says (``behaviour["do"](out)``)."""
    import flowrl.launch as launch

    behaviour = {}

    def run_plan(plan, out, **kw):
        rundir.own(out, "plan.json", "metrics.jsonl")
        (out / "plan.json").write_text(plan.to_json())
        (out / "metrics.jsonl").write_text("")
        ckpt = out / "checkpoints" / "step_000001"
        rundir.own(out, ckpt)
        (ckpt / "policy").mkdir(parents=True)
        (ckpt / "policy" / "rank0.safetensors").write_bytes(b"w")  # written by an engine rank, inside an owned dir
        if "do" in behaviour:
            behaviour["do"](out)
        return SimpleNamespace(out=out, steps=plan.run.steps, accuracy_before=None, accuracy_after=None, rows=[])

    monkeypatch.setattr(launch, "run_plan", run_plan)
    return behaviour


def project(tmp_path: Path, capsys) -> Path:
    """The issue's project folder: .git/, notes.txt, src/ and a plan.json from `flowrl plan --json`."""
    d = tmp_path / "project"
    (d / ".git" / "objects").mkdir(parents=True)
    (d / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (d / "notes.txt").write_text("my notes")
    (d / "src").mkdir()
    (d / "src" / "train.py").write_text("print(1)")
    assert main(["plan", DEFAULT, "--json"]) == 0
    (d / "plan.json").write_text(capsys.readouterr().out)
    return d


def test_overwrite_of_a_project_folder_holding_a_plan_json_deletes_nothing(tmp_path, capsys, fake_driver):
    d = project(tmp_path, capsys)
    before = tree(d)
    assert main(["run", DEFAULT, "--out", str(d), "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert ".git" in err and "never" in err
    assert tree(d) == before
    (d / ".git" / "HEAD").unlink()
    (d / ".git" / "objects").rmdir()
    (d / ".git").rmdir()  # without the .git: still no list of what flowrl wrote, so still refused
    before = tree(d)
    assert main(["run", DEFAULT, "--out", str(d), "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert "no list of what flowrl wrote" in err and "delete it yourself" in err
    assert tree(d) == before


def test_a_git_file_is_refused_too(tmp_path):
    d = tmp_path / "worktree"
    d.mkdir()
    rundir.start(d)
    (d / ".git").write_text("gitdir: /elsewhere\n")  # a git worktree's .git is a file
    rundir.own(d, "plan.json")
    (d / "plan.json").write_text("{}")
    with pytest.raises(RunError, match=r"\.git"):
        claim_out_dir(d, overwrite=True)
    assert rundir.remove_owned(d) == [".flowrl-owned", ".git", "plan.json"]  # all kept
    assert (d / ".git").is_file() and (d / "plan.json").is_file()


def test_overwrite_replaces_a_run_whose_every_entry_is_listed(tmp_path, capsys, fake_driver):
    d = tmp_path / "run"
    assert main(["run", DEFAULT, "--out", str(d), "--steps", "1"]) == 0
    assert rundir.first_foreign(d) is None
    assert main(["run", DEFAULT, "--out", str(d), "--steps", "1", "--overwrite"]) == 0
    assert sorted(p.name for p in d.iterdir()) == [".flowrl-owned", "checkpoints", "metrics.jsonl", "plan.json"]


@pytest.mark.parametrize("where", ["notes.txt", "checkpoints/notes.txt", "checkpoints/zz/notes.txt"])
def test_an_unlisted_entry_in_an_earlier_run_is_refused_by_name(where, tmp_path, capsys, fake_driver):
    d = tmp_path / "run"
    assert main(["run", DEFAULT, "--out", str(d), "--steps", "1"]) == 0
    (d / where).parent.mkdir(parents=True, exist_ok=True)
    (d / where).write_text("mine")
    before = tree(d)
    assert main(["run", DEFAULT, "--out", str(d), "--steps", "1", "--overwrite"]) == 1
    named = where if where.count("/") < 2 else "checkpoints/zz"  # the first entry not listed
    assert f"holds {named}, which flowrl did not write" in capsys.readouterr().err
    assert tree(d) == before


def test_a_failed_run_removes_what_it_wrote_and_keeps_the_users_files(tmp_path, capsys, fake_driver):
    def fail(out):
        (out / "notes.txt").write_text("written by the user during the run")
        (out / "checkpoints" / "mine").mkdir()
        raise RuntimeError("engine failed to start")

    fake_driver["do"] = fail
    d = tmp_path / "new"
    with pytest.raises(RuntimeError):
        from flowrl.launch import run_file

        run_file(DEFAULT, out=str(d), steps=1)
    err = capsys.readouterr().err
    assert f"removed what it wrote in {d}; kept 2 entries it did not write (checkpoints/mine, ...)" in err
    assert tree(d) == {"notes.txt": "written by the user during the run", "checkpoints": "<dir>",
                       "checkpoints/mine": "<dir>"}


def test_links_are_unlinked_never_followed(tmp_path):
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "precious.txt").write_text("keep")
    (outside / "sub" / "deep.txt").write_text("keep")
    d = tmp_path / "run"
    d.mkdir()
    rundir.start(d)
    rundir.own(d, "link_to_dir", "link_to_file", "checkpoints/step_000001")
    rundir.own(d, "tb", kind=rundir.DIR)  # listed as a directory flowrl made, but a link to one is there
    (d / "link_to_dir").symlink_to(outside)
    (d / "link_to_file").symlink_to(outside / "precious.txt")
    (d / "tb").symlink_to(outside / "sub")
    (d / "checkpoints" / "step_000001").mkdir(parents=True)
    (d / "checkpoints" / "step_000001" / "inner").symlink_to(outside)  # inside an owned tree
    want = tree(outside)
    assert rundir.first_foreign(d) is None
    assert rundir.remove_owned(d, remove_dir=True) == []
    assert not d.exists()
    assert tree(outside) == want


def test_a_tampered_list_cannot_reach_outside(tmp_path):
    outside = tmp_path / "victim"
    outside.mkdir()
    (outside / "x").write_text("keep")
    d = tmp_path / "run"
    d.mkdir()
    rundir.start(d)
    rundir.own(d, "plan.json")
    (d / "plan.json").write_text("{}")
    with open(d / rundir.LIST, "a") as f:
        for bad in ("../victim", "../victim/x", str(outside), str(outside / "x"), "a/../../victim", "", ".",
                    "./plan.json/..", None, 7):
            f.write(json.dumps({"path": bad, "kind": "path"}) + "\n")
        f.write("not json\n")
    assert set(rundir.listed(d)) == {"plan.json"}
    assert rundir.remove_owned(d) == []
    assert (outside / "x").read_text() == "keep" and not (d / "plan.json").exists()
    with pytest.raises(ValueError):
        rundir.own(d, tmp_path / "elsewhere")


def test_the_list_is_written_ahead_and_once(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    rundir.start(d)
    rundir.own(d, d / "checkpoints" / "step_000002")  # not created yet: listed all the same
    rundir.own(d, "checkpoints/step_000002", "checkpoints/step_000002")
    lines = (d / rundir.LIST).read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"path": "checkpoints", "kind": "dir"},
                                                     {"path": "checkpoints/step_000002", "kind": "path"}]
    (d / rundir.LIST).write_text("")  # replaced under this process: read again, not trusted from memory
    rundir.own(d, "checkpoints/step_000002")
    assert len((d / rundir.LIST).read_text().splitlines()) == 2


def test_resume_of_an_old_run_writes_a_list_that_names_only_what_it_wrote(tmp_path):
    d = tmp_path / "old"
    d.mkdir()
    (d / "plan.json").write_text("{}")  # written before flowrl kept a list
    rundir.own(d, "metrics.jsonl")
    assert rundir.first_foreign(d) == "plan.json"


def test_a_resumed_trace_keeps_the_earlier_steps(tmp_path):
    """trace.json after a resume (or a restart) from the checkpoint of step 2: the first attempt's
    set-up and steps 1-2, then the second attempt's; step 3 of the first attempt (done again) is gone."""
    from flowrl.runtime.observe import SETUP_STEP, Timeline

    path = tmp_path / "trace.json"
    first = Timeline("main")
    t0 = 1000.0  # wall-clock seconds of the first attempt's events (any past time)
    first.add("start:models", "driver", SETUP_STEP, t0, t0 + 1)
    for step in range(3):  # loop index 0..2: steps 1..3 as written
        first.add("generate", "policy.rollout", step, t0 + 2 + step, t0 + 2.5 + step)
    first.write(path)
    second = Timeline("main")
    t1 = 2000.0
    second.add("start:models", "driver", SETUP_STEP, t1, t1 + 1)
    second.add("generate", "policy.rollout", 2, t1 + 2, t1 + 2.5)
    second.keep_earlier(path, 2)
    second.write(path)
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["args"]["step"]) for e in events] == [
        ("start:models", 0), ("generate", 1), ("generate", 2), ("start:models", 0), ("generate", 3)]
    assert events[1]["ts"] == pytest.approx(2e6, abs=1) and events[3]["ts"] == pytest.approx((t1 - t0) * 1e6, abs=1)
    lanes = {e["args"]["name"] for e in json.loads(path.read_text())["traceEvents"] if e["name"] == "thread_name"}
    assert lanes == {"driver", "policy.rollout"}
    third = Timeline("main")  # a trace that is not JSON (or not a trace) adds nothing and is replaced
    path.write_text("{not json")
    third.keep_earlier(path, 5)
    assert third.trace_events()[1:] == []


def test_a_list_replaced_by_a_link_is_not_followed(tmp_path):
    victim = tmp_path / "bashrc"
    victim.write_text("export PATH=/usr/bin\n")
    d = tmp_path / "run"
    d.mkdir()
    (d / rundir.LIST).symlink_to(victim)
    (d / "plan.json").write_text("{}")
    assert not rundir.is_listed(d) and rundir.listed(d) == {}
    with pytest.raises(rundir.RunDirError, match="cannot be written .*writes nothing through a link"):
        rundir.own(d, "metrics.jsonl")  # never appended through the link: a one-line error, no traceback
    from flowrl.runtime.errors import user_error
    try:
        rundir.own(d, "metrics.jsonl")
    except rundir.RunDirError as e:
        assert user_error(e) and "start a new run" in user_error(e)
    with pytest.raises(RunError, match="no list of what flowrl wrote"):
        claim_out_dir(d, overwrite=True)
    rundir.start(d)  # a fresh list replaces the link itself
    assert not (d / rundir.LIST).is_symlink() and victim.read_text() == "export PATH=/usr/bin\n"


def test_a_setting_pointing_inside_the_run_is_listed_and_one_pointing_elsewhere_is_not(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = Path("runs") / "a"
    d.mkdir(parents=True)
    rundir.start(d)
    rundir.own_inside(d, d / "sync" / "policy")  # the `checkpoint` weight sync's default home
    rundir.own_inside(d, "shared/sync")  # a `dir` the flow names, relative to where flowrl runs
    rundir.own_inside(d, tmp_path / "runs" / "a" / "x")
    assert rundir.listed(d) == {"sync": "dir", "sync/policy": "path", "x": "path"}
