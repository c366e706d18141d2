"""A served reward model: a tiny scalar-head model built and trained here on preference pairs, scored by
the torch train engine in the ``reward`` role, equals a direct transformers forward.

Tolerance 1e-5: both sides run the same fp32 ops on the same weights; the engine's rows are
right-padded in a batch, which changes no real position's attention (causal, padding masked), so
the only differences are reduction orders inside matmuls of a 128-wide model (~1e-7 relative)
on scores of order 1.
"""

from __future__ import annotations

import json

import pytest
import torch

from flowrl.engines.torch_train import TorchTrainEngine
from flowrl.engines.types import TokenBatch
from flowrl.models.tiny import build_tiny_model
from flowrl.models.reward import last_token_scores, train_reward_model
from flowrl.runtime.reward_model import ModelReward

CHOSEN = ["12+5=17", "40+2=42", "3+3=6", "7+7=14"]
REJECTED = ["12+5=99", "40+2=1", "3+3=33", "7+7=0"]


class Data:
    def __init__(self, tok):
        self.tok, self.pad_id = tok, tok.pad_token_id

    def tokenize(self, texts, *, special=True):
        return [self.tok(t).input_ids for t in texts]


class Engines:
    def __init__(self, engine):
        self.engine = engine

    def forward(self, model, batch, step, **kw):
        return self.engine.forward(batch)


def test_served_scores_equal_a_transformers_forward(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    base = build_tiny_model(tmp_path / "base", seed=0)
    rm_dir = train_reward_model(base, tmp_path / "rm", list(zip(CHOSEN, REJECTED)), steps=25, lr=3e-3)
    tok = AutoTokenizer.from_pretrained(str(rm_dir))
    direct = AutoModelForSequenceClassification.from_pretrained(str(rm_dir), dtype=torch.float32).eval()
    texts = CHOSEN + REJECTED
    with torch.no_grad():
        expected = torch.tensor([float(direct(input_ids=torch.tensor([tok(t).input_ids])).logits[0, 0])
                                 for t in texts])
    assert (expected[:4] > expected[4:]).all()  # it learned the preferences

    engine = TorchTrainEngine(str(rm_dir), role="reward")
    reward = ModelReward("rm", "f.flow:1:1")
    reward.bind(Engines(engine), Data(tok))
    served = torch.tensor(reward.score(texts, [""] * len(texts)).rewards)  # one right-padded batch
    assert torch.allclose(served, expected, atol=1e-5, rtol=0), (served - expected).abs().max()

    ids = [tok(t).input_ids for t in texts]  # token rows, as the score handler passes the rollouts
    width = max(map(len, ids))
    batch = TokenBatch(torch.tensor([r + [0] * (width - len(r)) for r in ids]),
                       torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids]),
                       torch.zeros(len(ids), width), {})
    rows = torch.tensor(reward.score_tokens(batch, 0).rewards)
    assert torch.allclose(rows, expected, atol=1e-5, rtol=0)
    assert torch.equal(last_token_scores(engine.forward(batch)["scores"], batch.attention_mask), rows)


