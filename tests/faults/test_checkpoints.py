"""Checkpoints that cannot be lost (issue 14, items 3-5): atomic writes with a manifest of
checksums, damage found at ``--resume`` with the previous intact checkpoint offered, and a
full disk during a checkpoint or metrics write that loses nothing written before."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from flowrl.runtime import checkpoints as C
from flowrl.runtime.checkpoints import (CheckpointError, checkpoint_dir, complete_checkpoints, resumable_checkpoint,
                                        verify_checkpoint, write_checkpoint)


def _writer(payload: bytes):
    def write(tmp: Path) -> None:
        (tmp / "policy").mkdir()
        (tmp / "policy" / "engine_state.pt").write_bytes(payload)
        (tmp / "driver.json").write_text(json.dumps({"step": 1}))
    return write


def _run(tmp_path: Path, steps=(2, 4, 6)) -> Path:
    out = tmp_path / "run"
    for s in steps:
        write_checkpoint(checkpoint_dir(out, s), _writer(bytes([s]) * 1000))
    return out


def test_manifest_lists_every_file_with_size_and_crc(tmp_path):
    ckpt = write_checkpoint(checkpoint_dir(tmp_path, 3), _writer(b"x" * 4096))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["driver.json", "policy/engine_state.pt"]
    assert manifest["files"]["policy/engine_state.pt"]["bytes"] == 4096
    import zlib
    assert manifest["files"]["policy/engine_state.pt"]["crc32"] == f"{zlib.crc32(b'x' * 4096):#010x}"
    assert not ckpt.with_name(ckpt.name + ".tmp").exists()
    verify_checkpoint(ckpt)


def test_kill_during_write_leaves_previous_checkpoint_intact(tmp_path):
    out = _run(tmp_path, (2,))

    def dies_midway(tmp: Path) -> None:
        (tmp / "driver.json").write_text("{")
        raise KeyboardInterrupt  # the process is stopped while the files are being written

    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(checkpoint_dir(out, 4), dies_midway)
    assert [p.name for p in complete_checkpoints(out)] == ["step_000002"]
    assert not (out / "checkpoints" / "step_000004").exists()
    assert resumable_checkpoint(out) == checkpoint_dir(out, 2)


def test_half_written_directories_are_ignored_with_a_note(tmp_path):
    out = _run(tmp_path, (2,))
    (out / "checkpoints" / "step_000004.tmp").mkdir()  # a kill -9 before the rename
    (out / "checkpoints" / "step_000006").mkdir()  # no manifest: not written to the end
    (out / "checkpoints" / "step_000006" / "driver.json").write_text("{}")
    notes = []
    assert resumable_checkpoint(out, note=notes.append) == checkpoint_dir(out, 2)
    assert len(notes) == 2 and all("did not finish" in n for n in notes)
    assert "step_000004.tmp" in notes[0] and "step_000006" in notes[1]


def test_rewriting_a_step_replaces_it_only_when_complete(tmp_path):
    out = _run(tmp_path, (2,))
    with pytest.raises(RuntimeError):
        write_checkpoint(checkpoint_dir(out, 2), lambda tmp: (_ for _ in ()).throw(RuntimeError("boom")))
    verify_checkpoint(checkpoint_dir(out, 2))
    write_checkpoint(checkpoint_dir(out, 2), _writer(b"new"))
    assert (checkpoint_dir(out, 2) / "policy" / "engine_state.pt").read_bytes() == b"new"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002"]


def test_bit_flip_is_named_with_both_checksums_and_the_previous_checkpoint_offered(tmp_path):
    out = _run(tmp_path)
    target = checkpoint_dir(out, 6) / "policy" / "engine_state.pt"
    data = bytearray(target.read_bytes())
    data[500] ^= 0x10
    target.write_bytes(bytes(data))
    want = json.loads((checkpoint_dir(out, 6) / "manifest.json").read_text())["files"]["policy/engine_state.pt"]
    import zlib
    with pytest.raises(CheckpointError) as e:
        resumable_checkpoint(out)
    msg = str(e.value)
    assert "step_000006" in msg and "policy/engine_state.pt" in msg
    assert f"{zlib.crc32(bytes(data)):#010x}" in msg and want["crc32"] in msg
    assert f"`flowrl run --resume {out} --resume-step 4`" in msg
    assert "\n" not in msg  # one line: the CLI prints the first line only
    assert resumable_checkpoint(out, 4) == checkpoint_dir(out, 4)


def test_truncation_is_named_and_skips_to_the_newest_intact_checkpoint(tmp_path):
    out = _run(tmp_path)
    for s in (6, 4):  # both newer ones damaged: step 2 is offered
        target = checkpoint_dir(out, s) / "driver.json"
        target.write_bytes(target.read_bytes()[:5])
    with pytest.raises(CheckpointError, match=r"driver.json has 5 bytes, the manifest says \d+ .*--resume-step 2`"):
        resumable_checkpoint(out)
    (checkpoint_dir(out, 2) / "policy" / "engine_state.pt").unlink()
    with pytest.raises(CheckpointError, match="no earlier checkpoint is intact"):
        resumable_checkpoint(out)
    with pytest.raises(CheckpointError, match=r"policy/engine_state.pt is missing"):
        verify_checkpoint(checkpoint_dir(out, 2))


def test_resume_step_must_name_a_complete_checkpoint(tmp_path):
    out = _run(tmp_path)
    with pytest.raises(CheckpointError, match=r"--resume-step 5: .* complete checkpoints: 2, 4, 6"):
        resumable_checkpoint(out, 5)


def test_damaged_checkpoint_is_refused_by_eval_from(tmp_path):
    """``flowrl eval --from`` verifies the checkpoint it loads; half-written ones are not counted."""
    from flowrl.launch import RunError, checkpoint_of, latest_checkpoint_step

    out = _run(tmp_path)
    (out / "checkpoints" / "step_000008.tmp").mkdir()
    assert latest_checkpoint_step(out) == 6
    (out / "plan.json").write_text("{}")
    target = checkpoint_dir(out, 6) / "driver.json"
    target.write_bytes(b"X" + target.read_bytes()[1:])
    with pytest.raises(RunError, match=r"--from .*step_000006 is damaged: driver.json has CRC-32"):
        checkpoint_of(str(out), None)
    assert checkpoint_of(str(out), 4) == checkpoint_dir(out, 4)


# ---- disk full (ENOSPC) ------------------------------------------------------------------------


def _enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_during_checkpoint_is_a_clear_error_and_loses_nothing(tmp_path):
    out = _run(tmp_path, (2,))

    def fills_the_disk(tmp: Path) -> None:
        (tmp / "policy").mkdir()
        with open(tmp / "policy" / "engine_state.pt", "wb") as f:
            f.write(b"half")
            _enospc()

    with pytest.raises(CheckpointError) as e:
        write_checkpoint(checkpoint_dir(out, 4), fills_the_disk)
    msg = str(e.value)
    assert "disk full while writing checkpoint" in msg and "step_000004" in msg
    assert "the previous checkpoint step_000002 is intact" in msg and f"--resume {out}" in msg
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002"]
    verify_checkpoint(checkpoint_dir(out, 2))


def test_disk_full_while_writing_the_manifest(tmp_path, monkeypatch):
    out = _run(tmp_path, (2,))
    monkeypatch.setattr(C.os, "fsync", _enospc)  # the data reaches the disk only at fsync
    with pytest.raises(CheckpointError, match="disk full"):
        write_checkpoint(checkpoint_dir(out, 4), _writer(b"abc"))
    monkeypatch.undo()
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_000002"]
    verify_checkpoint(checkpoint_dir(out, 2))


def test_disk_full_in_a_train_engine_is_recognised_through_ray_errors():
    """A train engine's ENOSPC reaches the driver wrapped (RayTaskError.cause, or chained)."""
    class Wrapped(Exception):
        def __init__(self, cause):
            super().__init__("actor failed")
            self.cause = cause

    assert C.disk_full(Wrapped(OSError(errno.ENOSPC, "full")))
    try:
        try:
            _enospc()
        except OSError as inner:
            raise RuntimeError("save failed") from inner
    except RuntimeError as outer:
        assert C.disk_full(outer)
    assert not C.disk_full(OSError(errno.EACCES, "denied"))


