"""Partial rollout (APRIL-style): over-provision, stop at the target, recycle the rest.

``partial_rollout(over_provision = f, recycle = true)`` in a schedule makes every
``generate`` op keep ``K = ceil(B * f)`` prompt groups in flight for a step that needs
``B`` finished groups (a group is the ``n`` completions of one prompt: GRPO's advantages
need whole groups). Generation stops as soon as ``B`` groups are finished; the groups
still generating (and finished ones beyond ``B``) wait in a :class:`PartialRollout`
buffer and continue in the next step from their partial tokens.

How "stop at the target" works on an offline engine (vLLM's ``LLM.generate`` runs a
batch to completion and cannot be interrupted): a step generates in *rounds* of at most
``chunk = ceil(max_tokens / ROUNDS)`` tokens. Each round sends every unfinished
completion, as ``prompt + its tokens so far``, for up to ``chunk`` more tokens (one
request per completion, ``n = 1``; the engine's prefix cache reuses the shared prompt).
After each round the finished groups are counted, and the step stops at the first round
boundary where ``B`` are done. So the step is cut at a granularity of ``chunk`` tokens,
not per token as a streaming server would. A stop string that straddles two rounds is
not seen (each round checks only its own new text); EOS is always seen.

Versions: a group keeps the rollout version of its *first* round even when later rounds
run under newer weights, so its staleness is counted from the oldest weights that
produced any of its tokens. A group may wait in the buffer at most ``max_carry`` steps
(from the step that started it to the step that trains on it); older ones are dropped.
With ``recycle = false`` ``max_carry`` is 0: everything unfinished is dropped.

The budget: with staleness ``s`` a fresh sample is ``depth - 1`` versions behind the
trainer, where ``depth`` is how many producer stages run ahead
(:func:`producer_depth`), and a carried one ``depth - 1 + carried steps``. Recycling
therefore spends one version of the staleness budget: the producer runs ``s - 1`` steps
ahead and a group may be carried for 1 step, so no trained sample is more than ``s - 1``
versions behind (the bound the update's filter enforces). ``staleness 2`` with recycling
is thus synchronous generation plus recycling; ``staleness 3`` adds one-step-off overlap.

The buffer is pure Python (no Ray, no engine): the generate handler passes it a
``generate`` callback; :meth:`PartialRollout.state_dict` goes into checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from flowrl.catalog.ops import OpKind
from flowrl.engines.types import Completion

ROUNDS = 4
"""Rounds a full-length completion takes (``chunk = ceil(max_tokens / ROUNDS)`` tokens each)."""

Prompt = tuple[list[int], dict]
"""(prompt token ids, the prompt's per-prompt fields such as ``prompts`` and ``answers``)."""

GenerateFn = Callable[[list[list[int]], int, int], tuple[list[Completion], int]]
"""``generate(prompts, max_tokens, round) -> (one Completion per prompt, rollout version)``:
one sample (``n = 1``) of at most ``max_tokens`` tokens per prompt (token id lists)."""


class PartialRolloutError(ValueError):
    """A partial-rollout setting or saved state this runtime cannot use."""


@dataclass
class Group:
    """The ``n`` completions of one prompt, possibly unfinished.

    ``tokens[i]`` / ``logprobs[i]`` are completion i's response token ids and their
    log-probabilities so far (equal lengths); ``reasons[i]`` is its finish reason
    (``"stop"``/``"length"``) or None while it still generates.
    """

    key: int
    """Arrival order in the buffer (ties between equally old groups are broken by it)."""
    prompt_ids: tuple[int, ...]
    fields: dict
    """Per-prompt fields passed through to the rollouts (``prompts``, ``answers``...)."""
    tokens: list[list[int]]
    logprobs: list[list[float]]
    texts: list[str]
    reasons: list[str | None]
    version: int | None = None
    """Rollout version of the group's first round (None: nothing generated yet)."""
    started: int | None = None
    """Step of the group's first round (None: nothing generated yet)."""

    @classmethod
    def new(cls, key: int, prompt: Prompt, n: int) -> "Group":
        ids, fields = prompt
        return cls(key, tuple(ids), dict(fields), [[] for _ in range(n)], [[] for _ in range(n)],
                   [""] * n, [None] * n)

    @property
    def done(self) -> bool:
        return all(r is not None for r in self.reasons)

    def extend(self, i: int, c: Completion, max_tokens: int) -> None:
        """Append completion i's next chunk ``c``; it is finished at EOS/stop or at ``max_tokens``."""
        self.tokens[i] += c.response_ids
        self.logprobs[i] += c.logprobs
        self.texts[i] += c.text
        if c.finish_reason == "stop":
            self.reasons[i] = "stop"
        elif len(self.tokens[i]) >= max_tokens or not c.response_ids:  # no progress: end it, never loop
            self.reasons[i] = "length"

    def completions(self) -> list[Completion]:
        """The group's finished completions (all ``n``), as the engine would have returned them."""
        return [Completion(self.prompt_ids, tuple(t), tuple(lp), r or "length", text)
                for t, lp, r, text in zip(self.tokens, self.logprobs, self.reasons, self.texts)]


@dataclass
class PartialStep:
    """What one step of partial rollout produced."""

    groups: list[Group]
    """Exactly ``target`` finished groups, oldest first."""
    metrics: dict = field(default_factory=dict)
    """``partial/*`` counts, in groups (``partial/gen_tokens`` in tokens)."""


class PartialRollout:
    """The buffer of groups carried between steps, and the over-provisioned step loop.

    Args:
        over_provision: ``f`` >= 1; ``ceil(target * f)`` groups are kept in flight.
        max_carry: steps a started group may wait before it is trained on (0 drops all).
        rounds: rounds a full-length completion takes (see :data:`ROUNDS`).
    """

    def __init__(self, over_provision: float, max_carry: int, rounds: int = ROUNDS):
        if over_provision < 1.0 or rounds < 1 or max_carry < 0:
            raise PartialRolloutError(f"partial rollout: over_provision={over_provision}, rounds={rounds}, "
                                      f"max_carry={max_carry}; need over_provision >= 1, rounds >= 1, max_carry >= 0")
        self.over_provision = over_provision
        self.max_carry = max_carry
        self.rounds = rounds
        self.carried: list[Group] = []
        self.next_key = 0

    # ---- one step -------------------------------------------------------------------------------
    def run(self, step: int, fresh: list[Prompt], n: int, max_tokens: int,
            draw: Callable[[], list[Prompt]] | None, generate: GenerateFn) -> PartialStep:
        """Produce ``len(fresh)`` finished groups for ``step``.

        ``fresh``: this step's sampled prompts (their count is the target ``B``);
        ``draw()``: another batch of prompts, called while fewer than ``ceil(B * f)`` groups
        are at hand (None: over-provision only with carried groups).
        """
        target = len(fresh)
        want = math.ceil(target * self.over_provision - 1e-9)
        pool = self.carried + self._admit(fresh, n)
        while len(pool) < want and draw is not None:
            extra = draw()
            if not extra:
                break
            pool += self._admit(extra, n)
        started = [g for g in pool if g.started is not None]  # carried groups always continue
        unstarted = [g for g in pool if g.started is None]
        room = max(want - len(started), 0)
        active, waiting = started + unstarted[:room], unstarted[room:]  # waiting: not started, kept as is
        resumed = sum(g.started is not None for g in active)
        chunk = max(1, math.ceil(max_tokens / self.rounds))
        rounds = tokens = 0
        while sum(g.done for g in active) < target:
            tokens += self._round(active, step, rounds, chunk, max_tokens, generate)
            rounds += 1
        finished = sorted((g for g in active if g.done), key=_age_order)
        chosen = finished[:target]
        chosen_keys = {g.key for g in chosen}
        rest = [g for g in active if g.key not in chosen_keys]
        kept = [g for g in rest if g.started is None or step + 1 - g.started <= self.max_carry]
        self.carried = kept + waiting
        return PartialStep(chosen, {
            "partial/over_provisioned": len(active) - target,
            "partial/recycled": sum(g.started is not None for g in kept),
            "partial/dropped": len(rest) - len(kept),
            "partial/resumed": sum(g.started is not None and g.started < step for g in chosen),
            "partial/resumed_in_flight": resumed,
            "partial/rounds": rounds,
            "partial/gen_tokens": tokens,
        })

    def _admit(self, prompts: list[Prompt], n: int) -> list[Group]:
        groups = [Group.new(self.next_key + i, p, n) for i, p in enumerate(prompts)]
        self.next_key += len(groups)
        return groups

    def _round(self, active: list[Group], step: int, index: int, chunk: int, max_tokens: int,
               generate: GenerateFn) -> int:
        """One round: every unfinished completion gets up to ``chunk`` more tokens; returns tokens made."""
        todo = [(g, i) for g in active for i in range(len(g.reasons)) if g.reasons[i] is None]
        budgets: dict[int, list[tuple[Group, int]]] = {}
        for g, i in todo:  # the last chunk of a completion may be shorter than `chunk`
            budgets.setdefault(min(chunk, max_tokens - len(g.tokens[i])), []).append((g, i))
        made = 0
        for budget, items in sorted(budgets.items(), reverse=True):
            prompts = [list(g.prompt_ids) + g.tokens[i] for g, i in items]
            outs, version = generate(prompts, budget, index)
            if len(outs) != len(items):
                raise PartialRolloutError(f"partial rollout: the engine returned {len(outs)} completions "
                                          f"for {len(items)} requests")
            for (g, i), c in zip(items, outs):
                if g.version is None:  # the oldest weights that produced any of the group's tokens
                    g.version, g.started = version, step
                g.extend(i, c, max_tokens)
                made += len(c.response_ids)
        return made

    # ---- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Picklable state: the carried groups (tokens, log-probs, versions) and the key counter."""
        return {"carried": [vars(g).copy() for g in self.carried], "next_key": self.next_key,
                "over_provision": self.over_provision, "max_carry": self.max_carry, "rounds": self.rounds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; refuses one saved with other settings (the run would diverge)."""
        for key in ("over_provision", "max_carry", "rounds"):
            if state[key] != getattr(self, key):
                raise PartialRolloutError(f"checkpoint's partial-rollout {key}={state[key]!r} differs from the "
                                          f"plan's {getattr(self, key)!r}; resume with the saved run's plan.json")
        self.carried = [Group(**g) for g in state["carried"]]
        self.next_key = int(state["next_key"])


def _age_order(g: Group) -> tuple[int, int]:
    """Oldest first: groups started in earlier steps are trained on before fresh ones."""
    return (g.started if g.started is not None else 1 << 62, g.key)


# ---- what a plan asks for --------------------------------------------------------------------------


def recycles(plan) -> bool:
    """Whether the plan over-provisions and recycles unfinished generations into the next step."""
    p = plan.pipeline
    return p is not None and p.over_provision > 1.0 and p.recycle


def producer_depth(plan) -> int:
    """Producer stages run ahead (the modulo schedule's depth): ``s``, or ``s - 1`` when recycling.

    Recycled groups are one step older than fresh ones, so recycling takes one version of
    the staleness budget (the compiler requires ``s >= 2`` for it, E431).
    """
    return max(1, plan.staleness - 1) if recycles(plan) else max(1, plan.staleness)


def partial_buffers(plan) -> dict[str, PartialRollout]:
    """One buffer per ``generate`` op when the plan has ``partial_rollout(over_provision > 1)``."""
    p = plan.pipeline
    if p is None or p.over_provision <= 1.0:
        return {}
    carry = max(1, plan.staleness) - producer_depth(plan) if p.recycle else 0
    return {op.id: PartialRollout(p.over_provision, carry) for op in plan.ops if op.kind == OpKind.GENERATE}


__all__ = ["ROUNDS", "Group", "PartialRollout", "PartialRolloutError", "PartialStep", "partial_buffers",
           "producer_depth", "recycles"]
