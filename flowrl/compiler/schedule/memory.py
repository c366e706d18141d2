"""The memory of GPUs that engines share, phase by phase, as the runtime runs them.

On a GPU platform, engines on the same GPUs take turns: the rollout engines run in the
``generate`` phase, the train engines (log-probs, values, updates) in the ``train`` phase,
and an engine whose record frees memory (:attr:`~flowrl.catalog.engines.EngineSpec.frees_memory`)
gives it back while the other phase runs: a rollout engine ``sleep``s (vLLM ``sleep``,
SGLang ``release_memory_occupation``: weights offloaded to host memory, KV cache freed),
a train engine ``offload``s its parameters, gradients and optimizer states to host memory.
What a released engine still holds on the GPU:

* a sleeping rollout engine: its workspace and CUDA context (``Memory.other_gb``; the
  reservation's weights and KV cache are gone);
* an offloaded train engine: its CUDA context (``Profile.context_gb``).

An engine that cannot free memory stays resident in every phase. On the ``cpu``
platform nothing is released (logical GPUs share the machine's RAM; CPU vLLM has no sleep
mode): every engine is resident and the peak is their sum. The per-GPU peak is the
largest phase; it must fit the GPU (E439).

>>> from flowrl.catalog.hardware import PROFILES
>>> from flowrl.plan import EnginePlan, Memory, PoolPlan
>>> pool = PoolPlan("all", 1, "STRICT_PACK", (0,), (0,))
>>> train = EnginePlan("torch", "train", gpus=(0,), memory=Memory(10.0, 20.0, 30.0))
>>> roll = EnginePlan("vllm", "rollout", gpus=(0,), memory=Memory(5.0, other_gb=2.0, reserved_gb=40.0))
>>> m = pool_memory(pool, {"p.train": train, "p.rollout": roll}, PROFILES["H100"])
>>> [(ph.name, ph.peak_gb) for ph in m.phases], m.peak_gb
([('generate', 40.5), ('train', 62.0)], 62.0)
"""

from __future__ import annotations

from dataclasses import replace

from flowrl.catalog.engines import ENGINES
from flowrl.cost.profiles import Profile
from flowrl.diagnostics import Diagnostic, Span
from flowrl.plan import EnginePlan, MemoryPhase, PoolMemory, PoolPlan

PHASE_OF_ROLE = {"rollout": "generate", "train": "train"}
"""The phase each engine role runs in."""


def engines_on(pool: PoolPlan, engines: dict[str, EnginePlan]) -> list[str]:
    """Engines with a rank on one of the pool's GPUs."""
    gpus = set(pool.gpu_ids)
    return [k for k, e in engines.items() if set(e.gpus) & gpus]


def releases(key: str, engines: dict[str, EnginePlan], hw: Profile) -> str:
    """What the runtime does with engine ``key`` while the other phase runs on its GPUs:
    ``sleep``/``offload`` (its record's ``frees_memory``) when engines take turns on them (GPU
    platforms) and it shares a GPU with an engine of the other role; else ``""`` (resident)."""
    e = engines[key]
    if hw.kind != "gpu":
        return ""
    shares = any(o.role != e.role and set(o.gpus) & set(e.gpus) for k, o in engines.items() if k != key)
    return (ENGINES[e.kind].frees_memory or "") if shares else ""


def remainder_gb(e: EnginePlan, how: str, hw: Profile) -> float:
    """GB per GPU an engine still holds once it released its memory ``how``."""
    if e.memory is None:
        return 0.0
    return e.memory.other_gb if how == "sleep" else min(hw.context_gb, e.memory.total_gb)


def pool_memory(pool: PoolPlan, engines: dict[str, EnginePlan], hw: Profile) -> PoolMemory | None:
    """The phases of ``pool``'s GPUs and their peaks (None when no engine on it has a memory estimate)."""
    on = engines_on(pool, engines)
    known = [k for k in on if engines[k].memory is not None]
    if not known:
        return None
    how = {k: releases(k, engines, hw) for k in known}
    full = {k: engines[k].memory.total_gb for k in known}
    phases = []
    if not any(how.values()):
        phases.append(MemoryPhase("resident", tuple(known), peak_gb=_r(sum(full.values()))))
    else:
        for role, name in PHASE_OF_ROLE.items():
            active = tuple(k for k in known if engines[k].role == role)
            if not active:
                continue
            released = tuple((k, how[k]) for k in known if k not in active and how[k])
            resident = tuple(k for k in known if k not in active and not how[k])
            peak = sum(full[k] for k in active + resident) + \
                sum(remainder_gb(engines[k], h, hw) for k, h in released)
            phases.append(MemoryPhase(name, active, released, resident, _r(peak)))
    peak = max(p.peak_gb for p in phases)
    return PoolMemory(pool.name, tuple(known), any(how.values()), tuple(phases), peak, round(hw.hbm_gb, 3))


def with_memory(engines: dict[str, EnginePlan], pools, hw: Profile) -> tuple[dict[str, EnginePlan], tuple[PoolMemory, ...]]:
    """The engines with what each does with its memory between phases (``releases``), and each
    pool's memory phases."""
    out = {k: replace(e, releases=releases(k, engines, hw)) for k, e in engines.items()}
    return out, tuple(m for m in (pool_memory(p, out, hw) for p in pools) if m is not None)


def _r(x: float) -> float:
    return round(float(x), 3)


def pool_problems(m: PoolMemory, engines: dict[str, EnginePlan], hw: Profile, span: Span) -> list[Diagnostic]:
    """E439: the largest phase of a pool shared by several engines does not fit a GPU."""
    if len(m.engines) < 2 or m.peak_gb <= m.capacity_gb:
        return []
    worst = max(m.phases, key=lambda p: p.peak_gb)
    parts = [f"{k} {engines[k].memory.total_gb:.1f}" for k in worst.active]
    parts += [f"{k} {engines[k].memory.total_gb:.1f} (resident: `{engines[k].kind}` cannot free its memory)"
              for k in worst.resident]
    parts += [f"{k} {remainder_gb(engines[k], h, hw):.1f} ({'asleep' if h == 'sleep' else 'offloaded'})"
              for k, h in worst.released]
    if m.turns and worst.resident:
        when = f"in their {worst.name} phase"
        stuck = engines[worst.resident[0]]
        able = sorted(n for n, e in ENGINES.items() if e.serves == stuck.role and e.frees_memory)
        hint = f"an engine that gives its memory back between phases ({', '.join(f'`{n}`' for n in able)}) " \
               f"would not stay resident; or place `{worst.resident[0]}` on a pool of its own, or shard more"
    elif m.turns:
        when = f"in their {worst.name} phase"
        hint = "shard the engines of that phase more (raise tp/pp/dp), lower the rollout engine's memory " \
               "option, or place the engines on separate pools"
    else:
        when = f"resident together on {hw.platform}"
        hint = ("on the cpu platform colocated engines do not take turns: place them on separate pools or "
                "shard them more" if hw.kind != "gpu" else "these engines cannot free their memory for each other: "
                "place them on separate pools, lower the rollout engine's memory option, or shard them more")
    return [Diagnostic("E439", f"the engines on pool `{m.pool}` need {m.peak_gb:.1f} GB per GPU {when} "
                               f"({' + '.join(parts)}), but a GPU of the cluster (gpu = \"{hw.name}\") has "
                               f"{m.capacity_gb:g} GB", span, hint)]


__all__ = ["pool_memory", "pool_problems", "releases", "with_memory", "remainder_gb", "engines_on", "PHASE_OF_ROLE"]
