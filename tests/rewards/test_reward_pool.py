"""flowrl.rewards.pool: "module:function" rewards in a pool that survives per-sample failures."""

import pytest

from flowrl.rewards.pool import RewardError, RewardPool, RewardSpecError, resolve_reward

MOD = "flowrl_user_rewards"  # tests/rewards/flowrl_user_rewards.py (on sys.path under pytest)


def test_resolve_builtin_and_user_functions():
    assert resolve_reward("exact")(["1"], ["1"]) == [1.0]
    assert resolve_reward(f"{MOD}:length_reward")(["abc"], ["x"]) == [3.0]


@pytest.mark.parametrize(
    "spec, pattern",
    [
        ("no_such_module_xyz:f", r"reward 'no_such_module_xyz:f': cannot import module 'no_such_module_xyz'"),
        (f"{MOD}:missing", rf"reward '{MOD}:missing': module '{MOD}' has no function 'missing'; it has \[.*'length_reward'"),
        (f"{MOD}:NOT_CALLABLE", r"is a int, not a function"),
        ("justaname", r"reward 'justaname' is neither a built-in verifier .* nor of the form 'module:function'"),
        (":f", r"form 'module:function'"),
    ],
)
def test_bad_specs_name_the_spec(spec, pattern):
    with pytest.raises(RewardSpecError, match=pattern):
        resolve_reward(spec)
    with pytest.raises(RewardSpecError, match=pattern):
        RewardPool(spec, workers=0)


def test_inline_failure_is_pinned_to_its_sample():
    completions = ["3", "boom", "5", "4"]
    with RewardPool(f"{MOD}:fragile_reward", workers=0, error_reward=-1.0) as pool:
        res = pool.score(completions, ["3", "1", "6", "4"], prompts=["1+2=", "0+1=", "2+4=", "2+2="])
    assert res.rewards == [1.0, -1.0, 0.0, 1.0]
    assert res.errors == [RewardError(1, "0+1=", "boom", "ValueError: cannot score 'boom'")]
    assert "sample 1" in str(res.errors[0]) and "boom" in str(res.errors[0])


def test_long_texts_are_truncated_in_errors():
    with RewardPool(f"{MOD}:fragile_reward", workers=0) as pool:
        res = pool.score(["x" * 500], ["1"], prompts=["p" * 500])
    (err,) = res.errors
    assert len(err.prompt) == len(err.completion) == 200 and err.completion.endswith("…")
    assert err.message.startswith("ValueError: invalid literal for int()")
    assert res.rewards == [0.0]


def test_bad_return_values_become_errors():
    with RewardPool(f"{MOD}:wrong_length", workers=0) as pool:
        res = pool.score(["a", "b"], ["a", "b"])
    # The whole-chunk call returns 1 value for 2 samples; per sample it is fine.
    assert res.rewards == [1.0, 1.0] and res.errors == []
    with RewardPool(f"{MOD}:not_a_number", workers=0) as pool:
        res = pool.score(["a", "x", "b"], ["", "", ""])
    assert res.rewards == [0.5, 0.0, 0.5]
    assert [e.index for e in res.errors] == [1]
    assert "returned 'high'; rewards must be finite numbers" in res.errors[0].message


def test_prompts_are_passed_when_accepted():
    with RewardPool(f"{MOD}:prompt_aware", workers=0) as pool:
        assert pool.score(["ab", "zb"], ["", ""], prompts=["a?", "b?"]).rewards == [1.0, 0.0]


def test_process_pool_matches_inline_and_survives_errors():
    completions = [str(i % 7) if i % 5 else "boom" for i in range(40)]
    answers = [str(i % 3) for i in range(40)]
    prompts = [f"p{i}" for i in range(40)]
    with RewardPool(f"{MOD}:fragile_reward", workers=0) as inline:
        expected = inline.score(completions, answers, prompts)
    with RewardPool(f"{MOD}:fragile_reward", workers=2, chunk_size=6) as pool:
        got = pool.score(completions, answers, prompts)
        again = pool.score(["1", "2"], ["1", "1"])  # the pool is still usable
    assert got == expected
    assert [e.index for e in got.errors] == list(range(0, 40, 5))
    assert again.rewards == [1.0, 0.0] and again.errors == []


def test_process_pool_builtin_math_verifier():
    with RewardPool("math", workers=1) as pool:
        assert pool.score(["1/2", "0.3"], ["0.5", "0.5"]).rewards == [1.0, 0.0]


def test_hung_chunk_times_out_and_pool_recovers():
    with RewardPool(f"{MOD}:slow_on_sleep", workers=1, chunk_size=2, timeout_s=2.0, error_reward=-1.0) as pool:
        res = pool.score(["sleep", "a"], ["", ""])
        # Only the hanging sample loses its reward; its chunk-mate is scored by the fresh worker.
        assert res.rewards == [-1.0, 1.0]
        assert [e.index for e in res.errors] == [0] and "TimeoutError" in res.errors[0].message
        assert pool.restarts == 1
        assert pool.score(["a", "b"], ["", ""]).rewards == [1.0, 1.0]


