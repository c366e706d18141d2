"""What one step's handlers share: the values ops produce, and the services they may call.

A handler is ``handler(op, ctx) -> StepValue``. It reads earlier ops' values with
:meth:`StepContext.input`, calls the run through ``ctx.services`` (a :class:`Services`
record of typed pieces: data, engines, rewards, partial-rollout buffers, events) and
writes metrics into ``ctx.metrics``. Nothing else is shared: handlers never reach into
the driver.

A :class:`StepValue` holds *fields* (columns of the step's experience table: each key one of
:data:`flowrl.catalog.ops.FIELDS`, or a field the flow's ``call(..., produces = [...])``
declares; :func:`check_fields` refuses any other) and, for the values of ``generate``, a
:class:`Rollouts` record: the padded token batch the train engines read, the decoded texts
the rewards read, and the model that generated them.

>>> from flowrl.plan import OpPlan
>>> op = OpPlan("scores", "score", "score", {}, {}, None, "reward", ("rewards",), "f.flow:3:1")
>>> v = StepValue({"rewards": [1.0, 0.0]})
>>> v["rewards"], "answers" in v, check_fields(op, v)
([1.0, 0.0], False, None)
>>> check_fields(op, StepValue({"reward": [1.0]}))
Traceback (most recent call last):
...
flowrl.runtime.step.UndeclaredFieldError: `scores` (f.flow:3:1) produced the undeclared field 'reward' (did you mean 'rewards'?); every key must be one of flowrl.catalog.ops.FIELDS or a field the flow declares
"""

from __future__ import annotations

import difflib
import hashlib
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

from flowrl.catalog.ops import FIELDS
from flowrl.engines.types import Completion, SamplingSpec, TokenBatch
from flowrl.plan import ExecutionPlan, OpPlan


