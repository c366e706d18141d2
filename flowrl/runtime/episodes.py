"""Multi-turn episodes: ``env_step``, the ``generate`` that continues a conversation, ``repeat`` loops.

Token-in, token-out. An episode is one token row that only grows: the prompt, the model's first
turn, the environment's observation, the model's next turn... Each turn's ``generate`` gets the
whole row so far as its prompt *token ids* (earlier turns are never decoded and re-encoded, so
what the trainer scores is exactly what the sampler saw). The row's ``response_mask`` is 1 on
the model's tokens and 0 on the prompt's and the observations'; ``rollout_logprobs`` are the
sampler's on the model's tokens and 0 elsewhere, so the loss, the KL and the train/rollout
mismatch cover exactly the model's tokens.

* :func:`env_step` (the op's handler): each unfinished episode's latest turn (decoded) goes to
  its environment (:mod:`flowrl.runtime.env_pool`); the result carries the episodes unchanged,
  plus ``observations`` (token ids, tokenized without special tokens), ``done`` (the
  environment said so, or its call failed), ``rewards`` (the environment's, summed over the
  episode's turns) and ``prompt_ids`` (row so far + observation: the next turn's context).
* :func:`continue_episodes` (``generate`` on a value with ``done``): one completion (``n = 1``)
  per unfinished episode whose context leaves room for ``max_tokens`` more tokens within the
  model's context limit; an episode without room ends, flagged ``truncated``. The result is
  again the whole batch of episodes, with ``done`` and ``truncated``; its texts (what rewards
  score) are each episode's last model turn.
* :func:`run_region` runs a ``repeat COUNT until FIELD`` loop: its ops in order, up to COUNT
  turns, stopping as soon as an op's value has ``FIELD`` true on every row; from the second
  turn on, the arguments the plan's ``carry`` names read the value of the turn before (the TURN
  edges). A value re-bound in the loop that never ran keeps its value from before the loop.

Metrics (``env/*``): calls, tool calls, tool errors, episode errors, call latency (mean, max),
turns per episode (mean, max), truncated episodes, episodes still running at the end of the
loop (``env/max_turns``).

>>> rows = _rows_of(TokenBatch.from_completions([Completion((5, 6), (7, 2), (-0.5, -0.1), "stop")], 0))
>>> rows
[([5, 6, 7, 2], [0.0, 0.0, 1.0, 1.0], [0.0, 0.0, -0.5, -0.10000000149011612])]
>>> _turns([0, 0, 1, 1, 0, 0, 1, 0])
2
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from flowrl.catalog.ops import OpKind
from flowrl.engines.types import Completion, TokenBatch
from flowrl.plan import ExecutionPlan, OpPlan
from flowrl.runtime.env_prompts import chat_episodes, observation_texts
from flowrl.runtime.errors import RuntimeFlowError
from flowrl.runtime.metric_names import metric_name
from flowrl.runtime.step import Rollouts, StepContext, StepValue


def response_length_name(op: OpPlan, plan: ExecutionPlan) -> str:
    """``response/length_mean`` of the generate ``op``: per model when the plan generates with several
    (:func:`~flowrl.runtime.metric_names.metric_name`), so no model's lengths overwrite another's."""
    generating = {o.model for o in plan.ops if o.kind == OpKind.GENERATE.value}
    return metric_name("response", "length_mean", op.model, generating)


def episode_key(ctx: StepContext, op: OpPlan, row: int) -> str:
    """The environment instance of row ``row`` of ``op`` in the pass ``ctx`` (each env_step op,
    step, draw and pass has its own)."""
    return f"{ctx.tag}{ctx.step}.{ctx.draw}/{op.id}/{row}"


def _rows_of(batch: TokenBatch) -> list[tuple[list[int], list[float], list[float]]]:
    """Each row's (tokens, response mask, rollout log-probs) without padding."""
    lengths = batch.attention_mask.sum(-1).tolist()
    lp = batch.extras["rollout_logprobs"]
    return [(batch.input_ids[i, :n].tolist(), batch.response_mask[i, :n].tolist(), lp[i, :n].tolist())
            for i, n in enumerate(lengths)]


def _batch(rows: list[tuple[list[int], list[float], list[float]]], pad_id: int) -> TokenBatch:
    """Right-padded rows (as :meth:`TokenBatch.from_completions`), masks and log-probs as given."""
    width = max(len(t) for t, _, _ in rows)
    n = len(rows)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.float32)
    lp = torch.zeros((n, width), dtype=torch.float32)
    for i, (t, m, l) in enumerate(rows):
        ids[i, :len(t)] = torch.tensor(t, dtype=torch.long)
        attn[i, :len(t)] = 1
        mask[i, :len(t)] = torch.tensor(m, dtype=torch.float32)
        lp[i, :len(t)] = torch.tensor(l, dtype=torch.float32)
    return TokenBatch(ids, attn, mask, {"rollout_logprobs": lp})