def test_disk_full_during_metrics_write_keeps_the_earlier_rows(tmp_path, monkeypatch):
    from flowrl.runtime import observe
    from flowrl.runtime.observe import MetricsLog, ObserveError

    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.log(1, {"reward/mean": 0.5})
    log.log(2, {"reward/mean": 0.75})

    def half_then_full(fd, data):
        import os
        os.write(fd, data[: len(data) // 2])  # a torn line reaches the file first
        _enospc()

    monkeypatch.setattr(observe, "_write_all", half_then_full)
    with pytest.raises(ObserveError, match=r"disk full writing step 3's metrics .*earlier steps are kept"):
        log.log(3, {"reward/mean": 1.0})
    monkeypatch.undo()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    assert [r["step"] for r in MetricsLog(tmp_path / "metrics.jsonl", resume_after_step=2).rows()] == [1, 2]


def test_resume_step_needs_resume(capsys):
    from flowrl.cli import main
    from flowrl.launch import RunError, run_file

    with pytest.raises(RunError, match=r"--resume-step 2 picks a checkpoint .*add --resume RUN_DIR"):
        run_file("flows/arith_grpo.flow", resume_step=2)
    assert main(["run", "flows/arith_grpo.flow", "--resume-step", "2"]) == 1
    assert "add --resume RUN_DIR" in capsys.readouterr().err
