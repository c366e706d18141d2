"""The algorithm handlers in the runtime, on a compiled DAPO plan with fake services (no Ray, no engine).

* dynamic sampling draws again (fresh prompts, a fresh sampling seed per draw) until it keeps
  ``size`` groups with unequal rewards, or stops at ``max_draws`` with fewer; the kept batch's
  fields, token batch and group ids stay consistent across draws of different widths;
* the update measures the behaviour (rollout engine) vs current (trainer) ratio at every
  staleness and applies TIS / MIS as the options say; without old log-probs the loss does.

Hand-computed values: the fake trainer's log-probs are the rollout's plus 0.1 on every response
token, so every token ratio is ``e^0.1 = 1.10517``.
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowrl.algos.losses import global_denominator
from flowrl.compiler.lower import lower
from flowrl.compiler.pipeline import compile_text
from flowrl.engines.types import Completion, TokenBatch
from flowrl.rewards.pool import RewardResult
from flowrl.runtime.losses import make_loss_fn
from flowrl.runtime.pipeline import run_ops, split_stages
from flowrl.runtime.step import Services, StepContext

ROOT = Path(__file__).resolve().parents[2]
GAP = 0.1
"""The trainer's log-probs minus the rollout engine's, on every response token (nats)."""

FLOW = """import stdlib.dapo
model policy = tiny(task = "arith")
dataset arith = jsonl("{root}/data/arith/train.jsonl")
reward exact = verifier("exact")
flow main(steps: int = 3) {{
  dapo(policy, arith, exact, batch = 4, draw_batch = 4, group = 4, max_tokens = 5, overlong_buffer = 2, {extra})
}}
schedule main on cluster(nodes = 1, gpus_per_node = 1) {{ staleness 2 }}
"""


def _plan(extra: str = "lr = 1e-4"):
    graph = compile_text(FLOW.format(root=ROOT, extra=extra), str(ROOT / "flows" / "dapo_handlers.flow"))
    return lower(graph, {"steps": 3})


class FakeData:
    """Prompt k is "p{k}" with token ids [1, 10 + k]; draws advance one cursor."""

    pad_id = 0

    def __init__(self):
        self.cursor = 0

    def draw(self, op):
        size = int(op.options["size"])
        rows = [{"prompt": f"p{k}", "answer": str(k)} for k in range(self.cursor, self.cursor + size)]
        self.cursor += size
        return rows

    def tokenize(self, texts):
        return [[1, 10 + int(t[1:])] for t in texts]

    def columns(self, dataset):
        return "prompt", "answer"


def varied(k: int) -> bool:
    """Prompt k's group has unequal rewards (one completion right) iff k % 3 == 0."""
    return k % 3 == 0


@dataclass
class FakeEngines:
    """Completions of prompt k: ``1 + k % 4`` tokens each; the first is right ("7...") iff varied(k)."""

    version: int = 4
    trained: int = 5
    seeds: list = field(default_factory=list)
    trains: list = field(default_factory=list)

    def generate(self, model, prompts, spec, step):
        self.seeds.append(spec.seed)
        groups = []
        for ids in prompts:
            k = ids[1] - 10
            r = 1 + k % 4
            texts = ["7" if varied(k) and i == 0 else "0" for i in range(spec.n)]
            groups.append([Completion(tuple(ids), tuple(range(3, 3 + r)), (-1.0,) * r, "length", t + "x" * (r - 1))
                           for t in texts])
        return groups, self.version

    def forward(self, model, batch, step, *, entropy=False, values=False):
        return {"logprobs": batch.extras["rollout_logprobs"] + GAP * batch.response_mask}

    def train(self, model, batch, loss, op, step):
        """One loss evaluation, as a train engine's step makes it (its forward: the rollout's + GAP)."""
        self.trains.append((batch, loss))
        lp = (batch.extras["rollout_logprobs"] + GAP * batch.response_mask).requires_grad_()
        _, metrics = make_loss_fn(loss)({"logprobs": lp}, batch, global_denominator(batch.response_mask))
        return [{k: float(v) for k, v in metrics.items()}]

    def train_version(self, model):
        return self.trained