def _turns(mask: list[float]) -> int:
    """Model turns in a row: runs of response-mask ones."""
    return sum(1 for j, m in enumerate(mask) if m > 0 and (j == 0 or mask[j - 1] == 0))


def _flags(value: StepValue, key: str, n: int) -> list[bool]:
    flags = value.get(key)
    if flags is None:
        return [False] * n
    return [bool(x) for x in (flags.tolist() if isinstance(flags, torch.Tensor) else flags)]


def _episodes(op: OpPlan, value: StepValue) -> Rollouts:
    if value.rollouts is None:
        raise RuntimeFlowError(f"{op.origin}: `{op.id}` continues conversations, but its input is not the value of a "
                               "generate (nor an env_step of one); hint: pass the conversation generate(...) made")
    return value.rollouts


# ---- env_step ------------------------------------------------------------------------------------


def env_step(op: OpPlan, ctx: StepContext) -> StepValue:
    """The environment's turn on every unfinished episode (see the module docstring)."""
    roll = ctx.input(op, "rollouts")
    episodes = _episodes(op, roll)
    n = len(episodes.texts)
    pool = ctx.services.envs[op.inputs["env"]]
    done = _flags(roll, "done", n)
    rows = roll.get("rows") or [{"prompt": p, "answer": a} for p, a in
                                zip(roll.get("prompt_text") or [""] * n, roll.get("answers") or [""] * n)]
    active = [i for i in range(n) if not done[i]]
    outcomes = pool.step([(episode_key(ctx, op, i), rows[i], episodes.texts[i]) for i in active])
    before = roll.get("rewards")
    rewards = (before.clone().float() if isinstance(before, torch.Tensor) and before.shape == (n,)
               else torch.zeros(n, dtype=torch.float32))
    observations: list[list[int]] = [[] for _ in range(n)]
    errors = []
    rows_now = _rows_of(episodes.batch)
    tokenizer = getattr(ctx.services.data, "tokenizer", None)  # None: a data service without one (no chat)
    # Messages become the chat template's own turn in a chat (flowrl.runtime.env_prompts); else the text.
    chat = bool(outcomes) and chat_episodes(ctx.services.plan, op, tokenizer)
    texts = observation_texts(tokenizer, outcomes, [rows_now[i][0][-1] for i in active], chat) if outcomes else []
    if chat:  # observations appended as the chat template's own turns
        ctx.metrics["env/chat_turns"] = ctx.metrics.get("env/chat_turns", 0) + sum(
            bool(o.messages) and not o.done and o.error is None for o in outcomes)
    tokens = ctx.services.data.tokenize(texts, special=False) if texts else []
    for i, o, obs in zip(active, outcomes, tokens):
        if o.error is not None:
            errors.append((i, o.error))
            done[i] = True
            continue
        rewards[i] += o.reward
        done[i] = o.done
        observations[i] = list(obs) if not o.done else []
    if op.region is None:  # a single environment turn: its episodes end here
        pool.close_episodes([episode_key(ctx, op, i) for i in active])
    _metrics(ctx, outcomes, errors, done)
    if errors:
        ctx.services.events.env_errors(op, ctx.step, errors)
    printed = [(i, o.output) for i, o in zip(active, outcomes) if o.output]
    if printed:  # what the environment printed: to events.log, redacted, never the terminal
        ctx.services.events.env_output(op, ctx.step, printed)
    recovered = [(i, o.recovered) for i, o in zip(active, outcomes) if o.recovered]
    if recovered:  # their worker died; replayed on a fresh one: nothing lost, said
        ctx.metrics["env/recovered"] = ctx.metrics.get("env/recovered", 0) + len(recovered)
        ctx.services.events.env_recovered(op, ctx.step, recovered)
    contexts = [t + observations[i] for i, (t, _, _) in enumerate(rows_now)]
    fields = dict(roll.fields)
    fields.update(prompt_ids=contexts, observations=observations, done=torch.tensor(done), rewards=rewards)
    return StepValue(fields, episodes)


