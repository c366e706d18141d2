"""One small handler per step op: ``HANDLERS[OPS[op.op].handler](op, ctx) -> StepValue``.

A handler reads its inputs' values with ``ctx.input(op, arg)``, calls the run through
``ctx.services`` (:class:`~flowrl.runtime.step.Services`: data, engines, rewards...) or
computes driver-side math, and returns the fields its op produces as a
:class:`~flowrl.runtime.step.StepValue` (``generate`` adds a
:class:`~flowrl.runtime.step.Rollouts` record: the padded batch, the texts, the model).
Metrics go to ``ctx.metrics``. No handler knows about another.

:data:`HANDLERS` is keyed by the catalogue's handler names (``OpSpec.handler``); each
handler is the function of that name, so the table and the catalogue pair by name
(``tests/catalog/test_pairing.py``). An op whose record names no handler here is refused
by :func:`handler_of` before any engine starts.

>>> {'sample', 'generate', 'filter_groups', 'update'} <= set(HANDLERS)
True
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import replace
from typing import Callable

import numpy as np
import torch

from flowrl.algos import advantages as A
from flowrl.algos.filtering import dynamic_sample
from flowrl.algos.kl import kl_k3, kl_penalty_in_reward
from flowrl.algos.mismatch import importance_correction, mismatch_metrics, routing_metrics
from flowrl.algos.shaping import overlong_penalty as overlong_shaping
from flowrl.catalog.ops import OPS, ROUTES, OpKind
from flowrl.engines.types import SamplingSpec, TokenBatch
from flowrl.plan import OpPlan
from flowrl.runtime.agents import agent_rollout
from flowrl.runtime.episodes import continue_episodes, env_step, response_length_name
from flowrl.runtime.errors import RuntimeFlowError
from flowrl.runtime.losses import loss_record
from flowrl.runtime.metric_names import metric_name, owned_metrics
from flowrl.runtime.nonfinite import apply_nan_policy
from flowrl.runtime.redraw import gather_rows, replay_ops
from flowrl.runtime.rewards import ScoreJob, score_rollouts
from flowrl.runtime.step import Rollouts, StepContext, StepValue, check_fields, op_seed

Handler = Callable[[OpPlan, StepContext], StepValue]


def _rollouts(op: OpPlan, value: StepValue, arg: str = "rollouts") -> Rollouts:
    """The rollouts record of ``op``'s argument ``arg`` (a ``generate``'s value)."""
    if value.rollouts is None:
        raise RuntimeFlowError(f"{op.origin}: `{op.id}` reads token rollouts from `{op.inputs[arg]}`, which is not "
                               "a generate (nor passes one through); hint: pass the value of generate(...)")
    return value.rollouts


# ---- data ---------------------------------------------------------------------------------


def sample(op: OpPlan, ctx: StepContext) -> StepValue:
    """The step's prompts: text, answers and token ids of the next ``size`` dataset rows."""
    return prompt_value(ctx.services.data, op.inputs["dataset"], ctx.services.data.draw(op))


def prompt_value(data, dataset: str, rows: list[dict]) -> StepValue:
    """The value a ``sample`` of ``dataset`` gives for ``rows``: prompt text, answers, token ids, rows."""
    prompt, answer = data.columns(dataset)
    prompts = [r[prompt] for r in rows]
    return StepValue({"prompt_text": prompts, "answers": [str(r[answer]) for r in rows],
                      "prompt_ids": data.tokenize(prompts), "rows": [dict(r) for r in rows]})


def _sampling_spec(op: OpPlan, ctx: StepContext) -> SamplingSpec:
    o = op.options
    return SamplingSpec(n=int(o["n"]), temperature=float(o["temperature"]), top_p=float(o["top_p"]),
                        top_k=int(o["top_k"]), max_tokens=int(o["max_tokens"]), stop=tuple(o.get("stop") or ()),
                        routes=ROUTES in op.fields,  # an op replays them (compiler: check_routing)
                        seed=op_seed(ctx.services.seed + int(o.get("seed", 0)), ctx.step,
                                     f"{op.id}/draw{ctx.draw}" if ctx.draw else op.id))


