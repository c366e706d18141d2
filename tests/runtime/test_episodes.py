"""Multi-turn episodes without engines: env_step, the continuing generate and `repeat` loops run on
fake services (a scripted sampler, environments in this process), so every token can be checked.

What is checked: each turn continues the same token row (no re-tokenization), observation tokens
have response mask 0 and rollout log-prob 0, the loss's gradient is exactly zero on them, episodes
end on done / max turns / the context limit (flagged truncated), an environment's error ends its
episode only, a loop that stops before its generate leaves the conversation as it was, and the
`env/*` metrics count what happened.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flowrl.compiler.lower import lower
from flowrl.compiler.pipeline import compile_file
from flowrl.engines.types import Completion
from flowrl.runtime.env_pool import EnvOutcome, EnvWorker
from flowrl.runtime.heldout import eval_pass, greedy_eval, play
from flowrl.runtime.losses import make_loss_fn
from flowrl.algos.losses import global_denominator
from flowrl.runtime.pipeline import run_ops, split_stages
from flowrl.runtime.step import Services, StepContext

HERE = Path(__file__).resolve().parent
ENVS = HERE.parent / "envs" / "loop_envs.py"
EOS = 2


class Data:
    pad_id = 0

    def __init__(self, rows):
        self.rows = rows

    def draw(self, op):
        return list(self.rows)

    def columns(self, dataset):
        return "prompt", "answer"

    def tokenize(self, texts, *, special=True):
        return [([1] if special else []) + [10 + ord(c) % 50 for c in t] for t in texts]

    def eval_rows(self, dataset):
        return list(self.rows)


class Engines:
    """Each completion: two tokens (the context's length mod 7, then EOS) with log-probs -0.5, -0.25."""

    def __init__(self):
        self.calls = []
        self.specs = []

    def generate(self, model, prompts, spec, step):
        self.calls.append([list(p) for p in prompts])
        self.specs.append(spec)
        groups = [[Completion(tuple(p), (70 + len(p) % 7, EOS), (-0.5, -0.25), "stop", f"turn{len(p)}")
                   for _ in range(spec.n)] for p in prompts]
        return groups, 0


class LocalPool:
    """The env pool's interface, its worker in this process (no Ray)."""

    def __init__(self, target):
        self.worker = EnvWorker(target, str(ENVS.parent))
        self.closed = []

    def step(self, calls):
        return [EnvOutcome(**{**{"done": True}, **self.worker.step(k, row, turn)}) for k, row, turn in calls]

    def close_episodes(self, keys):
        self.closed += keys
        self.worker.close(keys)


class Events:
    def __init__(self):
        self.env, self.recovered = [], []

    def env_errors(self, op, step, errors):
        self.env += errors

    def env_recovered(self, op, step, recovered):
        self.recovered += recovered


class RecoveringPool(LocalPool):
    """A pool whose worker died under the calls of the first episode and replayed it (as EnvPool does)."""

    def step(self, calls):
        out = super().step(calls)
        out[0].recovered = "its environment worker died (ActorDiedError) during this call; replayed"
        return out


class Timeline:
    def span(self, *a, **k):
        from contextlib import nullcontext
        return nullcontext()


def _plan(tmp_path, env_class, *, turns=3, max_tokens=4, max_len=None):
    shutil.copy(ENVS, tmp_path / "loop_envs.py")
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    (tmp_path / "f.flow").write_text(f"""
model policy = tiny(task = "arith")
dataset d = jsonl("d.jsonl")
env tool = python_env("loop_envs:{env_class}", timeout = 5.0, workers = 1)
reward exact = verifier("math")
flow main() {{
  convo = generate(policy, sample(d, size = 2), n = 2, max_tokens = {max_tokens})
  repeat {turns} until done {{
    obs = env_step(tool, convo)
    convo = generate(policy, obs, max_tokens = {max_tokens})
  }}
  adv = group_advantage(exact(convo), group = 2)
  update(policy, convo, adv, loss = pg())
}}
""")
    plan = lower(compile_file(str(tmp_path / "f.flow")).graph, {})
    if max_len is not None:
        plan = replace(plan, models=tuple(replace(m, facts={**m.facts, "max_len": max_len}) for m in plan.models))
    return plan


def _run(plan, rows, env_class):
    engines, events, pool = Engines(), Events(), LocalPool(f"loop_envs:{env_class}")
    services = Services(plan, 0, Data(rows), engines, {}, {}, events, Timeline(), {"tool": pool})
    ctx = StepContext(3, services)
    ops = [op for op in plan.ops if op.op in ("sample", "generate", "env_step")]
    run_ops(ops, ctx)
    return ctx, engines, events, pool


ROWS = [{"prompt": "12+3=", "answer": "15", "extra": "x"}, {"prompt": "4+4=", "answer": "8", "extra": "y"}]


def test_turns_continue_one_token_row_with_observations_masked(tmp_path):
    plan = _plan(tmp_path, "TwoToolCalls")
    ctx, engines, events, pool = _run(plan, ROWS, "TwoToolCalls")
    convo = ctx.values["convo#2"]
    batch = convo.rollouts.batch
    obs = [10 + ord(c) % 50 for c in "+="]  # "+=" tokenized without special tokens (no BOS mid-row)
    for i in range(4):
        prompt = [1] + [10 + ord(c) % 50 for c in ROWS[i // 2]["prompt"]]
        row, mask, lp = prompt, [0.0] * len(prompt), [0.0] * len(prompt)
        for _ in range(3):  # three model turns: two tool calls answered with "+=", then the last one
            turn = [70 + len(row) % 7, EOS]
            row, mask, lp = row + turn, mask + [1.0, 1.0], lp + [-0.5, -0.25]
            if len(mask) < 2 + len(prompt) + 3 * 2 + 2 * len(obs) - 2:
                row, mask, lp = row + obs, mask + [0.0, 0.0], lp + [0.0, 0.0]
        n = int(batch.attention_mask[i].sum())
        assert batch.input_ids[i, :n].tolist() == row
        assert batch.response_mask[i, :n].tolist() == mask
        assert batch.extras["rollout_logprobs"][i, :n].tolist() == lp
        assert convo["prompt_ids"][i] == prompt and convo["response_ids"][i] == row[len(prompt):]
    # every later turn was generated from the whole row so far, as token ids
    assert [len(p) for p in engines.calls[1]] == [len(p) + 2 + 2 for p in engines.calls[0] for _ in range(2)]
    assert convo.rollouts.texts[0] == f"turn{int(batch.attention_mask[0].sum()) - 2}"  # the last turn's text
    assert convo["done"].tolist() == [True] * 4 and convo["truncated"].tolist() == [False] * 4
    assert convo["rows"][0]["extra"] == "x"  # every field of the dataset row reaches the environment
    assert ctx.values["obs"]["rewards"].tolist() == [1.5] * 4  # 0.25 + 0.25 + 1.0
    m = ctx.metrics
    assert (m["env/calls"], m["env/tool_calls"], m["env/tool_errors"], m["env/errors"]) == (12, 8, 4, 0)
    assert (m["env/turns_mean"], m["loop/repeat1/turns"], m["env/max_turns"]) == (3, 3, 0)
    assert sorted(pool.closed) == sorted(f"3.0/obs/{i}" for i in range(4))


class LastTurnTexts:
    """A reward that records what it scored: 1.0 for the texts listed in ``right``."""

    correct = 1.0

    def __init__(self, right=()):
        self.right, self.seen = set(right), []

    def score(self, texts, answers, prompts=None, rows=None):
        from flowrl.rewards.pool import RewardResult

        self.seen.append(list(texts))
        return RewardResult([1.0 if t in self.right else 0.0 for t in texts])


def test_the_held_out_pass_plays_whole_greedy_episodes_of_its_own(tmp_path):
    plan = _plan(tmp_path, "TwoToolCalls")
    hp = eval_pass(plan)
    assert hp is not None and hp.multi_turn and hp.sample.op == "sample"
    assert [op.op for op in hp.ops] == ["generate", "env_step", "generate"] and hp.score.op == "score"
    engines, pool = Engines(), LocalPool("loop_envs:TwoToolCalls")
    rows = ROWS + [{"prompt": "123+4=", "answer": "127"}]  # three prompt lengths: three last-turn texts
    # The third model turn of a row: prompt (1 + len) + 2 x (turn 2 + "+=" 2) tokens long before it.
    third = [f"turn{1 + len(r['prompt']) + 8}" for r in rows]
    reward = LastTurnTexts(right=third[:2])
    services = Services(plan, 0, Data(rows), engines, {"exact": reward}, {}, Events(), Timeline(), {"tool": pool})
    out = greedy_eval(services, 5)
    assert reward.seen == [third]  # the final turn of every episode, one episode a row
    assert out["eval/accuracy"] == pytest.approx(2 / 3) and out["eval/reward"] == pytest.approx(2 / 3)
    assert (out["eval/env/calls"], out["eval/env/tool_calls"], out["eval/env/turns_mean"]) == (9, 6, 3)
    assert all(spec.temperature == 0.0 and spec.n == 1 for spec in engines.specs) and len(engines.specs) == 3
    assert sorted(pool.closed) == sorted(f"eval5.0/obs/{i}" for i in range(3))  # its own episodes
    # pass@k's sampled episodes: n of them a row from the first turn, each continued alone.
    sampled = play(services, hp, rows, n=2, temperature=0.7, seed=3, step=0)
    assert [len(g) for g in sampled.rewards] == [2, 2, 2]
    assert engines.specs[3].n == 2 and {s.temperature for s in engines.specs[3:]} == {0.7}
    assert [s.n for s in engines.specs[4:]] == [1, 1]


def test_a_single_turn_held_out_pass_runs_the_same_handlers(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    (tmp_path / "f.flow").write_text("""
model policy = tiny(task = "arith")
dataset d = jsonl("d.jsonl")
reward exact = verifier("math")
flow main() {
  convo = generate(policy, sample(d, size = 2), n = 4, max_tokens = 3)
  adv = group_advantage(exact(convo), group = 4)
  update(policy, convo, adv, loss = pg())
}
""")
    plan = lower(compile_file(str(tmp_path / "f.flow")).graph, {})
    hp = eval_pass(plan)
    assert hp is not None and not hp.multi_turn and [op.op for op in hp.ops] == ["generate"]
    engines, rows = Engines(), ROWS + [{"prompt": "123+4=", "answer": "127"}]
    texts = [f"turn{1 + len(r['prompt'])}" for r in rows]  # one turn from each prompt
    reward = LastTurnTexts(right=texts[:1])
    services = Services(plan, 0, Data(rows), engines, {"exact": reward}, {}, Events(), Timeline(), {})
    out = greedy_eval(services, 2)
    assert reward.seen == [texts] and out["eval/accuracy"] == pytest.approx(1 / 3)
    assert [(s.n, s.temperature, s.max_tokens) for s in engines.specs] == [(1, 0.0, 3)]
    assert not [k for k in out if k.startswith("eval/env/")]
    sampled = play(services, hp, rows, n=3, temperature=0.9, seed=1, step=0)
    assert [len(g) for g in sampled.rewards] == [3, 3, 3] and engines.specs[1].n == 3


class ScoresOnly(LastTurnTexts):
    """A reward model's scores: no value counts as right."""

    correct = None


def test_a_reward_without_a_right_value_reports_no_accuracy_unless_the_dataset_names_a_verifier(tmp_path):
    rows = ROWS + [{"prompt": "123+4=", "answer": "127"}]
    texts = [f"turn{1 + len(r['prompt'])}" for r in rows]  # what the fake engine answers
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    (tmp_path / "test.jsonl").write_text(json.dumps({"prompt": "1+2=", "answer": "3"}) + "\n")
    flow = """
model policy = tiny(task = "arith")
dataset d = jsonl("d.jsonl", eval = "test.jsonl"EVAL)
reward rm = python_reward("r:score")
flow main() {
  convo = generate(policy, sample(d, size = 2), n = 4, max_tokens = 3)
  adv = group_advantage(rm(convo), group = 4)
  update(policy, convo, adv, loss = pg())
}
"""
    (tmp_path / "r.py").write_text("def score(completions, answers):\n    return [0.0] * len(completions)\n")
    for eval_reward, accuracy in (("", None), ('"exact"', 1 / 3)):
        (tmp_path / "f.flow").write_text(flow.replace("EVAL", f", eval_reward = {eval_reward}" if eval_reward else ""))
        plan = lower(compile_file(str(tmp_path / "f.flow")).graph, {})
        reward = ScoresOnly(right=texts)  # it would call every completion right, were it asked
        eval_rows = [{**r, "answer": t if i == 0 else "0"} for i, (r, t) in enumerate(zip(rows, texts))]
        services = Services(plan, 0, Data(eval_rows), Engines(), {"rm": reward}, {}, Events(), Timeline(), {})
        out = greedy_eval(services, 2)
        if accuracy is None:  # the flow's reward scores; nothing counts as right
            assert reward.seen == [texts] and "eval/accuracy" not in out and out["eval/reward"] == 1.0
        else:  # the dataset's verifier scores, the reward model is not asked
            assert reward.seen == [] and out["eval/accuracy"] == pytest.approx(accuracy)
            assert out["eval/reward"] == pytest.approx(accuracy)


def test_a_flow_without_a_policy_update_has_no_held_out_pass(tmp_path):
    plan = _plan(tmp_path, "TwoToolCalls")
    assert eval_pass(replace(plan, ops=tuple(op for op in plan.ops if op.op != "update"))) is None


def test_gradient_is_zero_on_observation_tokens(tmp_path):
    plan = _plan(tmp_path, "TwoToolCalls")
    ctx, *_ = _run(plan, ROWS, "TwoToolCalls")
    batch = ctx.values["convo#2"].rollouts.batch
    mask = batch.response_mask
    lp = batch.extras["rollout_logprobs"].clone().requires_grad_(True)
    extras = {**batch.extras, "advantages": torch.ones_like(mask), "ref_logprobs": torch.zeros_like(mask)}
    mb = replace(batch, extras=extras)
    loss, _ = make_loss_fn({"name": "ppo_clip", "kl": 0.5})({"logprobs": lp}, mb, global_denominator(mask))
    loss.backward()
    observation = (batch.attention_mask == 1) & (mask == 0)
    assert observation.sum() > 0 and bool((lp.grad[observation] == 0).all())
    assert bool((lp.grad[mask == 1] != 0).all())


def test_an_environment_error_ends_only_its_episode(tmp_path):
    plan = _plan(tmp_path, "TwoToolCalls")
    rows = [{"prompt": "CRASH", "answer": "0"}, ROWS[1]]
    ctx, engines, events, _ = _run(plan, rows, "TwoToolCalls")
    convo = ctx.values["convo#2"]
    turns = [int(m.sum()) // 2 for m in convo.rollouts.batch.response_mask]
    assert turns == [1, 1, 3, 3]  # the crashed episodes keep their first turn and stop
    assert [i for i, _ in events.env] == [0, 1] and "ValueError: the tool broke" in events.env[0][1]
    assert ctx.metrics["env/errors"] == 2 and convo["done"].tolist() == [True] * 4


def test_episodes_a_fresh_worker_replayed_go_on_and_are_reported(tmp_path):
    plan = _plan(tmp_path, "TwoToolCalls")
    engines, events, pool = Engines(), Events(), RecoveringPool("loop_envs:TwoToolCalls")
    services = Services(plan, 0, Data(ROWS), engines, {}, {}, events, Timeline(), {"tool": pool})
    ctx = StepContext(3, services)
    run_ops([op for op in plan.ops if op.op in ("sample", "generate", "env_step")], ctx)
    assert ctx.metrics["env/recovered"] == 3 and ctx.metrics["env/errors"] == 0  # one per env_step call
    assert [i for i, _ in events.recovered] == [0, 0, 0] and "replayed" in events.recovered[0][1]
    assert ctx.values["convo#2"]["done"].tolist() == [True] * 4  # every episode played to its end


def test_episodes_without_room_for_a_turn_end_truncated(tmp_path):
    # prompt (1 + 5 tokens) + turn (2) + "+=" (2) = 10; a next turn needs 4 more: 14 > 12
    plan = _plan(tmp_path, "TwoToolCalls", max_len=12)
    ctx, engines, *_ = _run(plan, ROWS[:1] * 2, "TwoToolCalls")
    convo = ctx.values["convo#2"]
    assert convo["truncated"].tolist() == [True] * 4 and convo["done"].tolist() == [True] * 4
    assert len(engines.calls) == 1 and ctx.metrics["env/truncated"] == 4


def test_max_turns_leaves_episodes_unfinished(tmp_path):
    plan = _plan(tmp_path, "TwoToolCalls", turns=1)
    ctx, *_ = _run(plan, ROWS, "TwoToolCalls")
    assert ctx.values["convo#2"]["done"].tolist() == [False] * 4
    assert ctx.metrics["env/max_turns"] == 4 and ctx.metrics["loop/repeat1/turns"] == 1


def test_a_loop_that_stops_before_its_generate_keeps_the_conversation(tmp_path):
    plan = _plan(tmp_path, "DoneAtOnce")
    ctx, engines, *_ = _run(plan, ROWS, "DoneAtOnce")
    assert len(engines.calls) == 1
    assert ctx.values["convo#2"].rollouts is ctx.values["convo"].rollouts  # the conversation from before the loop
    assert ctx.values["obs"]["rewards"].tolist() == [0.5] * 4
    # it learns that its episodes are over, and the environment's rewards (what agentic_env trains on)
    assert ctx.values["convo#2"]["rewards"].tolist() == [0.5] * 4
    assert [bool(d) for d in ctx.values["convo#2"]["done"]] == [True] * 4


def test_a_continuation_of_several_completions_is_refused_by_check(tmp_path):
    from flowrl.diagnostics import FlowError

    _plan(tmp_path, "TwoToolCalls")
    text = (tmp_path / "f.flow").read_text().replace("convo = generate(policy, obs, max_tokens = 4)",
                                                     "convo = generate(policy, obs, n = 2)")
    (tmp_path / "g.flow").write_text(text)
    with pytest.raises(FlowError, match="E219"):
        compile_file(str(tmp_path / "g.flow"))


def test_the_loop_runs_in_the_consumer_stage(tmp_path):
    producer, consumer = split_stages(_plan(tmp_path, "TwoToolCalls"))
    assert [op.id for op in producer] == [p for p in ("sample", "convo") if any(o.id == p for o in producer)]
    assert {"obs", "convo#2"} <= {op.id for op in consumer}