class FakeReward:
    def score(self, completions, answers, prompts=None, **kw):
        return RewardResult([1.0 if c.startswith("7") else 0.0 for c in completions])


def _ctx(plan, engines=None, data=None) -> StepContext:
    timeline = SimpleNamespace(span=lambda *a: contextlib.nullcontext())
    services = Services(plan, 0, data or FakeData(), engines or FakeEngines(), {"exact": FakeReward()}, {}, None,
                        timeline)
    return StepContext(1, services)


def _produce(plan, **kw) -> StepContext:
    ctx = _ctx(plan, **kw)
    producer, _ = split_stages(plan)
    assert [op.op for op in producer] == ["sample", "generate", "score", "filter_groups"]
    run_ops(producer, ctx)
    return ctx


# ---- dynamic sampling ------------------------------------------------------------------------------------


def test_dynamic_sampling_draws_until_the_batch_is_full():
    plan = _plan("max_draws = 4")
    ctx = _produce(plan)
    kept = ctx.values["dapo.kept"]
    # draws of prompts 0-3, 4-7, 8-11: varied groups 0, 3 | 6 | 9 -> four groups after three draws
    assert kept["answers"] == [a for k in (0, 3, 6, 9) for a in [str(k)] * 4]
    assert ctx.metrics["filter/draws"] == 3 and ctx.metrics["filter/prompts_drawn"] == 12
    assert ctx.metrics["filter/groups_varied"] == 4 and ctx.metrics["filter/groups_kept"] == 4
    assert ctx.metrics["filter/short"] == 0.0 and ctx.metrics["filter/kept_frac"] == pytest.approx(4 / 12)
    assert kept["rewards"].tolist() == [1.0, 0.0, 0.0, 0.0] * 4
    assert kept["group_ids"].tolist() == [g for g in range(4) for _ in range(4)]
    # the token batch: rows of 2 prompt + (1 + k % 4) response tokens, right-padded to the widest draw
    batch = kept.rollouts.batch
    lengths = [1 + k % 4 for k in (0, 3, 6, 9) for _ in range(4)]
    assert batch.input_ids.shape == (16, 2 + 4)
    assert batch.response_mask.sum(1).tolist() == lengths
    assert batch.attention_mask.sum(1).tolist() == [2 + r for r in lengths]
    assert kept["response_mask"] is batch.response_mask and kept["rollout_logprobs"] is batch.extras["rollout_logprobs"]
    assert [len(r) for r in kept["response_ids"]] == lengths and kept.rollouts.texts[4] == "7xxx"
    assert (batch.input_ids[~batch.attention_mask.bool()] == FakeData.pad_id).all()
    # each draw samples with its own seed; the step's other metrics stay the first draw's
    seeds = ctx.services.engines.seeds
    assert len(seeds) == 3 and len(set(seeds)) == 3
    assert ctx.metrics["reward/mean"] == pytest.approx(2 / 16)
    assert ctx.metrics["perf/gen_tokens"] == 4 * sum(1 + k % 4 for k in range(12))


def test_dynamic_sampling_stops_at_max_draws_with_a_smaller_batch():
    ctx = _produce(_plan("max_draws = 2"))
    kept = ctx.values["dapo.kept"]
    assert kept["answers"] == [a for k in (0, 3, 6) for a in [str(k)] * 4]
    assert ctx.metrics["filter/draws"] == 2 and ctx.metrics["filter/short"] == 1.0
    assert kept.rollouts.batch.size == 12 and kept["group_ids"].tolist()[-1] == 2


def test_the_next_step_draws_the_next_prompts():
    data = FakeData()
    plan = _plan("max_draws = 4")
    _produce(plan, data=data)
    again = _produce(plan, data=data)
    assert again.values["dapo.kept"]["answers"][0] == "12"  # prompts 12.. (12 % 3 == 0)


# ---- off-policy statistics and corrections in the update --------------------------------------------------


