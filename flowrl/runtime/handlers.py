"""One small handler per op kind: ``HANDLERS[op.kind](op, ctx) -> dict of fields``.

A handler reads its inputs' fields from ``ctx.values`` (what earlier ops produced this
step), calls an engine through its worker group or computes driver-side math, and
returns the fields its op produces (the IR's ``fields``; ``_batch`` carries the padded
TokenBatch of rollouts). Metrics go to ``ctx.metrics``. No handler knows about another.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Callable

import numpy as np
import torch

from flowrl.algos import advantages as A
from flowrl.algos.kl import kl_k3, kl_penalty_in_reward
from flowrl.algos.mismatch import mismatch_metrics, tis_weights
from flowrl.plan import OpPlan
from flowrl.engines.types import SamplingSpec, TokenBatch


class RuntimeFlowError(RuntimeError):
    """A failure the user can act on, raised with the op's source position."""


def op_seed(seed: int, step: int, op_id: str) -> int:
    """A reproducible 31-bit seed for one op at one step (same after a resume)."""
    h = hashlib.blake2b(f"{seed}:{step}:{op_id}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


def _input(op: OpPlan, ctx, arg: str) -> dict:
    return ctx.values[op.inputs[arg]]


# ---- data ---------------------------------------------------------------------------------


def handle_sample(op: OpPlan, ctx) -> dict:
    ds = ctx.rt.datasets[op.inputs["dataset"]]
    rows = ctx.rt.samplers[op.id].next_rows(ds.rows)
    prompts = [r[ds.prompt] for r in rows]
    return {"prompts": prompts, "answers": [str(r[ds.answer]) for r in rows],
            "prompt_ids": [ctx.rt.tokenizer(p).input_ids for p in prompts]}


def _sampling_spec(op: OpPlan, ctx) -> SamplingSpec:
    o = op.options
    return SamplingSpec(n=int(o["n"]), temperature=float(o["temperature"]), top_p=float(o["top_p"]),
                        top_k=int(o["top_k"]), max_tokens=int(o["max_tokens"]), stop=tuple(o.get("stop") or ()),
                        seed=op_seed(ctx.rt.seed + int(o.get("seed", 0)), ctx.step, op.id))


def _per_prompt(src: dict, count: int) -> list[dict]:
    """``count`` dicts of the per-prompt fields of ``src`` (lists with one item per prompt)."""
    keys = [k for k, v in src.items() if isinstance(v, list) and len(v) == count]
    return [{k: src[k][j] for k in keys} for j in range(count)]


def _generate_whole(op: OpPlan, ctx, src: dict, spec: SamplingSpec) -> tuple[list, list, list]:
    """Every prompt to completion in one call: (completion groups, version per group, fields per group)."""
    groups, version = ctx.rt.generate(op.model, src["prompt_ids"], spec, ctx)
    tokens = sum(len(c.response_ids) for g in groups for c in g)
    ctx.metrics["perf/gen_tokens"] = ctx.metrics.get("perf/gen_tokens", 0) + tokens
    return groups, [version] * len(groups), _per_prompt(src, len(groups))


def _generate_partial(op: OpPlan, ctx, src: dict, spec: SamplingSpec) -> tuple[list, list, list]:
    """Over-provisioned generation through the op's :class:`~flowrl.runtime.partial.PartialRollout` buffer."""
    from dataclasses import replace

    buffer = ctx.rt.partial[op.id]
    sample = next((p for p in ctx.rt.plan.ops if p.id == op.inputs["prompts"]), None)
    if sample is None or sample.kind != "sample":
        raise RuntimeFlowError(f"{op.origin}: partial_rollout draws extra prompts from `sample(...)`, but "
                               f"`{op.id}` takes its prompts from `{op.inputs['prompts']}`; hint: pass "
                               "sample(...) straight to generate, or remove partial_rollout from the schedule")

    def prompts_of(fields: dict) -> list:
        return [(p["prompt_ids"], p) for p in _per_prompt(fields, len(fields["prompt_ids"]))]

    def generate(prompts: list, max_tokens: int, index: int):
        # One request per unfinished completion (n = 1); the seed names the step, round and chunk.
        seed = op_seed(ctx.rt.seed + int(op.options.get("seed", 0)), ctx.step, f"{op.id}/round{index}/{max_tokens}")
        groups, version = ctx.rt.generate(op.model, prompts, replace(spec, n=1, max_tokens=max_tokens, seed=seed), ctx)
        return [g[0] for g in groups], version

    result = buffer.run(ctx.step, prompts_of(src), spec.n, spec.max_tokens,
                        lambda: prompts_of(handle_sample(sample, ctx)), generate)
    ctx.metrics.update({k: v for k, v in result.metrics.items() if k != "partial/gen_tokens"})
    ctx.metrics["perf/gen_tokens"] = ctx.metrics.get("perf/gen_tokens", 0) + result.metrics["partial/gen_tokens"]
    return ([g.completions() for g in result.groups], [g.version for g in result.groups],
            [g.fields for g in result.groups])


def handle_generate(op: OpPlan, ctx) -> dict:
    """``n`` completions per prompt; with ``partial_rollout`` the groups may come from earlier steps.

    Returns per-completion fields (``G`` groups x ``n``): ``response_ids``, ``response_mask`` /
    ``rollout_logprobs`` ``[G*n, T]``, ``group_ids`` ``[G*n]``, ``version`` (the rollout version
    of the weights that started each completion), and every per-prompt input field repeated n times.
    """
    src = _input(op, ctx, "prompts")
    spec = _sampling_spec(op, ctx)
    produce = _generate_partial if op.id in getattr(ctx.rt, "partial", {}) else _generate_whole
    groups, versions, fields = produce(op, ctx, src, spec)
    completions = [c for group in groups for c in group]
    n = spec.n
    batch = TokenBatch.from_completions(completions, ctx.rt.pad_id)
    tokens = sum(len(c.response_ids) for c in completions)
    ctx.metrics["response/length_mean"] = tokens / max(len(completions), 1)
    out = {
        "completions": completions,
        "prompt_ids": [list(c.prompt_ids) for c in completions],
        "response_ids": [list(c.response_ids) for c in completions],
        "response_mask": batch.response_mask,
        "rollout_logprobs": batch.extras["rollout_logprobs"],
        "group_ids": torch.arange(len(groups)).repeat_interleave(n),
        "version": [v for v in versions for _ in range(n)],
        "response_text": [c.text for c in completions],
        "_batch": batch,
        "_model": op.model,
    }
    for key in (fields[0] if fields else {}):  # passthrough: per-prompt fields repeat for each of the n completions
        if key not in out:
            out[key] = [f[key] for f in fields for _ in range(n)]
    return out


def handle_score(op: OpPlan, ctx) -> dict:
    roll = _input(op, ctx, "rollouts")
    reward = ctx.rt.rewards[op.inputs["reward"]]
    result = reward.score(roll["response_text"], roll.get("answers") or [""] * len(roll["response_text"]),
                          roll.get("prompts"))
    r = torch.tensor(result.rewards, dtype=torch.float32)
    ctx.metrics.update({"reward/mean": float(r.mean()), "reward/min": float(r.min()), "reward/max": float(r.max())})
    if result.errors:
        ctx.metrics["reward/errors"] = len(result.errors)
        ctx.rt.report_reward_errors(op, ctx.step, result.errors)
    return {"rewards": r}


# ---- engines ----------------------------------------------------------------------------------


def handle_logprobs(op: OpPlan, ctx) -> dict:
    roll = _input(op, ctx, "rollouts")
    entropy = bool(op.options.get("entropy", False))
    out = ctx.rt.forward(op.model, roll["_batch"], ctx, entropy=entropy)
    lp = out["logprobs"]
    if roll.get("_model") == op.model and all(v == ctx.rt.train_version[op.model] for v in roll["version"]):
        # Same weights on both engines: any gap is the train/inference mismatch.
        m = mismatch_metrics(lp, roll["rollout_logprobs"], roll["response_mask"])
        ctx.metrics.update({k.replace("mismatch_", "mismatch/"): float(v) for k, v in m.items()})
    fields = {"logprobs": lp}
    if entropy:
        fields["entropy"] = out["entropy"]
    return fields


def handle_values(op: OpPlan, ctx) -> dict:
    roll = _input(op, ctx, "rollouts")
    return {"values": ctx.rt.forward(op.model, roll["_batch"], ctx, values=True)["values"]}


def handle_update(op: OpPlan, ctx) -> dict:
    roll = _input(op, ctx, "rollouts")
    batch: TokenBatch = roll["_batch"]
    mask = batch.response_mask
    loss = dict(op.options["loss"])
    loss.update(kl=float(op.options.get("kl", 0.0)), kl_kind=op.options.get("kl_kind", "k3"),
                entropy=float(op.options.get("entropy", 0.0)))
    extras = dict(batch.extras)
    targets = _input(op, ctx, "targets")
    old = ctx.values[op.inputs["old"]] if "old" in op.inputs else {}
    if loss["name"] == "value_clip":
        extras["returns"] = targets["returns"]
        extras["old_values"] = old["values"]
    else:
        adv = targets["advantages"]
        extras["advantages"] = A.broadcast_to_tokens(adv, mask) if adv.dim() == 1 else adv
        if "logprobs" in old:
            extras["old_logprobs"] = old["logprobs"]
        if "ref_logprobs" in op.inputs:
            ref = ctx.values[op.inputs["ref_logprobs"]]["logprobs"]
            extras["ref_logprobs"] = ref
            if "old_logprobs" in extras:
                ctx.metrics["kl/ref"] = float(A.masked_mean(kl_k3(extras["old_logprobs"], ref), mask))
        tis = float(op.options.get("tis", 0.0))
        if tis > 0 and "old_logprobs" in extras:
            extras["is_weights"] = tis_weights(extras["old_logprobs"], extras["rollout_logprobs"], mask, cap=tis)
    trained = ctx.rt.train_version[op.model]
    lags = torch.tensor([trained - v for v in roll["version"]]) if op.model == roll.get("_model") \
        else torch.zeros(len(roll["version"]), dtype=torch.long)
    for lag, count in sorted(Counter(lags.tolist()).items()):
        # Versions behind the weights being trained: 0 when synchronous, at most the plan's
        # max_version_lag = (staleness - 1) + (every - 1) of the model's resync.
        ctx.metrics[f"staleness/hist/{lag}"] = count
    too_old = lags > max_version_lag(ctx.rt.plan)
    if bool(too_old.any()):  # the versioned buffer's filter: such samples carry no loss
        mask = mask * (~too_old).to(mask.dtype).unsqueeze(-1)
        ctx.metrics["staleness/dropped"] = int(too_old.sum())
    full = TokenBatch(batch.input_ids, batch.attention_mask, mask, extras)
    stats = ctx.rt.train(op.model, full, loss, op, ctx)
    same_weights = not bool(lags.any())
    for key in sorted({k for s in stats for k in s}):
        if key.startswith("mismatch_") and not same_weights:
            continue  # rollout and trainer weights differ (a skipped resync): not the engines' mismatch
        vals = [float(s[key]) for s in stats if key in s]
        ctx.metrics[_ON_POLICY_METRICS.get(key, f"train/{op.model}/{key}")] = float(np.mean(vals))
    return {}


_ON_POLICY_METRICS = {"mismatch_abs_mean": "mismatch/abs_mean", "mismatch_abs_max": "mismatch/abs_max",
                      "mismatch_kl": "mismatch/kl", "kl_ref": "kl/ref"}
"""Loss metrics measured in the update when the plan elided the old-logprob pass
(:func:`flowrl.compiler.lower.elide_old_logprobs`), under the names the logprobs pass uses."""


def max_version_lag(plan) -> int:
    """How many versions behind the trained weights a sample may be: the staleness bound,
    plus ``every - 1`` when the weights reach the rollout engine only every N updates."""
    if plan.pipeline is not None:
        return int(plan.pipeline.max_version_lag)
    return plan.staleness - 1


def handle_resync(op: OpPlan, ctx) -> dict:
    ctx.rt.resync(op, ctx)
    return {}


# ---- driver-side math -----------------------------------------------------------------------


def _rewards(op: OpPlan, ctx) -> torch.Tensor:
    return _input(op, ctx, "scores")["rewards"]


def _token_rewards(scores: dict, mask: torch.Tensor) -> torch.Tensor:
    if "token_rewards" in scores:
        return scores["token_rewards"]
    return A.sequence_reward_to_tokens(scores["rewards"], mask)


def _group_advantage(op: OpPlan, ctx) -> dict:
    return {"advantages": A.group_advantages(_rewards(op, ctx), int(op.options["group"]),
                                             normalize_std=bool(op.options["normalize_std"]),
                                             eps=float(op.options["eps"]))}


def _rloo(op: OpPlan, ctx) -> dict:
    r = _rewards(op, ctx)
    group = int(op.options["group"])
    return {"advantages": A.rloo_advantages(r, torch.arange(len(r)) // group)}


def _reinforce_pp(op: OpPlan, ctx) -> dict:
    mask = _input(op, ctx, "rollouts")["response_mask"]
    tok = _token_rewards(_input(op, ctx, "scores"), mask)
    return {"advantages": A.reinforce_pp_advantages(tok, mask, gamma=float(op.options["gamma"]),
                                                    whiten=bool(op.options["whiten"]))}


def _gae(op: OpPlan, ctx) -> dict:
    mask = _input(op, ctx, "rollouts")["response_mask"]
    tok = _token_rewards(_input(op, ctx, "scores"), mask)
    values = _input(op, ctx, "values")["values"]
    adv, ret = A.gae(tok, values * mask, mask, gamma=float(op.options["gamma"]), lam=float(op.options["lam"]))
    return {"advantages": A.masked_whiten(adv, mask), "returns": ret}


def _kl_penalty(op: OpPlan, ctx) -> dict:
    mask = _input(op, ctx, "rollouts")["response_mask"]
    scores = _input(op, ctx, "scores")
    lp = _input(op, ctx, "logprobs")["logprobs"]
    ref = _input(op, ctx, "ref_logprobs")["logprobs"]
    tok = kl_penalty_in_reward(_token_rewards(scores, mask), lp, ref, mask, float(op.options["coef"]),
                               op.options["kind"])
    ctx.metrics["kl/ref"] = float(A.masked_mean(lp - ref, mask))
    return {"rewards": (tok * mask).sum(-1), "token_rewards": tok}


ADVANTAGE_OPS: dict[str, Callable] = {
    "group_advantage": _group_advantage,
    "rloo": _rloo,
    "reinforce_pp": _reinforce_pp,
    "gae": _gae,
    "kl_penalty": _kl_penalty,
}


def handle_advantage(op: OpPlan, ctx) -> dict:
    out = ADVANTAGE_OPS[op.op](op, ctx)
    adv = out.get("advantages")
    if adv is not None:
        ctx.metrics[f"adv/{op.id}/abs_mean"] = float(adv.abs().mean())
    return out


def handle_user_call(op: OpPlan, ctx) -> dict:
    from flowrl.rewards.pool import resolve_reward  # imports "module:function" with clear errors

    fn = resolve_reward(op.options["args"][0])
    inputs = [ctx.values[src] for name, src in sorted(op.inputs.items())]
    result = fn(*inputs)
    if not isinstance(result, dict):
        raise RuntimeFlowError(f"{op.origin}: `{op.options['args'][0]}` must return a dict of fields, "
                               f"got {type(result).__name__}")
    return result


HANDLERS: dict[str, Callable] = {
    "sample": handle_sample,
    "generate": handle_generate,
    "score": handle_score,
    "logprobs": handle_logprobs,
    "values": handle_values,
    "advantage": handle_advantage,
    "update": handle_update,
    "resync": handle_resync,
    "user_call": handle_user_call,
}
"""Op kind -> handler. Kinds absent here (``env_step``) are rejected before any engine starts."""