def _per_prompt(src: dict, count: int) -> list[dict]:
    """``count`` dicts of the per-prompt fields of ``src`` (lists with one item per prompt)."""
    keys = [k for k, v in src.items() if isinstance(v, list) and len(v) == count]
    return [{k: src[k][j] for k in keys} for j in range(count)]


def _generate_whole(op: OpPlan, ctx: StepContext, src: dict, spec: SamplingSpec) -> tuple[list, list, list]:
    """Every prompt to completion in one call: (completion groups, version per group, fields per group)."""
    groups, version = ctx.services.engines.generate(op.model, src["prompt_ids"], spec, ctx.step)
    tokens = sum(len(c.response_ids) for g in groups for c in g)
    ctx.metrics["perf/gen_tokens"] = ctx.metrics.get("perf/gen_tokens", 0) + tokens
    return groups, [version] * len(groups), _per_prompt(src, len(groups))


def _generate_partial(op: OpPlan, ctx: StepContext, src: dict, spec: SamplingSpec) -> tuple[list, list, list]:
    """Over-provisioned generation through the op's :class:`~flowrl.runtime.partial.PartialRollout` buffer."""
    svc = ctx.services
    buffer = svc.partial[op.id]
    source = next((p for p in svc.plan.ops if p.id == op.inputs["prompts"]), None)
    if source is None or source.kind != OpKind.SAMPLE:
        raise RuntimeFlowError(f"{op.origin}: partial_rollout draws extra prompts from `sample(...)`, but "
                               f"`{op.id}` takes its prompts from `{op.inputs['prompts']}`; hint: pass "
                               "sample(...) straight to generate, or remove partial_rollout from the schedule")

    def prompts_of(fields: dict) -> list:
        return [(p["prompt_ids"], p) for p in _per_prompt(fields, len(fields["prompt_ids"]))]

    def draw(prompts: list, max_tokens: int, index: int):
        # One request per unfinished completion (n = 1); the seed names the step, round and chunk.
        seed = op_seed(svc.seed + int(op.options.get("seed", 0)), ctx.step, f"{op.id}/round{index}/{max_tokens}")
        groups, version = svc.engines.generate(op.model, prompts, replace(spec, n=1, max_tokens=max_tokens, seed=seed),
                                               ctx.step)
        return [g[0] for g in groups], version

    result = buffer.run(ctx.step, prompts_of(src), spec.n, spec.max_tokens,
                        lambda: prompts_of(sample(source, ctx).fields), draw)
    ctx.metrics.update({k: v for k, v in result.metrics.items() if k != "partial/gen_tokens"})
    ctx.metrics["perf/gen_tokens"] = ctx.metrics.get("perf/gen_tokens", 0) + result.metrics["partial/gen_tokens"]
    return ([g.completions() for g in result.groups], [g.version for g in result.groups],
            [g.fields for g in result.groups])


def generate(op: OpPlan, ctx: StepContext) -> StepValue:
    """``n`` completions per prompt; with ``partial_rollout`` the groups may come from earlier steps.

    Fields per completion (``G`` groups x ``n``): ``response_ids``, ``response_mask`` /
    ``rollout_logprobs`` ``[G*n, T]``, ``group_ids`` ``[G*n]``, ``version`` (the rollout version
    of the weights that started each completion), and every per-prompt input field repeated n
    times; the :class:`~flowrl.runtime.step.Rollouts` record holds the padded batch and texts.
    """
    if "done" in ctx.input(op, "prompts"):  # an env_step's value: the next turn of each conversation
        return continue_episodes(op, ctx, ctx.input(op, "prompts"), generate)
    src = ctx.input(op, "prompts").fields
    spec = _sampling_spec(op, ctx)
    produce = _generate_partial if op.id in ctx.services.partial else _generate_whole
    groups, versions, fields = produce(op, ctx, src, spec)
    completions = [c for group in groups for c in group]
    n = spec.n
    batch = TokenBatch.from_completions(completions, ctx.services.data.pad_id)
    tokens = sum(len(c.response_ids) for c in completions)
    ctx.metrics[response_length_name(op, ctx.services.plan)] = tokens / max(len(completions), 1)
    out = {
        "prompt_ids": [list(c.prompt_ids) for c in completions],
        "response_ids": [list(c.response_ids) for c in completions],
        "response_mask": batch.response_mask,
        "rollout_logprobs": batch.extras["rollout_logprobs"],
        "group_ids": torch.arange(len(groups)).repeat_interleave(n),
        "version": [v for v in versions for _ in range(n)],
    }
    if ROUTES in batch.extras:
        out[ROUTES] = batch.extras[ROUTES]
    for key in (fields[0] if fields else {}):  # passthrough: per-prompt fields repeat for each of the n completions
        if key not in out:
            out[key] = [f[key] for f in fields for _ in range(n)]
    return StepValue(out, Rollouts(op.model, batch, tuple(c.text for c in completions)))


