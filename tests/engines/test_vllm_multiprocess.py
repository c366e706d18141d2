"""VLLMRolloutEngine with the engine core in its own process (vLLM's default on GPUs).

RPC arguments are serialised there, so weight updates travel as one safetensors
blob to FlowrlWorkerExtension instead of as tensors.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import rollout_contract as contract  # noqa: E402
from engine_testkit import completions_batch, make_trainer, max_logprob_gap, train_a_few_steps  # noqa: E402

from flowrl.engines.types import SamplingSpec  # noqa: E402
from flowrl.engines.vllm_engine import VLLMRolloutEngine  # noqa: E402


def _update_and_follow(engine, tiny_model_dir, spec, before):
    """Train a fresh trainer a few steps, push its weights to ``engine``, and check that ``engine``
    now samples other tokens whose log-probs are the trainer's (the weights reached every worker).
    Returns the trainer's weights."""
    trainer = make_trainer(tiny_model_dir)
    train_a_few_steps(trainer)
    weights = list(trainer.named_weights())
    engine.update_weights(weights)
    after = engine.generate(contract.prompts(), spec)
    batch = completions_batch(after)
    assert max_logprob_gap(after, trainer.forward(batch)["logprobs"], batch) < contract.TOL
    assert [g[0].response_ids for g in after] != [g[0].response_ids for g in before]
    return weights


@pytest.mark.long  # make test-long, 75 s; in make test: the tp=2 GRPO run below updates the same engine process every step
def test_weight_update_through_a_separate_engine_process(tiny_model_dir):
    engine = VLLMRolloutEngine(tiny_model_dir, dtype="float32", max_model_len=64, in_process=False)
    try:
        assert not engine._direct_weights
        assert type(engine.llm.llm_engine.engine_core).__name__ != "InprocClient"
        spec = SamplingSpec(temperature=0.0, max_tokens=10)
        before = engine.generate(contract.prompts(), spec)
        batch = completions_batch(before)
        assert max_logprob_gap(before, make_trainer(tiny_model_dir).forward(batch)["logprobs"], batch) < contract.TOL
        _update_and_follow(engine, tiny_model_dir, spec, before)
    finally:
        engine.shutdown()


# ---- tensor parallelism on CPU: vLLM's multiprocessing executor -------------------------------------------


@pytest.mark.long  # make test-long: test_grpo_with_vllm_tp2_on_a_cpu_cluster (make test) runs the same engine
def test_tp2_on_cpu_runs_the_multiprocessing_executor_and_updates_weights_in_place(tiny_model_dir):
    """`tensor_parallel_size = 2` on CPU: two worker processes (gloo between them) whose greedy samples
    carry the unsharded model's log-probs (the trainer's, to fp32 tolerance), and a weight update
    both shards follow, each worker sent only the rows of its shards (the executed reshard plan:
    the ranks' bytes add up to the model once, plus the norms each rank holds whole)."""
    spec = SamplingSpec(temperature=0.0, max_tokens=10)
    engine = VLLMRolloutEngine(tiny_model_dir, dtype="float32", max_model_len=64, tensor_parallel_size=2)
    try:
        assert engine.llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend == "mp"
        assert not engine._direct_weights  # tensors cannot cross to the workers as RPC arguments
        before = engine.generate(contract.prompts(), spec)
        batch = completions_batch(before)
        assert max_logprob_gap(before, make_trainer(tiny_model_dir).forward(batch)["logprobs"], batch) < contract.TOL
        weights = _update_and_follow(engine, tiny_model_dir, spec, before)  # both tp shards hold the new weights
        nbytes = {name: t.numel() * t.element_size() for name, t in weights}
        whole = sum(n for name, n in nbytes.items() if "norm" in name)  # the only tensors not sharded
        sent = engine.delivered_bytes  # file bytes: tensor data + a safetensors header each
        assert len(sent) == 2 and all(n < 0.75 * sum(nbytes.values()) for n in sent), sent
        assert 0 <= sum(sent) - (sum(nbytes.values()) + whole) < 2 * 64 * 1024, (sent, nbytes)
    finally:
        engine.shutdown()


TP2_SCHEDULE = """
schedule main on cluster(nodes = 1, gpus_per_node = 3) {
  pool gen = gpus(gpus = 2)
  pool train = gpus(gpus = 1)
  place policy.rollout on gen
  place policy.train on train
  policy.train = torch(dp = 1)
  policy.rollout = vllm(tp = 2)
}
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_grpo_with_vllm_tp2_on_a_cpu_cluster(tmp_path, monkeypatch):
    """`policy.rollout = vllm(tp = 2)` on `gpu = "cpu"`: `check` accepts it, the driver runs it in a Ray
    actor, and after every resync vLLM's log-probs are the trainer's (the weights reached both shards)."""
    import sys

    pytest.importorskip("ray")
    from flowrl.compiler.pipeline import check_file

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "runtime"))
    from e2e_kit import RUNTIME_DIR, end_shared_ray, make_workdir, write_flow

    from flowrl.launch import run_file

    end_shared_ray()  # a Ray instance of this run's own, whose workers see the PYTHONPATH below
    monkeypatch.setenv("PYTHONPATH", f"{RUNTIME_DIR}:{__import__('os').environ.get('PYTHONPATH', '')}")
    workdir = make_workdir(tmp_path, rows=40, train=32)
    grpo = "grpo(policy, prompts, sevens, batch = 4, group = 4, max_tokens = 6, lr = 3e-3, kl = 0.0, seed = 1)"
    path = write_flow(workdir / "tp2.flow", grpo, 3, TP2_SCHEDULE)
    check_file(str(path))  # accepted on the cpu platform (the catalogue's vllm record has no tp limit there)
    rows = [r for r in run_file(str(path), out=str(workdir / "run")).rows if r["step"] >= 1]
    assert len(rows) == 3
    for row in rows:
        assert row["sync/bytes"] > 0 and row["staleness/hist/0"] == 16, row
        # the executed reshard plan: each tp worker was given its shards, not the model
        ranks = [row["sync/rank_bytes/0/0"], row["sync/rank_bytes/0/1"]]
        assert max(ranks) < 0.75 * row["sync/bytes"] <= row["sync/delivered_bytes"] == sum(ranks), row
        assert row["mismatch/abs_max"] < contract.TOL, row
    placement = __import__("json").loads((workdir / "run" / "placement.json").read_text())
    assert [(r["engine"], r["rank"], r["pool"]) for r in placement if r["engine"] == "policy.rollout"] == \
        [("policy.rollout", 0, "gen")]