def _metrics(ctx: StepContext, outcomes: list, errors: list, done: list[bool]) -> None:
    m = ctx.metrics
    calls = m.get("env/calls", 0) + len(outcomes)
    latency = m.get("env/latency_s_total", 0.0) + sum(o.seconds for o in outcomes)
    m.update({"env/calls": calls, "env/latency_s_total": latency,
              "env/latency_s_mean": latency / max(calls, 1),
              "env/latency_s_max": max([m.get("env/latency_s_max", 0.0)] + [o.seconds for o in outcomes]),
              "env/tool_calls": m.get("env/tool_calls", 0) + sum(bool(o.info.get("tool_call")) for o in outcomes),
              "env/tool_errors": m.get("env/tool_errors", 0) + sum(bool(o.info.get("tool_error")) for o in outcomes),
              "env/errors": m.get("env/errors", 0) + len(errors),
              "env/done_frac": sum(done) / max(len(done), 1)})


# ---- generate, continuing the episodes ----------------------------------------------------------


def context_limit(plan: ExecutionPlan, model: str) -> int | None:
    """The longest row ``model``'s rollout engine takes: its maximum positions, and its engine's
    ``max_model_len`` when the schedule sets one (tokens); None when neither is known."""
    m = plan.model(model)
    limits = [m.facts.get("max_len")]
    if m.rollout_engine is not None:
        limits.append(m.rollout_engine.options.get("max_model_len"))
    limits = [int(x) for x in limits if isinstance(x, int) and x > 0]
    return min(limits) if limits else None


def continue_episodes(op: OpPlan, ctx: StepContext, src: StepValue,
                      generate: Callable[[OpPlan, StepContext], StepValue]) -> StepValue:
    """``generate`` reading an ``env_step``'s value: the next model turn of every unfinished episode.

    ``generate(op, ctx)`` is the plain generate handler; it is called on the active episodes'
    contexts only (a value of one field, ``prompt_ids``).
    """
    if int(op.options.get("n", 1)) != 1:
        raise RuntimeFlowError(f"{op.origin}: `{op.id}` continues conversations, one completion each; "
                               f"n = {op.options['n']} would fork them; hint: drop `n` from this generate")
    episodes = _episodes(op, src)
    rows = _rows_of(episodes.batch)
    n = len(rows)
    contexts = src["prompt_ids"]
    observations = src.get("observations") or [[] for _ in range(n)]
    done = _flags(src, "done", n)
    truncated = _flags(src, "truncated", n)
    limit = context_limit(ctx.services.plan, op.model)
    room = int(op.options.get("max_tokens", 64))
    active = []
    for i in range(n):
        if done[i]:
            continue
        if limit is not None and len(contexts[i]) + room > limit:
            done[i] = truncated[i] = True  # no room for a whole turn: the episode ends here, flagged
        else:
            active.append(i)
    texts = list(episodes.texts)
    versions = list(src.get("version") or [0] * n)
    responses = src.get("response_ids") or [[] for _ in range(n)]
    prompt_lens = [len(t) - len(r) for (t, _, _), r in zip(rows, responses)]
    if active:
        sub = StepContext(ctx.step, ctx.services, {op.inputs["prompts"]: StepValue(
            {"prompt_ids": [list(contexts[i]) for i in active]})}, ctx.metrics)
        turn = generate(op, sub)
        turn_rows = _rows_of(turn.rollouts.batch)
        for j, i in enumerate(active):
            t, m, lp = rows[i]
            obs = list(observations[i])
            new_t, new_m, new_lp = turn_rows[j]
            start = len(contexts[i])  # the new row = context (row so far + observation) + the new turn
            assert new_t[:start] == list(contexts[i]), "the engine changed the context's tokens"  # engine bug
            rows[i] = (t + obs + new_t[start:], m + [0.0] * len(obs) + new_m[start:],
                       lp + [0.0] * len(obs) + new_lp[start:])
            texts[i] = turn.rollouts.texts[j]
            versions[i] = min(versions[i], turn["version"][j])
    batch = _batch(rows, ctx.services.data.pad_id)
    fields = dict(src.fields)
    fields.update(
        prompt_ids=[t[:p] for (t, _, _), p in zip(rows, prompt_lens)],
        response_ids=[t[p:] for (t, _, _), p in zip(rows, prompt_lens)],
        response_mask=batch.response_mask, rollout_logprobs=batch.extras["rollout_logprobs"],
        version=versions, done=torch.tensor(done), truncated=torch.tensor(truncated))
    fields.pop("observations", None)  # appended to the rows: an env_step's, not the conversation's
    turns = [_turns(m) for _, m, _ in rows]
    ctx.metrics.update({"env/turns_mean": sum(turns) / max(n, 1), "env/turns_max": max(turns, default=0),
                        "env/truncated": sum(truncated), response_length_name(op, ctx.services.plan):
                        float(batch.response_mask.sum()) / max(n, 1)})
    return StepValue(fields, Rollouts(episodes.model, batch, tuple(texts)))