def _step(plan, engines) -> StepContext:
    ctx = _produce(plan, engines=engines)
    _, consumer = split_stages(plan)
    run_ops([op for op in consumer if op.op != "resync"], ctx)
    return ctx


@pytest.mark.parametrize("extra, weight, clipped, masked", [
    ("tis = 2.0", math.exp(GAP), 0.0, None),     # ratio under the cap: weights are the ratio
    ("tis = 1.05", 1.05, 1.0, None),             # every token's ratio truncated to 1.05
    ("mis = 1.1", 0.0, None, 1.0),               # 1.105 leaves the band [1/1.1, 1.1]: masked
    ("mis = 1.2", math.exp(GAP), None, 0.0),     # inside the band: kept at its ratio
    ("mis = 1.5, is_level = \"sequence\"", None, None, None),  # per row: e^(0.1 |y|), 1.105 .. 1.49
    ("tis = 0.0, auto_correct = false", None, None, None),     # no correction: statistics only
])
def test_the_update_measures_and_corrects_the_behaviour_gap(extra, weight, clipped, masked):
    engines = FakeEngines(version=4, trained=5)  # rollouts one version behind (staleness 2)
    ctx = _step(_plan(f"max_draws = 4, {extra}"), engines)
    m = ctx.metrics
    assert m["staleness/hist/1"] == 16
    assert m["offpolicy/ratio_mean"] == pytest.approx(math.exp(GAP), rel=1e-6)
    assert m["offpolicy/ratio_max"] == pytest.approx(math.exp(GAP), rel=1e-6)
    assert m["offpolicy/ratio_min"] == pytest.approx(math.exp(GAP), rel=1e-6)
    assert m["offpolicy/kl"] == pytest.approx(math.exp(GAP) - 1 - GAP, rel=1e-5)  # k3: r - 1 - log r, r = e^0.1
    (batch, loss), = engines.trains
    assert loss["tis"] == (1.05 if "1.05" in extra else 2.0 if "tis = 2" in extra else 0.0)
    mask = batch.response_mask.bool()
    # tis keeps the old-logprob pass (weights made here, on the driver); with mis alone the plan
    # elides it and the loss measures and weighs on its first forward: the same statistics
    assert ("old_logprobs" in batch.extras) == ("tis = 2" in extra or "tis = 1" in extra)
    if weight is not None:
        assert m["offpolicy/weight_mean"] == pytest.approx(weight, rel=1e-6)
    if weight is not None and "old_logprobs" in batch.extras:
        assert torch.allclose(batch.extras["is_weights"][mask], torch.full((int(mask.sum()),), weight))
    if clipped is not None:
        assert m["offpolicy/clipped_frac"] == pytest.approx(clipped)
    if masked is not None:
        assert m["offpolicy/masked_frac"] == pytest.approx(masked)
    if "sequence" in extra:
        lengths = batch.response_mask.sum(1)
        seq = torch.exp(GAP * lengths)  # 1.105, 1.49 for 1 and 4 tokens: all inside [1/1.5, 1.5]
        assert m["offpolicy/seq_ratio_max"] == pytest.approx(float(seq.max()), rel=1e-6)
        assert m["offpolicy/masked_frac"] == 0.0
    if "auto_correct" in extra:
        assert "is_weights" not in batch.extras and "offpolicy/clipped_frac" not in m


def test_the_behaviour_gap_is_logged_when_both_engines_hold_the_same_weights_too():
    engines = FakeEngines(version=5, trained=5)
    ctx = _step(_plan("max_draws = 4"), engines)
    assert ctx.metrics["staleness/hist/0"] == 16
    assert ctx.metrics["offpolicy/ratio_mean"] == pytest.approx(math.exp(GAP), rel=1e-6)
    assert ctx.metrics["mismatch/abs_max"] == pytest.approx(GAP, rel=1e-5)  # same weights: the engines' gap


