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


# ---- the settings: flow parameters, --set, `flowrl run` options (a resumed run takes them too) ----------


def _flow(tmp: Path, params: str = "") -> Path:
    import json

    from flowrl.models.tiny import build_tiny_model
    from flowrl.tasks.arith import make_split

    build_tiny_model(tmp / "model", seed=0)
    (tmp / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make_split(8, 1)))
    (tmp / "f.flow").write_text(f"""import stdlib.grpo
model policy = hf("model")
dataset prompts = jsonl("train.jsonl", eval = "train.jsonl")
reward exact = verifier("math")
flow main(steps: int = 4{params}) {{
  grpo(policy, prompts, exact, batch = 4, group = 2, max_tokens = 4)
}}
""")
    return tmp / "f.flow"


def test_retention_settings_reach_the_plan(tmp_path):
    import pytest

    from flowrl.diagnostics import FlowError
    from flowrl.launch import build_plan, prepare_resume

    path = _flow(tmp_path, ", keep_last: int = 2, export_every: int = 5")
    plan = build_plan(str(path), sets={"keep_best": "1"})
    assert (plan.run.keep_last, plan.run.keep_best, plan.run.export_every) == (2, 1, 5)
    assert build_plan(str(path), run={"keep_last": 7}).run.keep_last == 7  # the command line's, over the flow's
    # a resumed run takes new retention options (what is kept from now on), and its plan.json says so
    run = tmp_path / "run"
    run.mkdir()
    _run(run, [2])
    (run / "plan.json").write_text(plan.to_json())
    resumed, finished = prepare_resume(str(run), path=None, flow=None, sets=None, steps=None, out=None,
                                       save_every=None, overwrite=False, log=None, log_samples=None,
                                       retention={"keep_last": 1, "export_every": 0})
    assert finished is None and (resumed.run.keep_last, resumed.run.export_every) == (1, 0)
    assert '"keep_last": 1' in (run / "plan.json").read_text()
    (tmp_path / "bad").mkdir()
    bad = _flow(tmp_path / "bad", ', keep_last: str = "3"')
    with pytest.raises(FlowError, match=r"E510.*run setting `keep_last` must be declared `int`"):
        build_plan(str(bad))


def test_run_options(tmp_path, capsys):
    from flowrl.cli import build_parser, main

    args = build_parser().parse_args(["run", "f.flow", "--keep-last", "3", "--keep-best", "--export-every", "10"])
    assert (args.keep_last, args.keep_best, args.export_every) == (3, 1, 10)
    assert build_parser().parse_args(["run", "f.flow", "--keep-best", "2"]).keep_best == 2
    assert main(["run", "f.flow", "--keep-last", "-1"]) == 2
    assert "--keep-last" in capsys.readouterr().err
