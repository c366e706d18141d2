"""`weighted_sum(a, b, ..., weights = [...])`: rewards combined in the flow.

The compiler checks the weights against the rewards (E220) and the rewards' kinds (E203); the
runtime builds each reward once (the parts before the sum), scores the batch with every part as
it would alone, and the reward is the weighted sum; each part's own scores come back unweighted
(the score op logs their means as ``reward/part/<name>/mean``).
"""

from __future__ import annotations

import pytest
import torch

from flowrl.diagnostics import FlowError
from flowrl.launch import build_plan
from flowrl.runtime.rewards import ScoreJob, WeightedSum, build_rewards, score_rollouts

USER = '''
def digits(completions, answers):
    """Number of characters of the completion, a shaping term."""
    return [float(len(c)) for c in completions]


def fragile(completions, answers):
    if "boom" in completions:
        raise ValueError("cannot score boom")
    return [1.0 for _ in completions]
'''


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """One folder for the module's flows: a module is imported once per process, from one place."""
    tmp = tmp_path_factory.mktemp("weighted")
    (tmp / "shaping_ws.py").write_text(USER)
    (tmp / "d.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    return tmp


def _flow(folder, rewards: str, used: str = "total") -> str:
    path = folder / f"w{len(list(folder.glob('*.flow')))}.flow"
    path.write_text(f"""import stdlib.grpo
model policy = tiny(task = "arith")
dataset d = jsonl("d.jsonl")
{rewards}
flow main(steps: int = 1) {{
  grpo(policy, d, {used}, batch = 2, group = 2, max_tokens = 4)
}}
""")
    return str(path)


def _rewards(folder, rewards: str, used: str = "total") -> dict:
    return build_rewards(build_plan(_flow(folder, rewards, used)))


def test_the_reward_is_the_weighted_sum_and_each_part_is_kept(folder):
    built = _rewards(folder, 'reward acc = verifier("exact", correct = 2.0)\n'
                               'reward length = python_reward("shaping_ws:digits", workers = 1)\n'
                               'reward total = weighted_sum(acc, length, weights = [1.0, -0.25])')
    try:
        total = built["total"]
        assert isinstance(total, WeightedSum) and [n for n, _, _ in total.parts] == ["acc", "length"]
        assert total.parts[0][1] is built["acc"] and total.parts[1][1] is built["length"]  # built once
        res = total.score(["2", "22", "3"], ["2", "2", "2"])
        assert res.parts == {"acc": [2.0, 0.0, 0.0], "length": [1.0, 2.0, 1.0]}
        assert res.rewards == [2.0 - 0.25, -0.5, -0.25]
        assert total.correct == 2.0 - 0.25  # every part right: acc's `correct`, length's default 1.0
    finally:
        for r in built.values():
            r.close()


def test_a_failing_part_costs_its_samples_that_part_only_and_is_reported(folder):
    built = _rewards(folder, 'reward acc = verifier("exact")\n'
                               'reward f = python_reward("shaping_ws:fragile", workers = 1, on_error = -1.0)\n'
                               'reward total = weighted_sum(acc, f, weights = [1.0, 0.5])')
    try:
        res = built["total"].score(["2", "boom"], ["2", "2"])
        # the user function raised on the batch: its pool re-scores sample by sample, so only "boom" fails
        assert res.parts["f"] == [1.0, -1.0] and res.rewards == [1.5, -0.5]
        assert [e.index for e in res.errors] == [1] and "cannot score boom" in res.errors[0].message
    finally:
        for r in built.values():
            r.close()


class _TokenScorer:
    """A reward that scores token rows (as a served reward model does): the row's length."""

    correct = None  # a score, with no "right" value

    def score_tokens(self, batch, step):
        from flowrl.rewards.pool import RewardResult

        return RewardResult(batch.attention_mask.sum(-1).float().tolist())

    def close(self):
        pass


class _TextScorer:
    correct = 1.0

    def score(self, completions, answers, prompts=None, rows=None):
        from flowrl.rewards.pool import RewardResult

        return RewardResult([float(c == a) for c, a in zip(completions, answers)])


def test_token_and_text_parts_each_get_their_own_form_and_sums_nest():
    batch = type("B", (), {"attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])})()
    job = ScoreJob(["7", "8"], ["7", "7"], None, None, batch, 3)
    inner = WeightedSum([("rm", _TokenScorer(), 0.5), ("acc", _TextScorer(), 1.0)])
    outer = WeightedSum([("inner", inner, 2.0), ("acc2", _TextScorer(), 1.0)])
    res = score_rollouts(outer, job)
    assert res.parts == {"inner": [2.0, 1.5], "acc2": [1.0, 0.0]}
    assert res.rewards == [5.0, 3.0]


def test_nested_sums_build_their_parts_first(folder):
    built = _rewards(folder, 'reward a = verifier("exact")\n'
                               'reward b = verifier("math")\n'
                               'reward ab = weighted_sum(a, b, weights = [1, 1])\n'
                               'reward total = weighted_sum(ab, a, weights = [0.5, 2.0])')
    try:
        assert built["total"].parts[0][1] is built["ab"]
        assert built["total"].score(["2"], ["2"]).rewards == [3.0]
    finally:
        for r in built.values():
            r.close()


@pytest.mark.parametrize("decl, message", [
    ("weighted_sum(acc, length, weights = [1.0])", "`weights` has 1 number for 2 arguments of `weighted_sum`"),
    ("weighted_sum(acc, length, weights = [1.0, 2.0, 3.0])", "`weights` has 3 numbers for 2 arguments"),
    ('weighted_sum(acc, length, weights = [1.0, "x"])', '`weights` of `weighted_sum` holds numbers, got "x"'),
    ("weighted_sum(acc, acc, weights = [1.0, 1.0])", "`acc` is given to `weighted_sum` twice"),
    ("weighted_sum(acc, d, weights = [1.0, 1.0])", "argument `more` of `weighted_sum` must be a reward, but `d` is"),
    ("weighted_sum(acc, length)", "`weighted_sum` needs option `weights`"),
])
def test_the_compiler_refuses_weights_that_do_not_fit_with_a_position(folder, decl, message):
    rewards = ('reward acc = verifier("exact")\nreward length = python_reward("shaping_ws:digits")\n'
               f"reward total = {decl}")
    path = _flow(folder, rewards)
    with pytest.raises(FlowError) as e:
        build_plan(path)
    text = str(e.value)
    assert message in text, text
    assert f"{path}:6:" in text, text  # the weighted_sum line