def score(op: OpPlan, ctx: StepContext) -> StepValue:
    """The reward of every completion (a user's exception costs one sample its reward, reported)."""
    roll = ctx.input(op, "rollouts")
    rollouts = _rollouts(op, roll)
    texts = list(rollouts.texts)
    result = score_rollouts(ctx.services.rewards[op.inputs["reward"]],
                            ScoreJob(texts, roll.get("answers") or [""] * len(texts), roll.get("prompt_text"),
                                     roll.get("rows"), rollouts.batch, ctx.step))
    r = torch.tensor(result.rewards, dtype=torch.float32)
    stats = {"reward/mean": float(r.mean()), "reward/min": float(r.min()), "reward/max": float(r.max()),
             "reward/std": float(r.std(unbiased=False))}  # population std: observe.reward_band
    for name, scores in result.parts.items():  # a weighted_sum's rewards, each unweighted
        stats[f"reward/part/{name}/mean"] = sum(scores) / max(len(scores), 1)
    if result.errors:
        stats["reward/errors"] = len(result.errors)
        ctx.services.events.reward_errors(op, ctx.step, result.errors)
    if result.output:  # what the reward function printed: to events.log, redacted, never the terminal
        ctx.services.events.reward_output(op, ctx.step, result.output)
    if result.recovered:  # a worker died under them and a fresh one scored them: nothing lost, said
        stats["reward/recovered"] = len(result.recovered)
        ctx.services.events.reward_recovered(op, ctx.step, result.recovered)
    ctx.metrics.update(owned_metrics(stats, op.id, _same_ops(op, ctx)))  # reward/<op id>/* when several
    return StepValue({"rewards": r})


