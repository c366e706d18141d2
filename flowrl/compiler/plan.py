"""The ExecutionPlan: everything the runtime needs, and nothing it must re-derive.

Frozen dataclasses of plain values (str, int, float, bool, lists, dicts), so a plan
round-trips through JSON exactly (``ExecutionPlan.from_json(plan.to_json()) == plan``).
Every record carries ``origin``: the ``file:line:col`` of the source it came from.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, get_args, get_origin, get_type_hints

PLAN_VERSION = 1


@dataclass(frozen=True)
class EnginePlan:
    kind: str
    """Engine name from the schedule vocabulary: ``torch``, ``vllm``, ``megatron``..."""
    role: str
    """``train`` (forward, backward, optimizer) or ``rollout`` (generate)."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    options: dict = field(default_factory=dict)
    """Other engine options from the schedule (``gpu_memory_utilization``...)."""
    pool: str = "all"
    bundles: tuple = ()
    """Indices of the pool's placement-group bundles, one per rank (tp*pp*cp*dp ranks)."""
    gpus_per_rank: float = 1.0
    """Fraction of a (logical) GPU each rank asks Ray for; < 1 when engines are colocated."""

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp


@dataclass(frozen=True)
class ModelPlan:
    id: str
    source: str
    """``hf`` | ``tiny`` (built locally) | ``frozen`` | ``critic`` (derived from ``base``)."""
    args: dict
    """Constructor options: ``path`` for hf, task/sizes for tiny."""
    role: str
    """``trainable`` | ``frozen`` | ``critic``."""
    base: str | None
    """For frozen/critic models: the model whose initial weights they start from."""
    train_engine: EnginePlan | None
    rollout_engine: EnginePlan | None
    optim: dict
    """AdamW settings from the model's update op (lr, weight_decay, grad_clip)."""
    origin: str


@dataclass(frozen=True)
class DatasetPlan:
    id: str
    format: str
    path: str
    """Absolute path (relative paths are resolved against the declaring file's directory)."""
    prompt: str
    answer: str
    eval_path: str
    origin: str


@dataclass(frozen=True)
class RewardPlan:
    id: str
    kind: str
    """``verifier`` | ``python_reward`` | ``reward_model``."""
    options: dict
    origin: str


@dataclass(frozen=True)
class OpPlan:
    id: str
    kind: str
    """OpKind value: sample, generate, score, logprobs, values, advantage, update, resync, ..."""
    op: str
    """Catalogue name: ``group_advantage``, ``gae``..."""
    inputs: dict
    """Argument name -> producing op / resource id."""
    options: dict
    """Keyword options with defaults filled in; losses as ``{"name": ..., **options}``."""
    model: str | None
    engine: str | None
    """Where it runs: rollout, train, reward, driver, env."""
    fields: tuple
    origin: str
    region: str | None = None


@dataclass(frozen=True)
class ResyncPlan:
    id: str
    model: str
    after: str
    """The update op whose weights are sent."""
    protocol: str
    """``inplace`` (colocated) | ``broadcast`` | ``checkpoint`` | ``delta``..."""
    bucket_bytes: int
    every: int
    origin: str


@dataclass(frozen=True)
class PoolPlan:
    name: str
    gpus: int
    strategy: str
    """Ray placement-group strategy: PACK, STRICT_PACK, SPREAD."""


@dataclass(frozen=True)
class RunPlan:
    steps: int = 20
    seed: int = 0
    eval_every: int = 10
    save_every: int = 0


@dataclass(frozen=True)
class ExecutionPlan:
    flow: str
    source: str
    cluster: dict
    pools: tuple[PoolPlan, ...]
    models: tuple[ModelPlan, ...]
    datasets: tuple[DatasetPlan, ...]
    rewards: tuple[RewardPlan, ...]
    ops: tuple[OpPlan, ...]
    """In execution order (a topological order of the intra-step graph)."""
    resyncs: tuple[ResyncPlan, ...]
    staleness: int
    run: RunPlan
    regions: dict = field(default_factory=dict)
    version: int = PLAN_VERSION

    def model(self, mid: str) -> ModelPlan:
        return next(m for m in self.models if m.id == mid)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ExecutionPlan":
        return _from_plain(cls, json.loads(text))


def _from_plain(tp, value: Any):
    """Rebuild dataclasses (and tuples) from their JSON form, guided by type hints."""
    if value is None:
        return None
    if is_dataclass(tp):
        hints = get_type_hints(tp)
        return tp(**{f.name: _from_plain(hints[f.name], value[f.name]) for f in fields(tp) if f.name in value})
    origin = get_origin(tp)
    if origin is tuple:
        (item, *_rest) = get_args(tp) or (Any,)
        return tuple(_from_plain(item, v) for v in value)
    if origin is not None and type(None) in get_args(tp):  # Optional[X]
        inner = next(a for a in get_args(tp) if a is not type(None))
        return _from_plain(inner, value)
    if tp is tuple:
        return tuple(value)
    return value