def test_each_sample_has_its_own_deadline():
    completions = ["a", "sleep", "b", "c", "sleep", "d"]
    with RewardPool(f"{MOD}:sleeps_on_sleep", workers=2, chunk_size=3, timeout_s=1.0, error_reward=-1.0) as pool:
        res = pool.score(completions, [""] * 6, prompts=[f"p{i}" for i in range(6)])
        assert res.rewards == [1.0, -1.0, 1.0, 1.0, -1.0, 1.0]
        assert [(e.index, e.prompt, e.completion) for e in res.errors] == [(1, "p1", "sleep"), (4, "p4", "sleep")]
        assert all("did not finish within its timeout of 1 s" in e.message for e in res.errors)
        assert pool.restarts == 2
        assert pool.score(["x"] * 4, [""] * 4).rewards == [1.0] * 4


def test_a_sample_that_kills_its_worker_costs_only_itself():
    """It is scored once more by a fresh worker (its first worker may have died of something else);
    killing that one too, it scores the error reward."""
    with RewardPool(f"{MOD}:crashes_on_crash", workers=1, chunk_size=8, error_reward=-2.0) as pool:
        res = pool.score(["a", "crash", "b"], ["", "", ""])
        assert res.rewards == [1.0, -2.0, 1.0]
        assert [e.index for e in res.errors] == [1] and "exited with code 3" in res.errors[0].message
        assert res.recovered == [] and pool.restarts == 2


def test_a_worker_killed_from_outside_loses_no_reward(tmp_path):
    """SIGKILL of a worker mid-sample (an operator, the OOM killer): a fresh worker scores the sample
    and the rest of its chunk; the death is reported, nothing is lost (issue 14)."""
    marker = tmp_path / "killed"
    completions = ["a", f"killed:{marker}", "b", "c"]
    with RewardPool(f"{MOD}:killed_once", workers=2, chunk_size=2, error_reward=-2.0) as pool:
        res = pool.score(completions, [""] * 4, prompts=[f"p{i}" for i in range(4)])
        assert res.rewards == [1.0] * 4 and res.errors == [] and marker.exists()
        assert [(e.index, e.prompt) for e in res.recovered] == [(1, "p1")]
        assert "exited with code -9" in res.recovered[0].message
        assert "scored again by a fresh worker" in res.recovered[0].message
        assert pool.restarts == 1
        assert pool.score(["x"] * 4, [""] * 4).rewards == [1.0] * 4  # the pool keeps serving


def test_system_exit_is_an_error_not_a_dead_worker():
    with RewardPool(f"{MOD}:exits_on_exit", workers=1) as pool:
        res = pool.score(["a", "exit"], ["", ""])
        assert res.rewards == [1.0, 0.0] and res.errors[0].message == "SystemExit: 2"
        assert pool.restarts == 0


@pytest.mark.parametrize("workers", [0, 1])
def test_rows_reach_functions_that_take_them(workers):
    rows = [{"prompt": "p", "answer": "a", "bonus": 0.25}, {"prompt": "q", "answer": "b", "bonus": 2}]
    with RewardPool(f"{MOD}:from_rows", workers=workers) as pool:
        assert pool.score(["x", "y"], ["a", "b"], rows=rows).rewards == [0.25, 2.0]
    with RewardPool(f"{MOD}:length_reward", workers=workers) as pool:  # does not take rows: not passed
        assert pool.score(["x", "yy"], ["a", "b"], rows=rows).rewards == [1.0, 2.0]
    with RewardPool(f"{MOD}:from_rows", workers=workers) as pool:  # takes rows, none given: per-sample errors
        res = pool.score(["x"], ["a"])
    assert res.rewards == [0.0] and "rows" in res.errors[0].message


def test_rows_length_is_checked():
    with RewardPool("exact", workers=0) as pool:
        with pytest.raises(ValueError, match="2 completions, 2 answers, no prompts, 1 rows"):
            pool.score(["a", "b"], ["a", "b"], rows=[{}])


def test_python_reward_runs_model_code_in_the_sandbox():
    programs = ["print(6 * 7)", "while True:\n    pass", "import os; os.system('echo 42')", "print(41)"]
    with RewardPool(f"{MOD}:runs_in_sandbox", workers=1, timeout_s=30.0) as pool:
        res = pool.score(programs, ["42"] * 4)
    # The endless loop is stopped by the sandbox's own deadline (1 s), not the pool's.
    assert res.rewards == [1.0, 0.0, 1.0, 0.0] and res.errors == [] and pool.restarts == 0