# ---- repeat loops --------------------------------------------------------------------------------


def units(ops: list[OpPlan]) -> list[list[OpPlan]]:
    """``ops`` (plan order) as units to run in order: a lone op, or every op of one ``repeat`` region.

    A region runs as one unit where its last op was (every op it reads ran before it; an op
    outside it that reads one of its values runs after the whole loop).

    >>> from flowrl.plan import OpPlan
    >>> mk = lambda i, region=None: OpPlan(i, "x", "x", {}, {}, None, None, (), "", region)
    >>> [[o.id for o in u] for u in units([mk("a"), mk("b", "r"), mk("c"), mk("d", "r"), mk("e")])]
    [['a'], ['c'], ['b', 'd'], ['e']]
    """
    last = {op.region: k for k, op in enumerate(ops) if op.region is not None}
    out: list[list[OpPlan]] = []
    for k, op in enumerate(ops):
        if op.region is None:
            out.append([op])
        elif last[op.region] == k:
            out.append([o for o in ops if o.region == op.region])
    return out


def run_region(ops: list[OpPlan], ctx: StepContext, run_op: Callable[[OpPlan], None]) -> None:
    """Run the ops of one ``repeat`` region as its loop (see the module docstring)."""
    rid = ops[0].region
    spec = ctx.services.plan.regions.get(rid) or {}
    count = spec.get("count")
    if not isinstance(count, int) or count < 1:
        raise RuntimeFlowError(f"{ops[0].origin}: the `repeat` loop {rid} has no positive turn count ({count!r}); "
                               "`flowrl check` refuses such loops, so this plan was not made by this compiler")
    until, carry = spec.get("until"), spec.get("carry") or {}
    turns = 0
    for turn in range(count):
        turns += 1
        stop = False
        for op in ops:
            run_op(replace(op, inputs={**op.inputs, **carry[op.id]}) if turn and op.id in carry else op)
            value = ctx.values[op.id]
            if until and until in value and _all(value[until]):
                stop = True
                break
        if stop:
            _unreached(ops, carry, ctx)
            # The values the loop carries on (the conversation) learn that they are over too.
            for producer in {p for args in carry.values() for p in args.values()}:
                v = ctx.values.get(producer)
                rows = None if v is None else len(v[until]) if until in v else \
                    len(v.rollouts.texts) if v.rollouts is not None else None  # the loop's first value: no `until` yet
                if rows == len(value[until]):
                    # and so do their environment rewards: the last env_step's sums (a game's final score)
                    carried = {f: value[f] for f in ("rewards",) if f in value and len(value[f]) == len(value[until])}
                    ctx.values[producer] = StepValue({**v.fields, until: value[until], **carried}, v.rollouts)
            break
    for op in ops:
        if op.kind == OpKind.ENV_STEP.value and op.id in ctx.values:
            n = len(ctx.values[op.id].get("prompt_ids") or [])
            ctx.services.envs[op.inputs["env"]].close_episodes([episode_key(ctx, op, i) for i in range(n)])
    last = next((ctx.values[o.id] for o in reversed(ops) if o.id in ctx.values and "done" in ctx.values[o.id]), None)
    if last is not None:
        ctx.metrics["env/max_turns"] = sum(not d for d in _all_flags(last))
    ctx.metrics[f"loop/{rid}/turns"] = turns


def _unreached(ops: list[OpPlan], carry: dict, ctx: StepContext) -> None:
    """A value re-bound in a loop that stopped before reaching it keeps its value from before the loop
    (then, like the others, it learns that the episodes are over and their rewards)."""
    for consumer, args in carry.items():
        for arg, producer in args.items():
            if producer not in ctx.values and consumer in ctx.values:
                first = next(o for o in ops if o.id == consumer).inputs.get(arg)
                if first in ctx.values:
                    ctx.values[producer] = ctx.values[first]


def _all(flags) -> bool:
    values = flags.tolist() if isinstance(flags, torch.Tensor) else list(flags)
    return bool(values) and all(bool(x) for x in values)


def _all_flags(value: StepValue) -> list[bool]:
    flags = value["done"]
    return [bool(x) for x in (flags.tolist() if isinstance(flags, torch.Tensor) else flags)]


__all__ = ["env_step", "continue_episodes", "context_limit", "run_region", "units", "episode_key"]