RM_FLOW = """import stdlib.grpo
model policy = tiny(task = "arith")
model rm = tiny_rm(task = "arith", steps = 30, samples = 1, base_accuracy = 0.3)
dataset prompts = jsonl("train.jsonl", eval = "test.jsonl", eval_reward = "math")
reward judge = reward_model(rm)
flow main(steps: int = 2, eval_every: int = 2) {
  grpo(policy, prompts, judge, batch = 4, group = 4, max_tokens = 5, kl = 0.0)
}
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_flow_trains_against_a_reward_model_built_on_preferences(tmp_path):
    """`tiny_rm` built on first use (a short fit), served on its own engine; the held-out split is
    scored by the dataset's `eval_reward` verifier, not by the reward model. ``base_accuracy = 0.3`` is the
    policy's own warm start (the same cache entry), and one sample per prompt: the fit's inputs, not its
    quality, are what this test needs (tests/models/test_reward_start.py covers the fit)."""
    from e2e_kit import make_workdir, shared_ray

    from flowrl.launch import run_file

    work = make_workdir(tmp_path)
    (work / "rm.flow").write_text(RM_FLOW)
    result = run_file(str(work / "rm.flow"), out=str(work / "run"), ray_address=shared_ray())
    logged = [json.loads(line) for line in (result.out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in logged if "eval/reward" in r]
    assert [r["step"] for r in evals] == [0, 2]
    for row in evals:  # the verifier's 1/0: the mean reward is the accuracy
        assert row["eval/accuracy"] == row["eval/reward"] and 0.0 <= row["eval/accuracy"] <= 1.0
    trained = [r for r in result.rows if r["step"] > 0]
    assert [r["policy/version"] for r in trained] == [1, 2]
    assert all(r["reward/std"] > 0 for r in trained)  # the reward model's scores, not the verifier's 1/0
    assert any(not float(r["reward/mean"]).is_integer() for r in trained)


# ---- a reward model reads the policy's token ids only when its tokenizer is the policy's ---------------


class RunData:
    """The run's data service as a reward model reads it: the policy's tokenizer (the flow's), its pad id."""

    def __init__(self, tok):
        self.tokenizer, self.pad_id = tok, tok.pad_token_id

    def tokenize(self, texts, *, special=True):
        return [self.tokenizer(t).input_ids for t in texts]


def _job(policy_tok, prompts, completions, ended):
    """A ScoreJob as the score handler makes it: the policy's token rows (its EOS after an ended completion)."""
    from flowrl.runtime.rewards import ScoreJob

    rows = [policy_tok(p + c).input_ids + ([policy_tok.eos_token_id] if e else [])
            for p, c, e in zip(prompts, completions, ended)]
    return ScoreJob(list(completions), [""] * len(rows), list(prompts), None, TokenBatch.from_rows(rows, 0), 0)


@pytest.fixture(scope="module")
def policy_and_rms(tmp_path_factory):
    """A policy, a reward model on its tokenizer, and one on another tokenizer (the same characters, other ids)."""
    tmp = tmp_path_factory.mktemp("tok")
    policy = build_tiny_model(tmp / "policy", seed=0)
    pairs = list(zip(CHOSEN, REJECTED))
    same = train_reward_model(build_tiny_model(tmp / "same_base", seed=1), tmp / "same", pairs, steps=5)
    other = train_reward_model(build_tiny_model(tmp / "other_base", chars="=-+9876543210", seed=1), tmp / "other",
                               pairs, steps=5)
    return policy, same, other


def test_a_reward_model_with_another_tokenizer_reads_the_text_in_its_own(policy_and_rms):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from flowrl.model_files import same_tokenizer

    policy, _, other = policy_and_rms
    assert not same_tokenizer(policy, other)
    policy_tok, rm_tok = AutoTokenizer.from_pretrained(str(policy)), AutoTokenizer.from_pretrained(str(other))
    prompts, completions, ended = ["12+5=", "40+2=", "3+3="], ["17", "1", "6"], [True, False, True]
    reward = ModelReward("rm", "f.flow:1:1", policy="policy")
    engine = TorchTrainEngine(str(other), role="reward")
    reward.bind(Engines(engine), RunData(policy_tok), {"rm": other, "policy": policy})
    assert reward.retokenizes
    job = _job(policy_tok, prompts, completions, ended)
    served = torch.tensor(reward.score_job(job).rewards)

    direct = AutoModelForSequenceClassification.from_pretrained(str(other), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.tensor([float(direct(input_ids=torch.tensor(
            [rm_tok(p + c).input_ids + ([rm_tok.eos_token_id] if e else [])])).logits[0, 0])
            for p, c, e in zip(prompts, completions, ended)])
    assert torch.allclose(served, expected, atol=1e-5, rtol=0), (served, expected)
    as_given = torch.tensor(reward.score_tokens(job.batch, 0).rewards)  # the policy's ids read as the RM's: garbage
    assert not torch.allclose(as_given, expected, atol=1e-3), (as_given, expected)
    held_out = torch.tensor(reward.score(completions, [""] * 3, prompts).rewards)  # texts: no EOS appended
    assert torch.allclose(held_out[1], expected[1], atol=1e-5, rtol=0)


def test_a_reward_model_on_the_policys_tokenizer_reads_its_token_ids(policy_and_rms):
    from transformers import AutoTokenizer

    policy, same, _ = policy_and_rms
    policy_tok = AutoTokenizer.from_pretrained(str(policy))
    reward = ModelReward("rm", "f.flow:1:1", policy="policy")
    engine = TorchTrainEngine(str(same), role="reward")
    reward.bind(Engines(engine), RunData(policy_tok), {"rm": same, "policy": policy})
    assert not reward.retokenizes and reward.tokenizer is None
    job = _job(policy_tok, ["12+5=", "7+7="], ["17", "0"], [True, True])
    assert reward.score_job(job).rewards == reward.score_tokens(job.batch, 0).rewards
