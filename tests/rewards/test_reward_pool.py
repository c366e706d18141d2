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
        assert res.rewards == [-1.0, -1.0]
        assert [e.index for e in res.errors] == [0, 1] and "TimeoutError" in res.errors[0].message
        assert pool.score(["a", "b"], ["", ""]).rewards == [1.0, 1.0]


def test_mismatched_lengths_are_a_caller_error():
    with RewardPool("exact", workers=0) as pool:
        with pytest.raises(ValueError, match="2 completions, 1 answers"):
            pool.score(["a", "b"], ["a"])
