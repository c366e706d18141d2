"""reasoning_gym_score(): each completion scored by its row's Reasoning Gym task (the real package), its
answer read as reasoning_gym's evaluation reads it; rows it cannot score are that sample's error."""

from __future__ import annotations

import pytest

pytest.importorskip("reasoning_gym")

from flowrl.data.reasoning_gym import generate_splits  # noqa: E402
from flowrl.plan import RewardPlan  # noqa: E402
from flowrl.rewards.pool import RewardPool  # noqa: E402
from flowrl.rewards.reasoning_gym import extract, reasoning_gym_score  # noqa: E402

CHAIN = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


@pytest.fixture(scope="module")
def rows():
    return generate_splits("chain_sum", CHAIN, size=6, seed=5)[0]


def test_extract_reads_the_last_answer_tag_else_the_completion():
    assert extract("<think>2+2</think> <answer>4</answer> then <answer> 5 </answer>") == "5"
    assert extract("  17\n") == "17"
    assert extract("17", "tag") is None  # reasoning_gym's own rule: no tag, no answer
    assert extract("<answer>4</answer>", "raw") == "<answer>4</answer>"
    with pytest.raises(ValueError):
        extract("4", "last")


def test_scores_are_the_tasks_own(rows):
    import reasoning_gym

    ds = reasoning_gym.create_dataset("chain_sum", seed=5, size=6, **CHAIN)
    right = [r["answer"] for r in rows]
    assert reasoning_gym_score(right, right, rows=rows) == [1.0] * 6
    tagged = [f"thinking... <answer>{a}</answer>" for a in right]
    assert reasoning_gym_score(tagged, right, rows=rows) == [1.0] * 6
    assert reasoning_gym_score(tagged, right, rows=rows, extract_mode="raw") == \
        [ds.score_answer(t, ds[i]) for i, t in enumerate(tagged)]  # partial credit, as the task gives it
    wrong = [str(int(a) + 1) for a in right]
    assert reasoning_gym_score(wrong, right, rows=rows) == [ds.score_answer(w, ds[i]) for i, w in enumerate(wrong)]
    assert reasoning_gym_score(right, right, rows=rows, extract_mode="tag") == [0.0] * 6


def test_the_tasks_config_reaches_its_scorer():
    # decimal_arithmetic's scorer rounds to the config's max_num_decimal_places: a scorer made with the
    # default config would score the same answer otherwise
    cfg = {"min_num_decimal_places": 1, "max_num_decimal_places": 1, "min_terms": 2, "max_terms": 2}
    (row,) = generate_splits("decimal_arithmetic", cfg, size=1, seed=2)[0]
    assert reasoning_gym_score([row["answer"]], [row["answer"]], rows=[row]) == [1.0]


def test_rows_reasoning_gym_wrote_are_scored_by_their_metadata(rows):
    exported = [{"question": r["question"], "answer": r["answer"], "metadata": r["metadata"]} for r in rows]
    assert reasoning_gym_score([r["answer"] for r in rows], [r["answer"] for r in rows], rows=exported) == [1.0] * 6


def test_a_row_without_its_task_is_that_samples_error_not_the_runs(rows):
    pool = RewardPool("reasoning_gym", workers=0, error_reward=-1.0, fn_kwargs={"extract_mode": "auto"})
    batch = [rows[0], {"prompt": "1+1=", "answer": "2"}, {**rows[1], "metadata": {"source_dataset": "no_such_task"},
                                                            "reasoning_gym": None}]
    result = pool.score([rows[0]["answer"], "2", rows[1]["answer"]], ["", "2", ""], rows=batch)
    assert result.rewards == [1.0, -1.0, -1.0]
    assert [e.index for e in result.errors] == [1, 2]
    assert "its task is unknown" in result.errors[0].message and "no_such_task" in result.errors[1].message


def test_the_flows_reward_and_the_verifier_through_the_runtime(rows):
    from flowrl.runtime.rewards import build_reward

    graded = build_reward(RewardPlan("s", "reasoning_gym_score", {"extract": "auto", "on_error": 0.0}, "f.flow:1:1"),
                          None)
    binary = build_reward(RewardPlan("v", "verifier", {"target": "reasoning_gym", "correct": 2.0, "wrong": -1.0},
                                     "f.flow:1:1"), None)
    answers = [r["answer"] for r in rows]
    near = [a + "0" for a in answers]  # holds the oracle's text: partial credit
    assert all(0 < x < 1 for x in graded.score(near, answers, rows=rows).rewards)
    assert graded.correct == 1.0  # what held-out accuracy counts as right
    assert binary.score(near, answers, rows=rows).rewards == [-1.0] * 6
    assert binary.score(answers, answers, rows=rows).rewards == [2.0] * 6
