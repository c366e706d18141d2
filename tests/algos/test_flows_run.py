"""The new stdlib algorithms run end to end, and off-policy statistics are logged at every step.

Real Ray actors, the torch rollout engine (``hf_generate``: no vLLM start-up) and the torch
trainer on the runtime tests' tiny random-init model. Ray's and the engines' start-up is most
of the cost (minutes on a loaded 2-core machine), so one run trains four policies, each with
its own algorithm, for 3 steps at staleness 4 (steps 1-3 are all generated before step 1
trains, so they train 0, 1 and 2 versions behind):

* DAPO: dynamic sampling with a right/wrong reward that a random policy mostly fails, so
  some draw is repeated; TIS;
* CISPO with two optimiser steps per batch;
* GSPO with sequence-level MIS and two optimiser steps;
* REINFORCE++-baseline with the ``abs`` KL estimator in the loss.

Each policy's ``offpolicy/<model>/*`` statistics (the behaviour-vs-current ratio's mean, max,
min, KL, and the clipped / masked fraction of its correction) are in every step's row, and so
are its ``staleness/<model>/*`` and its score op's ``reward/<op id>/*``.
The handlers' arithmetic is tested without Ray in ``test_runtime_handlers.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

RUNTIME_TESTS = Path(__file__).resolve().parents[1] / "runtime"
sys.path.insert(0, str(RUNTIME_TESTS))

from e2e_kit import make_workdir, shared_ray  # noqa: E402

from flowrl.launch import run_file  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RATIO = ("ratio_mean", "ratio_max", "ratio_min", "kl")
ALGOS = ("dapo", "cispo", "gspo", "reinforce_pp_baseline")
REWARD = Path(__file__).resolve().parent / "algo_rewards.py"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    wd = make_workdir(tmp_path_factory.mktemp("algos"))
    (wd / "algo_rewards.py").write_text(REWARD.read_text())  # the flows' reward module, next to them
    return wd


def _run(workdir: Path, name: str, calls: dict[str, str], staleness: int, steps: int = 2) -> list[dict]:
    """Run one flow training a policy per entry of ``calls`` (stdlib module -> its arguments)."""
    imports = "".join(f"import stdlib.{m} as {m}_algo\n" for m in calls)
    models = "".join(f'model {m}_policy = hf("model")\n' for m in calls)
    body = "\n  ".join(f"{m}_algo.{m}({m}_policy, prompts, r, {args})" for m, args in calls.items())
    rollouts = "\n  ".join(f"{m}_policy.rollout = hf_generate()" for m in calls)
    path = workdir / f"{name}.flow"
    path.write_text(f"""{imports}{models}dataset prompts = jsonl("train.jsonl")
reward r = python_reward("algo_rewards:starts_with_7", workers = 1)
flow main(steps: int = {steps}, eval_every: int = 0) {{
  {body}
}}
schedule main on cluster(nodes = 1, gpus_per_node = 1) {{
  staleness {staleness}
  {rollouts}
}}
""")
    run_file(str(path), out=str(workdir / name), ray_address=shared_ray())
    rows = [json.loads(line) for line in (workdir / name / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if any(k.startswith("offpolicy/") for k in r)]
    assert len(train) == steps, [sorted(r) for r in rows]
    return train


@pytest.fixture(scope="module")
def rows(workdir):
    return _run(workdir, "four", {
        "dapo": "batch = 4, draw_batch = 4, group = 4, max_tokens = 4, overlong_buffer = 2, max_draws = 3, "
                "lr = 3e-3, tis = 2.0, seed = 3",
        "cispo": "batch = 4, group = 4, max_tokens = 6, lr = 3e-3, minibatches = 2",
        "gspo": "batch = 4, group = 4, max_tokens = 6, lr = 3e-3, minibatches = 2, mis = 3.0, "
                "is_level = \"sequence\", seed = 1",
        "reinforce_pp_baseline": "batch = 4, group = 4, max_tokens = 6, lr = 3e-3, kl = 0.01, kl_kind = \"abs\"",
    }, staleness=4, steps=3)


def test_every_step_trains_further_behind(rows):
    for algo in ALGOS:
        hist = f"staleness/{algo}_policy/hist/"
        lags = [sorted(int(k[len(hist):]) for k in r if k.startswith(hist)) for r in rows]
        assert lags == [[0], [1], [2]], algo


def test_each_policy_and_score_op_logs_under_its_own_name(rows):
    """Four policies, four score ops: ``staleness/<model>/*``, ``response/<model>/*``, ``kl/<model>/*`` and
    ``reward/<op id>/*``, never the plain names that all four would overwrite; the one filter op keeps ``filter/*`` (test_dapo_...)."""
    for row in rows:
        assert not [k for k in row if k.startswith(("staleness/hist/", "reward/mean", "offpolicy/ratio", "kl/ref",
                                                     "response/length_mean"))], sorted(row)
        for algo in ALGOS:
            assert 0.0 <= row[f"reward/{algo}.scores/mean"] <= 1.0, (algo, sorted(row))
            assert 0 < row[f"response/{algo}_policy/length_mean"] <= 6, (algo, sorted(row))
        assert row["kl/reinforce_pp_baseline_policy/ref"] >= 0.0  # the one policy with a KL term (k3 >= 0)


def _ratios_ok(row: dict, model: str) -> None:
    for key in RATIO:
        assert f"offpolicy/{model}/{key}" in row, (model, key, sorted(row))
    p = f"offpolicy/{model}/"
    assert 0 < row[p + "ratio_min"] <= row[p + "ratio_mean"] <= row[p + "ratio_max"]


def test_dapo_draws_again_and_corrects_with_tis(rows):
    for row in rows:
        _ratios_ok(row, "dapo_policy")
        assert 0.0 <= row["offpolicy/dapo_policy/clipped_frac"] <= 1.0
        assert "offpolicy/dapo_policy/weight_mean" in row
        assert 1 <= row["filter/draws"] <= 3 and row["filter/prompts_drawn"] == 4 * row["filter/draws"]
        assert row["filter/groups_kept"] == 4 or row["filter/short"] == 1.0
    # a random policy rarely starts with '7': some step drew again (the seed makes it so here)
    assert max(r["filter/draws"] for r in rows) > 1, [r["filter/draws"] for r in rows]


def test_cispo_takes_two_optimiser_steps_with_moving_weights(rows):
    for row in rows:
        _ratios_ok(row, "cispo_policy")
        assert {"train/cispo_policy/pg_loss", "train/cispo_policy/clipfrac"} <= set(row)
    # the second optimiser step sees a moved policy: its ratios are not all 1
    assert any(r["train/cispo_policy/ratio_max"] != 1.0 for r in rows)


def test_gspo_with_sequence_mis(rows):
    for row in rows:
        _ratios_ok(row, "gspo_policy")
        for key in ("seq_ratio_mean", "seq_ratio_max", "masked_frac"):
            assert f"offpolicy/gspo_policy/{key}" in row, key
        assert 0.0 <= row["offpolicy/gspo_policy/masked_frac"] <= 1.0
        assert "train/gspo_policy/seq_ratio_mean" in row


def test_reinforce_pp_baseline_with_the_abs_kl_in_the_loss(rows):
    for row in rows:
        _ratios_ok(row, "reinforce_pp_baseline_policy")
        assert row["train/reinforce_pp_baseline_policy/kl_loss"] >= 0.0