def test_without_old_logprobs_the_loss_measures_and_truncates():
    # one row, three response tokens, advantages 1: the elided case's ratio is 1 (old = the forward)
    rollout = torch.tensor([[0.0, -1.0, -1.2, -0.7]])
    lp = (rollout + GAP * torch.tensor([[0.0, 1.0, 1.0, 1.0]])).requires_grad_()
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    mb = TokenBatch(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long), mask,
                    {"advantages": torch.ones(1, 4), "rollout_logprobs": rollout})
    denom = {"tokens": 3.0, "sequences": 1.0}
    loss, metrics = make_loss_fn({"name": "ppo_clip", "tis": 1.05})({"logprobs": lp}, mb, denom)
    assert float(loss.detach()) == pytest.approx(-1.05)  # -A * ratio(1) * min(e^0.1, 1.05), token mean
    assert metrics["offpolicy_ratio_mean"] == pytest.approx(math.exp(GAP), rel=1e-6)
    assert metrics["offpolicy_clipped_frac"] == pytest.approx(1.0)
    loss.backward()
    assert torch.allclose(lp.grad, -1.05 / 3 * mask)  # the weight scales the gradient, detached
    plain, stats = make_loss_fn({"name": "cispo"})({"logprobs": lp.detach().requires_grad_()}, mb, denom)
    assert "offpolicy_ratio_max" in stats and "offpolicy_clipped_frac" not in stats


# ---- two policies: per-owner metric names ------------------------------------------------------------------

TWO = """import stdlib.dapo
model policy = tiny(task = "arith")
model other = tiny(task = "arith")
dataset arith = jsonl("{root}/data/arith/train.jsonl")
reward exact = verifier("exact")
flow main(steps: int = 3) {{
  dapo(policy, arith, exact, batch = 4, draw_batch = 4, group = 4, max_tokens = 5, overlong_buffer = 2, max_draws = 4)
  dapo(other, arith, exact, batch = 4, draw_batch = 4, group = 4, max_tokens = 5, overlong_buffer = 2, max_draws = 4)
}}
schedule main on cluster(nodes = 1, gpus_per_node = 1) {{
  staleness 2
  policy.rollout = hf_generate()
  other.rollout = hf_generate()
}}
"""


@pytest.mark.parametrize("version", [4, 5])  # one version behind; the same weights (the engines' mismatch logged)
def test_two_policies_write_their_metrics_under_their_own_names(version):
    plan = lower(compile_text(TWO.format(root=ROOT), str(ROOT / "flows" / "two_dapo.flow")), {"steps": 3})
    ctx = _ctx(plan, engines=FakeEngines(version=version, trained=5))
    producer, consumer = split_stages(plan)
    run_ops(producer, ctx)
    run_ops([op for op in consumer if op.op != "resync"], ctx)
    m = ctx.metrics
    lag = 5 - version
    for call, model in (("dapo", "policy"), ("dapo#2", "other")):
        assert 0.0 <= m[f"reward/{call}.scores/mean"] <= m[f"reward/{call}.scores/max"] <= 1.0
        assert m[f"reward/{call}.shaped/overlong_penalty"] >= 0.0
        assert m[f"filter/{call}.kept/draws"] == 3 and m[f"filter/{call}.kept/groups_kept"] == 4
        assert f"adv/{call}.adv/abs_mean" in m
        assert m[f"staleness/{model}/hist/{lag}"] == 16
        assert m[f"offpolicy/{model}/ratio_mean"] == pytest.approx(math.exp(GAP), rel=1e-6)
        if version == 5:
            assert m[f"mismatch/{model}/abs_max"] == pytest.approx(GAP, rel=1e-5)
    # no family is written under its plain name, which both would overwrite
    families = ("reward", "filter", "adv", "staleness", "mismatch", "offpolicy")
    plain = sorted(k for k in m if k.split("/")[0] in families and k.split("/")[1] not in
                   {"dapo.scores", "dapo#2.scores", "dapo.shaped", "dapo#2.shaped", "dapo.kept", "dapo#2.kept",
                    "dapo.adv", "dapo#2.adv", "policy", "other"})
    assert plain == [], plain