def op_seed(seed: int, step: int, op_id: str) -> int:
    """A reproducible 31-bit seed for one op at one step (same after a resume)."""
    h = hashlib.blake2b(f"{seed}:{step}:{op_id}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


class UndeclaredFieldError(KeyError):
    """A handler produced a key that the catalogue's field table does not declare (a runtime bug)."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class Rollouts:
    """What a ``generate`` op produced besides its fields (B = prompts x n completions)."""

    model: str
    """The model whose rollout engine generated them."""
    batch: TokenBatch
    """Prompt + response rows, right-padded: ``input_ids`` [B, T], ``response_mask`` [B, T],
    ``extras["rollout_logprobs"]`` [B, T]."""
    texts: tuple[str, ...]
    """Decoded responses [B] (what rewards score)."""


@dataclass(frozen=True)
class StepValue:
    """The value of one op at one step: declared fields, and the rollouts record of a ``generate``."""

    fields: dict[str, Any] = field(default_factory=dict)
    """Field name (a key of :data:`~flowrl.catalog.ops.FIELDS`) -> per-sample list or tensor."""
    rollouts: Rollouts | None = None
    """Set on ``generate`` values (and values passing them through)."""

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def __contains__(self, key: object) -> bool:
        return key in self.fields

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


def check_fields(op: OpPlan, value: StepValue) -> None:
    """Refuse a value of ``op`` with a key neither the catalogue nor the flow declares (a runtime bug,
    or a user function returning a field its ``produces`` does not name)."""
    for key in value.fields:
        if key not in FIELDS and key not in op.fields:
            close = difflib.get_close_matches(str(key), [*FIELDS, *op.fields], n=1)
            raise UndeclaredFieldError(
                f"`{op.id}` ({op.origin}) produced the undeclared field {key!r}"
                + (f" (did you mean {close[0]!r}?)" if close else "")
                + "; every key must be one of flowrl.catalog.ops.FIELDS or a field the flow declares")


# ---- the services a handler may call ----------------------------------------------------------------


class DataService(Protocol):
    """Datasets, their samplers and the tokenizer of a run."""

    pad_id: int

    def draw(self, op: OpPlan) -> list[dict]:
        """The next rows of ``op``'s (a ``sample``) dataset; deterministic and resumable."""

    def tokenize(self, texts: list[str], *, special: bool = True) -> list[list[int]]:
        """Token ids of each text (the flow's shared tokenizer); ``special=False``: without the
        tokenizer's special tokens (an observation appended to a conversation)."""

    def columns(self, dataset: str) -> tuple[str, str]:
        """The (prompt, answer) column names of ``dataset``."""

    def eval_rows(self, dataset: str) -> list[dict]:
        """The rows of ``dataset``'s held-out split (empty without one)."""


class EngineService(Protocol):
    """The engines of every model (one record per model), called by model id."""

    def generate(self, model: str, prompts: list[list[int]], spec: SamplingSpec,
                 step: int) -> tuple[list[list[Completion]], int]:
        """Completions grouped per prompt and the rollout version (weights) that produced them."""

    def forward(self, model: str, batch: TokenBatch, step: int, *, entropy: bool = False,
                values: bool = False, adapters: bool = True) -> dict:
        """Per-token outputs of the model's train engine (``logprobs``, ``entropy``, ``values``);
        ``adapters=False``: of its base model, its LoRA adapters disabled (a plan's ``adapters = "off"``)."""

    def train(self, model: str, batch: TokenBatch, loss: dict, op: OpPlan, step: int) -> list[dict]:
        """One update of the model's train engine; returns its per-minibatch stats."""

    def resync(self, resync_id: str, step: int, metrics: dict) -> None:
        """Run the plan's resync ``resync_id`` (if due at ``step``), recording ``sync/*`` metrics."""

    def train_version(self, model: str) -> int:
        """Updates the model's train engine has taken."""


class Reward(Protocol):
    """A reward resource: scores completions (see :mod:`flowrl.runtime.rewards`)."""

    correct: float | None
    """The reward at or above which a completion counts as right in the held-out accuracy; None where
    the reward has no such value (a reward model's or a judge's score)."""

    def score(self, completions: list[str], answers: list[str], prompts: list[str] | None = None,
              rows: list[dict] | None = None) -> Any:
        """A result with ``rewards`` (one float per completion) and ``errors``; ``rows``: each sample's
        dataset row (every field), for rewards that read more than the answer."""

    def close(self) -> None:
        """Release its workers."""


class EventLog(Protocol):
    """Where warnings about single samples go (``events.log`` and the progress line)."""

    def reward_errors(self, op: OpPlan, step: int, errors: list) -> None:
        """Report the reward errors of ``op`` at ``step`` (they scored the error reward)."""

    def reward_recovered(self, op: OpPlan, step: int, recovered: list) -> None:
        """Report the samples of ``op`` at ``step`` whose reward worker died under them and that a fresh
        worker scored."""

    def env_errors(self, op: OpPlan, step: int, errors: list[tuple[int, str]]) -> None:
        """Report the episodes ``op`` ended at ``step`` because their environment failed ``(row, message)``."""

    def reward_output(self, op: OpPlan, step: int, output: list[tuple[int, str]]) -> None:
        """Record what the reward function of ``op`` printed at ``step`` ``(sample, text)``, never on the terminal."""

    def env_output(self, op: OpPlan, step: int, output: list[tuple[int, str]]) -> None:
        """Record what the environment of ``op`` printed at ``step`` ``(row, text)``, never on the terminal."""

    def env_recovered(self, op: OpPlan, step: int, recovered: list[tuple[int, str]]) -> None:
        """Report the episodes of ``op`` at ``step`` whose environment worker died under them and that a
        fresh worker replayed ``(row, message)``."""


@dataclass(frozen=True)
class Services:
    """The typed interface a handler gets: one field per service, nothing else of the run."""

    plan: ExecutionPlan
    seed: int
    """The run's seed (:func:`op_seed` derives each op's)."""
    data: DataService
    engines: EngineService
    rewards: Mapping[str, Reward]
    """Reward resource id -> its scorer."""
    partial: Mapping[str, Any]
    """``generate`` op id -> its :class:`~flowrl.runtime.partial.PartialRollout` buffer (partial rollout only)."""
    events: EventLog
    timeline: Any
    """The run's :class:`~flowrl.runtime.observe.Timeline` (spans of every op)."""
    envs: Mapping[str, Any] = field(default_factory=dict)
    """Environment resource id -> its :class:`~flowrl.runtime.env_pool.EnvPool`."""


@dataclass
class StepContext:
    """One step's values and metrics, and the services its handlers may call."""

    step: int
    services: Services
    values: dict[str, StepValue] = field(default_factory=dict)
    """Op id -> its value this step."""
    metrics: dict[str, float] = field(default_factory=dict)
    draw: int = 0
    """Which draw of the step's prompts this is: 0, or k > 0 when an op that draws again
    (``filter_groups``) replays the step's producer ops (their sampling seeds differ per draw)."""
    tag: str = ""
    """What pass this is: "" for a training step, "eval" for the held-out pass
    (:mod:`flowrl.runtime.heldout`): environment episodes of one never meet the other's."""

    def input(self, op: OpPlan, arg: str) -> StepValue:
        """The value bound to ``op``'s argument ``arg`` (an earlier op's)."""
        return self.values[op.inputs[arg]]


__all__ = ["op_seed", "Rollouts", "StepValue", "UndeclaredFieldError", "check_fields", "DataService", "EngineService", "Reward", "EventLog",
           "Services", "StepContext"]
