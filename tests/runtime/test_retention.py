"""Checkpoint retention (``keep_last``, ``keep_best``): which checkpoints go as they are superseded, that the
best by held-out accuracy and the one a resumed run started from stay, and that only what flowrl wrote is
deleted. The end-to-end run with retention and ``export_every`` is in tests/runtime/test_export_e2e.py."""

from __future__ import annotations

from pathlib import Path

from flowrl.runtime import rundir
from flowrl.runtime.checkpoints import checkpoint_dir, complete_checkpoints, prune_checkpoints, retained, step_of, \
    write_checkpoint


def _run(tmp: Path, steps: list[int], listed: bool = True) -> Path:
    rundir.start(tmp)
    for s in steps:
        final = checkpoint_dir(tmp, s)
        if listed:
            rundir.own(tmp, final)
        write_checkpoint(final, lambda d: (d / "state.bin").write_bytes(b"x" * 10))
    return tmp


def _left(out: Path) -> list[int]:
    return [step_of(p) for p in complete_checkpoints(out)]


def test_keep_last_deletes_the_older_checkpoints(tmp_path):
    out = _run(tmp_path, [1, 2, 3, 4])
    gone = prune_checkpoints(out, keep_last=2, keep_best=0, scores={})
    assert [step_of(p) for p in gone] == [1, 2] and _left(out) == [3, 4]
    assert not checkpoint_dir(out, 1).exists()  # the whole directory, not only its manifest


def test_the_best_by_held_out_accuracy_is_kept(tmp_path):
    out = _run(tmp_path, [2, 4, 6, 8])
    scores = {0: 0.99, 2: 0.3, 4: 0.8, 6: 0.5, 8: 0.1}  # step 0 (before RL) has no checkpoint: never "best"
    prune_checkpoints(out, keep_last=1, keep_best=1, scores=scores)
    assert _left(out) == [4, 8]
    # a later, better one supersedes it
    rundir.own(out, checkpoint_dir(out, 10))
    write_checkpoint(checkpoint_dir(out, 10), lambda d: None)
    prune_checkpoints(out, keep_last=1, keep_best=1, scores={**scores, 10: 0.9})
    assert _left(out) == [10]


def test_ties_keep_the_first_to_reach_the_best_and_unscored_ones_are_never_best():
    assert retained([2, 4, 6], keep_last=1, keep_best=1, scores={2: 0.5, 4: 0.5}) == {2, 6}
    assert retained([2, 4, 6], keep_last=1, keep_best=2, scores={}) == {6}


def test_the_checkpoint_a_resumed_run_started_from_is_never_deleted(tmp_path):
    out = _run(tmp_path, [3, 4, 5, 6])
    prune_checkpoints(out, keep_last=1, keep_best=0, scores={}, protect=frozenset({3}))
    assert _left(out) == [3, 6]


def test_keep_best_alone_keeps_the_newest_too(tmp_path):
    out = _run(tmp_path, [1, 2, 3])
    prune_checkpoints(out, keep_last=0, keep_best=1, scores={1: 0.7, 2: 0.2, 3: 0.1})
    assert _left(out) == [1, 3]


def test_no_retention_keeps_everything(tmp_path):
    out = _run(tmp_path, [1, 2, 3])
    assert prune_checkpoints(out, keep_last=0, keep_best=0, scores={}) == [] and _left(out) == [1, 2, 3]


def test_only_what_flowrl_wrote_is_deleted(tmp_path):
    out = _run(tmp_path, [1, 2], listed=False)  # checkpoints put there by someone else: not in the list
    own = checkpoint_dir(out, 3)
    rundir.own(out, own)
    write_checkpoint(own, lambda d: None)
    notes = []
    assert prune_checkpoints(out, keep_last=1, keep_best=0, scores={}, note=notes.append) == []
    assert _left(out) == [1, 2, 3]
    assert len(notes) == 2 and "flowrl did not write it" in notes[0]