def _write_module(folder, name, value):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(f"def reward(completions, answers):\n    return [{value}] * len(completions)\n")


def test_what_a_reward_prints_is_captured_per_sample_never_the_terminal(capfd):
    """print, stderr and a subprocess's writes alike: each sample's output comes back with its result."""
    completions = ["a", "loud", "boom", "b"]
    with RewardPool(f"{MOD}:prints_and_fails", workers=1, chunk_size=4, error_reward=-1.0) as pool:
        res = pool.score(completions, [""] * 4)
        again = pool.score(["quiet"], [""])
    assert res.rewards == [1.0, 1.0, -1.0, 1.0]
    assert res.output == [(0, "scoring a\n"), (1, "scoring loud\nto stderr\nfrom a subprocess\n"),
                          (3, "scoring b\n")]
    (err,) = res.errors
    assert err.output == "scoring boom\n" and err.message == "ValueError: cannot score 'boom'"
    assert "Traceback (most recent call last)" in err.traceback and "flowrl_user_rewards.py" in err.traceback
    assert 'raise ValueError(f"cannot score {c!r}")' in err.traceback
    assert again.output == [(0, "scoring quiet\n")] and again.errors == []  # the next batch: its own output only
    seen = capfd.readouterr()
    assert "scoring" not in seen.out + seen.err and "from a subprocess" not in seen.out + seen.err


def test_a_flood_of_output_keeps_its_head():
    from flowrl.rewards import pool as P

    with RewardPool(f"{MOD}:prints_a_lot", workers=1) as pool:
        res = pool.score(["x"], [""])
    ((_, text),) = res.output
    assert text.startswith("y" * 100) and text.endswith(f"[... {10 ** 6 - P.OUTPUT_KEEP} more bytes]")


def test_in_process_errors_keep_their_traceback():
    with RewardPool(f"{MOD}:fragile_reward", workers=0) as pool:
        (err,) = pool.score(["boom"], ["1"]).errors
    assert "Traceback" in err.traceback and "cannot score 'boom'" in err.traceback


def test_a_pending_batch_reports_how_far_it_got():
    seen = []
    with RewardPool(f"{MOD}:sleeps_on_sleep", workers=1, chunk_size=1, timeout_s=3.0, error_reward=-1.0) as pool:
        pool.on_wait = lambda done, total: seen.append((done, total))
        res = pool.score(["a", "sleep", "b"], [""] * 3)
    assert res.rewards == [1.0, -1.0, 1.0]
    assert seen and all(total == 3 for _, total in seen) and (1, 3) in seen


@pytest.mark.parametrize("workers", [0, 1])
def test_module_next_to_the_flow_comes_before_pythonpath(tmp_path, monkeypatch, workers):
    name = f"flowrl_reward_here_{workers}"
    _write_module(tmp_path / "on_pythonpath", name, 1.0)
    _write_module(tmp_path / "flow_dir", name, 2.0)
    monkeypatch.syspath_prepend(str(tmp_path / "on_pythonpath"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "on_pythonpath"))
    with RewardPool(f"{name}:reward", workers=workers, folder=tmp_path / "flow_dir") as pool:
        assert pool.score(["x"], ["y"]).rewards == [2.0]


def test_module_only_on_pythonpath_is_still_found(tmp_path, monkeypatch):
    _write_module(tmp_path / "elsewhere", "flowrl_reward_elsewhere", 3.0)
    monkeypatch.syspath_prepend(str(tmp_path / "elsewhere"))
    with RewardPool("flowrl_reward_elsewhere:reward", workers=0, folder=tmp_path / "empty") as pool:
        assert pool.score(["x"], ["y"]).rewards == [3.0]


def test_missing_module_names_the_folders_searched(tmp_path):
    with pytest.raises(RewardSpecError, match=r"cannot import module 'no_such_reward_mod'.*looked in the flow file's "
                                              r"folder .*flowdir, then the folders on PYTHONPATH, then installed "
                                              r"packages; hint: put the module next to the flow file"):
        resolve_reward("no_such_reward_mod:f", str(tmp_path / "flowdir"))


def test_module_imported_from_elsewhere_is_a_clear_error(tmp_path):
    _write_module(tmp_path / "flow_dir", MOD, 5.0)  # same name as the module pytest already imported
    with pytest.raises(RewardSpecError, match=rf"module '{MOD}' was already imported from .*{MOD}.py, so .*flow_dir"):
        resolve_reward(f"{MOD}:length_reward", str(tmp_path / "flow_dir"))


def test_mismatched_lengths_are_a_caller_error():
    with RewardPool("exact", workers=0) as pool:
        with pytest.raises(ValueError, match="2 completions, 1 answers"):
            pool.score(["a", "b"], ["a"])