def filter_groups(op: OpPlan, ctx: StepContext) -> StepValue:
    """DAPO's dynamic sampling: keep the groups whose rewards differ; while fewer than ``size`` are
    kept, draw again (re-run the ops before this one with the next prompts) up to ``max_draws``.

    The value is the kept rows of the rollouts (every field, and the token batch) with their
    ``rewards``; ``group_ids`` number the kept groups 0.. in order. ``filter/*`` metrics say how
    many draws and prompts it took (:func:`~flowrl.algos.filtering.dynamic_sample`;
    ``filter/<op id>/*`` when the plan has several such ops); the
    ``reward/*`` metrics stay those of the first draw (the policy's, before filtering) and
    ``perf/gen_tokens`` counts every draw's tokens.
    """
    group = int(op.options["group"])
    replay = replay_ops(ctx.services.plan, op)

    def draw(k: int) -> StepContext:
        if k == 0:
            return ctx
        again = StepContext(ctx.step, ctx.services, draw=k)
        for p in replay:
            value = handler_of(p)(p, again)
            check_fields(p, value)
            again.values[p.id] = value
        ctx.metrics["perf/gen_tokens"] = ctx.metrics.get("perf/gen_tokens", 0) + again.metrics.get("perf/gen_tokens", 0)
        return again

    kept, metrics = dynamic_sample(draw, lambda c: c.input(op, "scores")["rewards"], group,
                                   int(op.options["size"]), int(op.options["max_draws"]))
    ctx.metrics.update(owned_metrics(metrics, op.id, _same_ops(op, ctx)))
    pad_id = ctx.services.data.pad_id
    out = gather_rows([(c.input(op, "rollouts"), rows) for c, rows in kept], pad_id)
    rewards = gather_rows([(StepValue({"rewards": c.input(op, "scores")["rewards"]}), rows) for c, rows in kept],
                          pad_id)["rewards"]
    fields = {**out.fields, "rewards": rewards}
    if "group_ids" in fields:
        fields["group_ids"] = torch.arange(len(rewards) // group).repeat_interleave(group)
    return StepValue(fields, out.rollouts)


# ---- engines ----------------------------------------------------------------------------------


def logprobs(op: OpPlan, ctx: StepContext) -> StepValue:
    """Per-token log-probs (and entropy) of the rollouts under ``op.model``'s train engine."""
    roll = ctx.input(op, "rollouts")
    rollouts = _rollouts(op, roll)
    engines = ctx.services.engines
    entropy = bool(op.options.get("entropy", False))
    batch = _routed(op, rollouts.batch)
    # adapters "off": a LoRA policy's frozen reference, its base, on the policy's engine (share_base_weights)
    base = op.options.get("adapters") == "off"
    out = engines.forward(op.model, batch, ctx.step, entropy=entropy, **({"adapters": False} if base else {}))
    lp = out["logprobs"]
    if not base and rollouts.model == op.model and all(v == engines.train_version(op.model) for v in roll["version"]):
        # Same weights on both engines: any gap is the train/inference mismatch.
        m = mismatch_metrics(lp, roll["rollout_logprobs"], roll["response_mask"])
        if "routes_differ" in out:  # replayed routes: how many the trainer's router would have changed
            m.update(routing_metrics(out["routes_differ"], batch.extras[ROUTES], batch.attention_mask))
        ctx.metrics.update({_per_policy(k, op, ctx): float(v) for k, v in m.items()})
    fields = {"logprobs": lp}
    if entropy:
        fields["entropy"] = out["entropy"]
    return StepValue(fields)


def _routed(op: OpPlan, batch: TokenBatch) -> TokenBatch:
    """``batch`` as ``op``'s ``routing`` option wants it: with the rollout engine's routes
    (``replay``: the compiler made the generate record them) or without (``native``)."""
    replay = op.options.get("routing", "native") == "replay"
    if replay and ROUTES not in batch.extras:
        raise RuntimeFlowError(f"{op.origin}: `{op.id}` replays routes, but its rollouts carry none; "
                               "the compiler marks the generate that records them (check_routing)")
    if replay or ROUTES not in batch.extras:
        return batch
    return TokenBatch(batch.input_ids, batch.attention_mask, batch.response_mask,
                      {k: v for k, v in batch.extras.items() if k != ROUTES})


def values(op: OpPlan, ctx: StepContext) -> StepValue:
    """Per-token values of the rollouts under a critic."""
    rollouts = _rollouts(op, ctx.input(op, "rollouts"))
    return StepValue({"values": ctx.services.engines.forward(op.model, rollouts.batch, ctx.step, values=True)["values"]})


def update(op: OpPlan, ctx: StepContext) -> StepValue:
    """One optimisation step of ``op.model`` with the loss its ``loss`` option names.

    The loss's catalogue record says which field of ``targets`` it trains on (``advantages``
    or ``returns``) and which field of ``old`` it compares against (``logprobs`` or ``values``);
    they reach the train engine as ``extras[field]`` and ``extras["old_" + field]``.
    """
    roll = ctx.input(op, "rollouts")
    rollouts = _rollouts(op, roll)
    batch = _routed(op, rollouts.batch)
    mask = batch.response_mask
    loss = dict(op.options["loss"])
    record = loss_record(loss, op.origin)
    correction = {"tis": float(op.options.get("tis", 0.0)), "mis": float(op.options.get("mis", 0.0)),
                  "mis_low": float(op.options.get("mis_low", 0.0)), "is_level": op.options.get("is_level", "token")}
    loss.update(kl=float(op.options.get("kl", 0.0)), kl_kind=op.options.get("kl_kind", "k3"),
                entropy=float(op.options.get("entropy", 0.0)), **correction)
    extras = dict(batch.extras)
    target = ctx.input(op, "targets")[record.needs_targets]
    extras[record.needs_targets] = A.broadcast_to_tokens(target, mask) if target.dim() == 1 else target
    old = ctx.input(op, "old") if "old" in op.inputs else StepValue()
    if record.needs_old is not None and record.needs_old in old:
        extras[f"old_{record.needs_old}"] = old[record.needs_old]
    if "ref_logprobs" in op.inputs:
        ref = ctx.input(op, "ref_logprobs")["logprobs"]
        extras["ref_logprobs"] = ref
        if "old_logprobs" in extras:
            ctx.metrics[_per_policy("kl_ref", op, ctx)] = float(A.masked_mean(kl_k3(extras["old_logprobs"], ref), mask))
    engines = ctx.services.engines
    trained = engines.train_version(op.model)
    lags = torch.tensor([trained - v for v in roll["version"]]) if op.model == rollouts.model \
        else torch.zeros(len(roll["version"]), dtype=torch.long)
    if op.model == rollouts.model:  # a critic's (or a student's) lags are 0 by construction: not measured
        for lag, count in sorted(Counter(lags.tolist()).items()):
            # Versions behind the weights being trained: 0 when synchronous, at most the plan's
            # max_version_lag = (staleness - 1) + (every - 1) of the model's resync.
            ctx.metrics[_per_policy(f"staleness_hist/{lag}", op, ctx)] = count
    too_old = lags > max_version_lag(ctx.services.plan)
    if bool(too_old.any()):  # the versioned buffer's filter: such samples carry no loss
        mask = mask * (~too_old).to(mask.dtype).unsqueeze(-1)
        ctx.metrics[_per_policy("staleness_dropped", op, ctx)] = int(too_old.sum())
    if "old_logprobs" in extras and "rollout_logprobs" in extras:
        # Behaviour (the rollout engine's weights, maybe versions behind) vs current (the trainer's
        # old_logprobs): measured at every staleness; tis / mis weights go to the loss. Without
        # old_logprobs the loss measures and corrects on its first forward (flowrl.runtime.losses).
        weights, stats = importance_correction(extras["old_logprobs"], extras["rollout_logprobs"], mask,
                                               tis=correction["tis"], mis=correction["mis"],
                                               mis_low=correction["mis_low"], level=correction["is_level"])
        ctx.metrics.update({_per_policy(k, op, ctx): v for k, v in stats.items()})
        if weights is not None:
            extras["is_weights"] = weights
    full = TokenBatch(batch.input_ids, batch.attention_mask, mask, extras)
    stats = engines.train(op.model, full, loss, op, ctx.step)
    ctx.metrics.update(apply_nan_policy(op, ctx.step, stats))  # on_nan: count skipped steps, or stop
    same_weights = not bool(lags.any())
    for key in sorted({k for s in stats for k in s}):
        if key.startswith(("mismatch_", "routing_")) and not same_weights:
            continue  # rollout and trainer weights differ (a skipped resync): not the engines' mismatch
        vals = [float(s[key]) for s in stats if key in s]
        if key.startswith("offpolicy_"):  # measured in the loss (no old_logprobs): one optimiser step
            ctx.metrics[_per_policy(key, op, ctx)] = float(max(vals) if key.endswith("_max") else
                                                   min(vals) if key.endswith("_min") else np.mean(vals))
        elif key.startswith(("mismatch_", "routing_")):  # measured in the loss when the plan elided the
            ctx.metrics[_per_policy(key, op, ctx)] = float(np.mean(vals))  # old-logprob pass (elide_logprobs)
        else:
            ctx.metrics[_per_policy(key, op, ctx) if key == "kl_ref" else f"train/{op.model}/{key}"] = float(np.mean(vals))
    return StepValue()


_PER_POLICY = ("offpolicy", "mismatch", "staleness", "kl", "routing")
"""Families measured per trained policy: its behaviour gap, its engines' mismatch, its samples' lags,
its divergence from the reference, its replayed routes."""


def _per_policy(key: str, op: OpPlan, ctx: StepContext, model: str | None = None) -> str:
    """``offpolicy_ratio_mean`` (a statistic of :func:`~flowrl.algos.mismatch.importance_correction`,
    or of :func:`~flowrl.algos.mismatch.mismatch_metrics`, or the update's ``staleness_*``) ->
    ``offpolicy/ratio_mean``, or ``offpolicy/<model>/ratio_mean`` when the plan trains several
    policies (:func:`~flowrl.runtime.metric_names.metric_name`). ``model``: the policy measured, when
    it is not ``op``'s own model (an advantage op's: the model of its rollouts)."""
    family, _, rest = key.partition("_")
    if family not in _PER_POLICY:
        raise RuntimeFlowError(f"{op.origin}: `{key}` is not a per-policy metric ({', '.join(_PER_POLICY)})")
    policies = {o.model for o in ctx.services.plan.ops
                if o.kind == OpKind.UPDATE and loss_record(o.options["loss"], o.origin).model_role == "trainable"}
    return metric_name(family, rest, model or op.model, policies)


def _same_ops(op: OpPlan, ctx: StepContext) -> list[str]:
    """The ids of the plan's ops that run the same catalogue op as ``op`` (so write the same metrics)."""
    return [o.id for o in ctx.services.plan.ops if o.op == op.op]


def max_version_lag(plan) -> int:
    """How many versions behind the trained weights a sample may be: the staleness bound,
    plus ``every - 1`` when the weights reach the rollout engine only every N updates."""
    if plan.pipeline is not None:
        return int(plan.pipeline.max_version_lag)
    return plan.staleness - 1


def resync(op: OpPlan, ctx: StepContext) -> StepValue:
    """The trainer's weights to the rollout engine, when the resync is due (``every``)."""
    ctx.services.engines.resync(op.id, ctx.step, ctx.metrics)
    return StepValue()


# ---- driver-side math -----------------------------------------------------------------------


def _advantage(fn: Handler) -> Handler:
    """An advantage handler, recording ``adv/abs_mean`` of the advantages it computes
    (``adv/<op id>/abs_mean`` when the plan has several advantage ops)."""
    @functools.wraps(fn)
    def handler(op: OpPlan, ctx: StepContext) -> StepValue:
        out = fn(op, ctx)
        adv = out.get("advantages")
        if adv is not None:
            producers = [o.id for o in ctx.services.plan.ops if "advantages" in o.fields]
            ctx.metrics[metric_name("adv", "abs_mean", op.id, producers)] = float(adv.abs().mean())
        return out
    return handler


def _rewards(op: OpPlan, ctx: StepContext) -> torch.Tensor:
    return ctx.input(op, "scores")["rewards"]


def _token_rewards(scores: StepValue, mask: torch.Tensor) -> torch.Tensor:
    if "token_rewards" in scores:
        return scores["token_rewards"]
    return A.sequence_reward_to_tokens(scores["rewards"], mask)


@_advantage
def group_advantage(op: OpPlan, ctx: StepContext) -> StepValue:
    """GRPO: each reward against its group's mean (and std)."""
    return StepValue({"advantages": A.group_advantages(_rewards(op, ctx), int(op.options["group"]),
                                                       normalize_std=bool(op.options["normalize_std"]),
                                                       eps=float(op.options["eps"]))})


@_advantage
def rloo(op: OpPlan, ctx: StepContext) -> StepValue:
    """RLOO: each reward against the mean of the rest of its group."""
    r = _rewards(op, ctx)
    group = int(op.options["group"])
    return StepValue({"advantages": A.rloo_advantages(r, torch.arange(len(r)) // group)})


@_advantage
def reinforce_pp(op: OpPlan, ctx: StepContext) -> StepValue:
    """REINFORCE++: discounted returns, whitened over the batch."""
    mask = ctx.input(op, "rollouts")["response_mask"]
    tok = _token_rewards(ctx.input(op, "scores"), mask)
    return StepValue({"advantages": A.reinforce_pp_advantages(tok, mask, gamma=float(op.options["gamma"]),
                                                              whiten=bool(op.options["whiten"]))})


@_advantage
def reinforce_pp_baseline(op: OpPlan, ctx: StepContext) -> StepValue:
    """REINFORCE++-baseline: each reward minus its group's mean, whitened over the batch's tokens."""
    mask = ctx.input(op, "rollouts")["response_mask"]
    scores = ctx.input(op, "scores")
    rewards = scores["token_rewards"] if "token_rewards" in scores else scores["rewards"]
    return StepValue({"advantages": A.reinforce_pp_baseline_advantages(rewards, int(op.options["group"]), mask)})


def overlong_penalty(op: OpPlan, ctx: StepContext) -> StepValue:
    """DAPO's overlong shaping: rewards minus a soft penalty over the last ``buffer`` tokens before ``max_tokens``."""
    mask = ctx.input(op, "rollouts")["response_mask"]
    r = _rewards(op, ctx)
    shaped = overlong_shaping(r, mask, int(op.options["max_tokens"]), int(op.options["buffer"]),
                              float(op.options["factor"]))
    penalty = float((r.float() - shaped).mean())  # mean penalty (>= 0)
    ctx.metrics[metric_name("reward", "overlong_penalty", op.id, _same_ops(op, ctx))] = penalty
    return StepValue({"rewards": shaped})


@_advantage
def gae(op: OpPlan, ctx: StepContext) -> StepValue:
    """GAE with a critic's values; returns are the critic's targets."""
    mask = ctx.input(op, "rollouts")["response_mask"]
    tok = _token_rewards(ctx.input(op, "scores"), mask)
    values_ = ctx.input(op, "values")["values"]
    adv, ret = A.gae(tok, values_ * mask, mask, gamma=float(op.options["gamma"]), lam=float(op.options["lam"]))
    return StepValue({"advantages": A.masked_whiten(adv, mask), "returns": ret})


@_advantage
def kl_penalty(op: OpPlan, ctx: StepContext) -> StepValue:
    """KL in the reward: token rewards minus ``coef`` x KL(policy || reference)."""
    mask = ctx.input(op, "rollouts")["response_mask"]
    scores = ctx.input(op, "scores")
    lp = ctx.input(op, "logprobs")["logprobs"]
    ref = ctx.input(op, "ref_logprobs")["logprobs"]
    tok = kl_penalty_in_reward(_token_rewards(scores, mask), lp, ref, mask, float(op.options["coef"]),
                               op.options["kind"])
    policy = _rollouts(op, ctx.input(op, "rollouts")).model
    ctx.metrics[_per_policy("kl_ref", op, ctx, policy)] = float(A.masked_mean(lp - ref, mask))
    return StepValue({"rewards": (tok * mask).sum(-1), "token_rewards": tok})


def call(op: OpPlan, ctx: StepContext) -> StepValue:
    """A user's ``module:function`` on the fields of its data arguments; it returns a dict of fields."""
    from flowrl.pyrefs import folder_of
    from flowrl.rewards.pool import resolve_reward  # imports "module:function" with clear errors

    fn = resolve_reward(op.options["args"][0], folder_of(op.origin))  # the flow file's folder first, as `check`
    inputs = [ctx.values[src].fields for name, src in sorted(op.inputs.items())]
    result = fn(*inputs)
    if not isinstance(result, dict):
        raise RuntimeFlowError(f"{op.origin}: `{op.options['args'][0]}` must return a dict of fields, "
                               f"got {type(result).__name__}")
    return StepValue(dict(result))


HANDLERS: dict[str, Handler] = {f.__name__: f for f in (
    sample, generate, score, filter_groups, logprobs, values, update, resync,
    group_advantage, rloo, reinforce_pp, reinforce_pp_baseline, overlong_penalty, gae, kl_penalty, call,
    env_step, agent_rollout,
)}
"""``OpSpec.handler`` -> the handler of that name. Ops whose records name a handler absent here
are refused by ``flowrl check`` on every platform (the op's ``platforms``)."""


def handler_of(op: OpPlan) -> Handler:
    """The handler of plan op ``op`` (by its catalogue record); a clear error if there is none."""
    spec = OPS.get(op.op)
    if spec is None:
        raise RuntimeFlowError(f"{op.origin}: `{op.op}` is not an op of the catalogue (flowrl.catalog.ops.OPS)")
    fn = HANDLERS.get(spec.handler)
    if fn is None:
        raise RuntimeFlowError(f"{op.origin}: `{op.op}` is served by the handler `{spec.handler}`, which the runtime "
                               "does not have; `flowrl check` refuses such ops by their record's platforms, so "
                               "this plan was not made by this version's compiler")
    return fn


__all__ = ["HANDLERS", "Handler", "handler_of", "max_version_lag", "op_seed", "prompt_value", "RuntimeFlowError"]
