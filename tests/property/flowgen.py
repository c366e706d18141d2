"""A generator of valid-looking flows drawn from the catalogue (issue 9, point 2: executability).

Every choice is read from the catalogue's records or the stdlib's flows, so an engine, protocol,
op, loss or KL estimator added there is drawn without editing this file:

* the body is a call of a stdlib algorithm (its parameters bound by type; scalar options drawn
  from the catalogue's choices: KL estimators, aggregations, importance-sampling levels) or a
  hand-assembled chain: ``sample`` -> ``generate`` -> ``score`` -> optional filter op (any
  ``OpKind.FILTER``) -> optional reward shapers (advantage-kind ops producing ``rewards``) ->
  an advantage op (any op producing ``advantages``; a critic when it needs ``values``, and a
  critic update when it produces ``returns``) -> ``update`` with a loss of ``LOSSES``;
* the reward (with ``rewards=True``): any ``OpKind.REWARD_FN`` op of the catalogue (a named
  verifier's choices, a model-served reward over a second model), else the header's function;
* the schedule: a cluster (nodes, GPUs per node, a hardware profile of ``CLUSTER["gpu"]``),
  colocated or separate pools (spanning nodes when the cluster has several), an engine of
  each role with a layout over the record's axes and some of its options (ranges and choices
  from the record's ``KwSpec``), staleness 0..3, a weight-sync protocol of ``PROTOCOLS`` with
  options drawn from its record, ``every``, partial rollout (``SCHED_CALLS``); sometimes no
  schedule at all, or ``schedule auto``.

Arguments are bound by the fields each ``ArgSpec`` needs, required options by their name
(``group`` is the generate's ``n``, ``max_tokens`` its ``max_tokens``) or their range. Drawing
is deterministic given the ``random.Random`` passed in. Most drawn flows are valid; some are
rightly refused (``staleness 0``, ``group_advantage`` over groups of one, a layout that does
not fit): the property is that nothing else comes out.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from flowrl.catalog.engines import AXES, ENGINES, engines_serving
from flowrl.catalog.losses import LOSSES
from flowrl.catalog.ops import OPS, OpKind
from flowrl.catalog.protocols import PROTOCOLS
from flowrl.catalog.schedule import CLUSTER, SCHED_CALLS
from flowrl.catalog.spec import KwSpec

ENV = 'python_env("flowrl.envs.calculator:Calculator", timeout = 5.0)'
"""The environment of flows with an ``env`` parameter (``stdlib.agentic``): flowrl's calculator tool."""


@dataclass(frozen=True)
class Header:
    """The declarations a generated flow reads: the model, dataset and reward names are fixed."""

    model: str
    """The right-hand side of ``model policy = ...``."""
    dataset: str = 'jsonl("data/arith/train.jsonl", eval = "data/arith/test.jsonl")'
    reward: str = 'python_reward("executable_rewards:sevens", workers = 1)'


@dataclass(frozen=True)
class Drawn:
    text: str
    nodes: int
    gpus_per_node: int
    gpu: str
    body: str
    """``stdlib:<name>`` or ``chain:<advantage op>``."""


def _pick(rng: random.Random, seq):
    seq = list(seq)
    return seq[rng.randrange(len(seq))]


def _lit(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def draw_option(rng: random.Random, name: str, spec: KwSpec):
    """A value of option ``name`` within its record's type, range and choices (None: leave it out)."""
    if spec.choices:
        return _pick(rng, spec.choices)
    if spec.type == "bool":
        return rng.random() < 0.5
    if spec.type == "size":
        return _pick(rng, ("64KB", "1MB"))
    if spec.type == "float":
        lo = spec.min if spec.min is not None else 0.0
        hi = spec.max if spec.max is not None else lo + 1.0
        return round(rng.uniform(max(lo, 0.3 * hi) if spec.max is not None else lo, hi), 3)
    if spec.type == "int":
        lo = int(spec.min) if spec.min is not None else 0
        if "len" in name:  # a context length: the tiny model holds 128 positions
            return _pick(rng, (64, 128))
        return rng.randint(lo, lo + 3)
    return None  # strings without choices, lists, configs: the record's default


def _size(value) -> str:
    return value if isinstance(value, str) else _lit(value)


# ---- the flow body ------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def stdlib_flows() -> tuple[tuple[str, tuple[tuple[str, str], ...]], ...]:
    """``(name, ((param, type), ...))`` of every flow of the stdlib, read with the parser."""
    from flowrl.compiler.unit import stdlib_dir
    from flowrl.syntax import ast
    from flowrl.syntax.parser import parse

    out = []
    for path in sorted(stdlib_dir().glob("*.flow")):
        module = parse(path.read_bytes(), str(path))
        for item in module.items:
            if isinstance(item, ast.FlowDef) and item.name == path.stem:
                out.append((item.name, tuple((p.name, p.type) for p in item.params)))
    return tuple(out)


@lru_cache(maxsize=None)
def stdlib_refs() -> frozenset[str]:
    """The stdlib flows that bind a frozen model named ``ref`` (a schedule may place it)."""
    from flowrl.compiler.unit import stdlib_dir

    return frozenset(p.stem for p in stdlib_dir().glob("*.flow") if "ref = frozen(" in p.read_text())


def _option_choices() -> dict[str, tuple]:
    """Scalar flow parameters whose values the catalogue enumerates, by the option they feed."""
    update = OPS["update"].kwargs
    return {"kl_kind": update["kl_kind"].choices, "is_level": update["is_level"].choices,
            "agg": LOSSES["ppo_clip"].params[-1][1].choices, "lr_schedule": update["lr_schedule"].choices}


def stdlib_call(rng: random.Random, name: str, params, group: int, max_tokens: int) -> tuple[str, list[str]]:
    """A call of stdlib flow ``name``, and the declarations it needs beyond the header."""
    by_type = {"model": "policy", "dataset": "prompts", "reward": "sevens", "env": "tools"}
    choices = _option_choices()
    extra = []
    args = []
    for pname, ptype in params:
        if ptype in by_type:
            args.append(by_type[ptype])
            if ptype == "env":
                extra.append(f"env tools = {ENV}")
    scalars = {"batch": 2, "draw_batch": 2, "group": group, "max_tokens": max_tokens, "lr": 1e-3,
               "micro_batch": _pick(rng, (2, 8)), "max_turns": 2, "overlong_buffer": max(1, max_tokens // 2)}
    for pname, _ in params:
        if pname in scalars:
            args.append(f"{pname} = {_lit(scalars[pname])}")
        elif pname in choices and rng.random() < 0.5:
            args.append(f"{pname} = {_lit(_pick(rng, choices[pname]))}")
        elif pname in ("kl", "kl_coef") and rng.random() < 0.5:
            args.append(f"{pname} = {_pick(rng, ('0.0', '0.01'))}")
        elif pname in ("tis", "mis") and rng.random() < 0.2:
            args.append(f"{pname} = 2.0")
    # imported as `algo`: a stdlib flow may share its name with a built-in op (`rloo`, E127)
    return f"algo.{name}({', '.join(args)})", extra


def _bind(spec, values: dict[str, str], by_name: dict[str, str]) -> list[str]:
    """Positional arguments of op ``spec``: each data argument gets the value carrying its fields."""
    out = []
    for arg in spec.args:
        if arg.name in by_name:
            out.append(by_name[arg.name])
        elif arg.type == "data":
            need = next(iter(sorted(arg.needs)), "response_ids")
            if need not in values:
                return []
            out.append(values[need])
        elif arg.optional:
            break
        else:
            return []
    return out


def _required(rng: random.Random, spec, known: dict) -> list[str]:
    """``name = value`` for the op's required options and, sometimes, its enumerated ones."""
    out = []
    for name, kw in spec.kwargs.items():
        if name in known and (kw.required or rng.random() < 0.5):
            out.append(f"{name} = {_lit(known[name])}")
        elif kw.required:
            value = draw_option(rng, name, kw)
            out.append(f"{name} = {_lit(min(value, known.get('max_tokens', value)) if name == 'buffer' else value)}")
        elif kw.choices and rng.random() < 0.5:
            out.append(f"{name} = {_lit(_pick(rng, kw.choices))}")
    return out


def chain(rng: random.Random, group: int, max_tokens: int) -> tuple[str, str]:
    """A hand-assembled op chain (its statements) and the advantage op it uses."""
    known = {"group": group, "max_tokens": max_tokens, "size": 0, "max_draws": 2}
    lines = ["prompt_batch = sample(prompts, size = 2)",
             f"rollouts = generate(policy, prompt_batch, n = {group}, max_tokens = {max_tokens}, "
             f"temperature = {_pick(rng, ('1.0', '0.7'))})",
             "scores = sevens(rollouts)"]
    values = {f: "rollouts" for f in OPS["generate"].produces} | {"rewards": "scores"}
    for op in sorted((o for o in OPS.values() if o.kind == OpKind.FILTER), key=lambda o: o.name):
        if rng.random() < 0.3:
            args = _bind(op, values, {})
            if args:
                lines.append(f"kept = {op.name}({', '.join(args + _required(rng, op, known))})")
                values = {f: "kept" for f in values} | {f: "kept" for f in op.produces}
    advantage_ops = sorted((o for o in OPS.values() if o.kind == OpKind.ADVANTAGE), key=lambda o: o.name)
    adv_op = _pick(rng, [o for o in advantage_ops if "advantages" in o.produces])
    shapers = [o for o in advantage_ops if "rewards" in o.produces and rng.random() < 0.3]
    policy_losses = sorted(k for k, s in LOSSES.items() if s.model_role == "trainable")
    loss = LOSSES[_pick(rng, policy_losses)]
    kl = _pick(rng, (0.0, 0.0, 0.01))
    needs_logprobs = any("logprobs" in a.needs for o in shapers for a in o.args)
    if loss.needs_old == "logprobs" or kl > 0 or needs_logprobs:
        lines.append(f"old_lp = logprobs(policy, {values['response_mask']})")
    if kl > 0 or needs_logprobs:
        lines += ["ref = frozen(policy)", f"ref_lp = logprobs(ref, {values['response_mask']})"]
    for i, op in enumerate(shapers):
        args = _bind(op, values, {"logprobs": "old_lp", "ref_logprobs": "ref_lp"})
        if args:
            lines.append(f"shaped{i} = {op.name}({', '.join(args + _required(rng, op, known))})")
            values = values | {f: f"shaped{i}" for f in op.produces if f != "token_rewards"}
    critic_loss = None
    if any("values" in a.needs for a in adv_op.args):
        lines += ["critic_m = critic(policy)", f"vals = values(critic_m, {values['response_mask']})"]
        values = values | {"values": "vals"}
        critic_loss = next(k for k, s in sorted(LOSSES.items()) if s.model_role == "critic" and s.needs_old == "values")
    args = _bind(adv_op, values, {})
    lines.append(f"adv = {adv_op.name}({', '.join(args + _required(rng, adv_op, known))})")
    loss_args = ", ".join(f"{n} = {_lit(_pick(rng, kw.choices))}" for n, kw in loss.params
                          if kw.choices and rng.random() < 0.5)
    update = OPS["update"].kwargs
    update_args = [values["response_mask"], "adv"]
    if loss.needs_old == "logprobs" or kl > 0:
        update_args.append("old_lp")
    if kl > 0:
        update_args.append("ref_lp")
    opts = [f"loss = {loss.name}({loss_args})", f"kl = {kl}", "lr = 1e-3", f"micro_batch = {_pick(rng, (2, 8))}"]
    if rng.random() < 0.5:
        opts.append(f"kl_kind = {_lit(_pick(rng, update['kl_kind'].choices))}")
    if rng.random() < 0.2:
        opts.append(f"tis = 2.0, is_level = {_lit(_pick(rng, update['is_level'].choices))}")
    lines.append(f"update(policy, {', '.join(update_args)}, {', '.join(opts)})")
    if critic_loss and "returns" in adv_op.produces:
        lines.append(f"update(critic_m, {values['response_mask']}, adv, vals, loss = {critic_loss}(), lr = 1e-3)")
    return "\n  ".join(lines), adv_op.name


# ---- the schedule -------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout(rng: random.Random, engine: str, gpus: int) -> str:
    """``ENGINE(axes..., options...)`` over ``gpus`` GPUs: the record's axes (dp left out half the
    time, to fill the pool) and some of its options."""
    spec = ENGINES[engine]
    left, parts = gpus, []
    for axis in AXES:
        if axis not in spec.axes or axis == "dp":
            continue
        size = _pick(rng, _divisors(left)) if rng.random() < 0.6 else 1
        if size > 1 or rng.random() < 0.3:
            parts.append(f"{axis} = {size}")
        left //= size
    if "dp" in spec.axes and rng.random() < 0.5:
        parts.append(f"dp = {left}")
    for name, kw in sorted(spec.options.items()):
        if rng.random() < 0.3:
            value = draw_option(rng, name, kw)
            if value is not None:
                parts.append(f"{name} = {_lit(value)}")
    return f"{engine}({', '.join(parts)})"


def resync(rng: random.Random, colocated: bool = False) -> str:
    """A resync statement; for colocated engines, half of the time a protocol of the local route
    (some run nowhere else: ``cuda_ipc``), so that every protocol is drawn where it can be planned."""
    names = sorted(PROTOCOLS)
    if colocated and rng.random() < 0.5:
        names = [n for n in names if "local" in PROTOCOLS[n].routes]
    name = _pick(rng, names)
    opts = []
    for opt, kw in sorted(PROTOCOLS[name].options.items()):
        if rng.random() < 0.4 and kw.type != "str":
            value = draw_option(rng, opt, kw)
            opts.append(f"{opt} = {_size(value)}")
    every = f" every {_pick(rng, (1, 2))}" if rng.random() < 0.3 else ""
    return f"resync policy via {name}({', '.join(opts)}){every}"


def schedule(rng: random.Random, gpus_choices: tuple[str, ...], max_nodes: int, max_per_node: int,
             has_ref: bool) -> tuple[str, int, int, str]:
    """A schedule block for flow ``main``, and its cluster (nodes, GPUs per node, gpu)."""
    nodes = rng.randint(1, max_nodes)
    per = _pick(rng, [g for g in (1, 2, 4) if g <= max_per_node])
    # half of the clusters are CPU ones (what tests run; some protocols run only there), the rest any profile
    gpu = "cpu" if "cpu" in gpus_choices and rng.random() < 0.5 else _pick(rng, gpus_choices)
    cluster = f"cluster(nodes = {nodes}, gpus_per_node = {per}, gpu = {_lit(gpu)})"
    if rng.random() < 0.1:
        return f"schedule main auto on {cluster} {{ staleness <= {rng.randint(1, 3)} }}\n", nodes, per, gpu
    total = nodes * per
    lines = []
    # On several nodes the pools are mostly separate, the trainer's within a node (a tensor-parallel
    # group must stay within one: E429).
    separate = total >= 2 and rng.random() < (0.8 if nodes > 1 else 0.5)
    colocated = False
    if separate:
        if nodes == 1:
            gen = _pick(rng, range(1, total))
            train, gen_nodes = total - gen, 1
        else:  # the trainer's pool first, within node 0; the rollout pool on node 1 or across both
            train = _pick(rng, _divisors(per))
            spans = [per - train] if train < per else []
            gen, gen_nodes = _pick(rng, [(per, 1)] + [(2 * s, 2) for s in spans])
        pools = [("train", train, 1), ("gen", gen, gen_nodes)]
        if rng.random() < 0.3:
            pools.reverse()  # declaration order decides which GPUs a pool takes
        for name, n, k in pools:
            span = f", nodes = {k}" if k > 1 else ""
            lines.append(f"pool {name} = gpus(gpus = {n}{span})")
        lines.append("place policy.rollout on gen")
        lines.append("colocate policy.train, ref on train" if has_ref else "place policy.train on train")
        train_gpus, gen_gpus = train, gen
    else:
        train_gpus = gen_gpus = total
        colocated = rng.random() < 0.5
        if colocated:
            lines.append("colocate policy.train, policy.rollout")
    if rng.random() < 0.8:
        lines.append(f"policy.train = {layout(rng, _pick(rng, engines_serving('train')), train_gpus)}")
    if rng.random() < 0.8:
        lines.append(f"policy.rollout = {layout(rng, _pick(rng, engines_serving('rollout')), gen_gpus)}")
    if rng.random() < 0.7:
        lines.append(f"staleness {_pick(rng, (0, 1, 1, 2, 2, 2, 3, 3, 3, 3))}")  # 0 is refused (E408)
    if rng.random() < 0.7:
        lines.append(resync(rng, colocated))
    for call, kwargs in sorted(SCHED_CALLS.items()):
        if rng.random() < 0.25:
            opts = ", ".join(f"{k} = {_lit(draw_option(rng, k, kw))}" for k, kw in sorted(kwargs.items())
                             if rng.random() < 0.7)
            lines.append(f"{call}({opts})")
    body = "".join(f"  {line}\n" for line in lines)
    return f"schedule main on {cluster} {{\n{body}}}\n", nodes, per, gpu


def reward(rng: random.Random, header: Header) -> tuple[str, list[str]]:
    """A reward of the catalogue (any ``OpKind.REWARD_FN`` op) and the declarations it needs: a
    Python function is the header's, a named one a choice of its argument, a model one over a
    second model like the policy."""
    op = _pick(rng, sorted((o for o in OPS.values() if o.kind == OpKind.REWARD_FN), key=lambda o: o.name))
    if op.python_ref:
        return header.reward, []
    args, extra = [], []
    for arg in op.args:
        if arg.type == "model":
            args.append("rm")
            extra = [f"model rm = {header.model}"]
        elif getattr(arg, "choices", ()):
            args.append(_lit(_pick(rng, arg.choices)))
        else:
            return header.reward, []
    return f"{op.name}({', '.join(args)})", extra


def draw(rng: random.Random, header: Header, *, gpus: tuple[str, ...] = CLUSTER["gpu"].choices,
         max_nodes: int = 2, max_per_node: int = 4, rewards: bool = False) -> Drawn:
    """One flow file's text (``main`` and its schedule), drawn with ``rng``; ``rewards``: the reward
    is drawn from the catalogue, else the header's."""
    group = _pick(rng, (1, 2, 2, 2, 4, 4, 4, 2))  # groups of one are refused by group-wise ops (E208, E218)
    max_tokens = _pick(rng, (4, 8))
    reward_decl, extra = reward(rng, header) if rewards and rng.random() < 0.4 else (header.reward, [])
    if rng.random() < 0.5:
        name, params = _pick(rng, stdlib_flows())
        call, more = stdlib_call(rng, name, params, group, max_tokens)
        extra += more
        body, kind, imports = call, f"stdlib:{name}", f"import stdlib.{name} as algo\n"
        has_ref = name in stdlib_refs()  # placing a `ref` the flow lacks is refused (E402)
    else:
        body, adv = chain(rng, group, max_tokens)
        kind, imports, has_ref = f"chain:{adv}", "", "ref = frozen" in body
    if rng.random() < 0.85:
        sched, nodes, per, gpu = schedule(rng, gpus, max_nodes, max_per_node, has_ref and rng.random() < 0.8)
    else:
        sched, nodes, per, gpu = "", 1, 1, "cpu"
    decls = "".join(f"{d}\n" for d in extra)
    text = (f"{imports}model policy = {header.model}\ndataset prompts = {header.dataset}\n"
            f"reward sevens = {reward_decl}\n{decls}"
            f"flow main(steps: int = 1, eval_every: int = 0) {{\n  {body}\n}}\n{sched}")
    return Drawn(text, nodes, per, gpu, kind)


def tiny_model(rng: random.Random) -> str:
    """A ``tiny(...)`` declaration with options drawn from its record (random weights: no SFT)."""
    spec = OPS["tiny"].kwargs
    arch = _pick(rng, spec["arch"].choices)
    heads = _pick(rng, (2, 4))
    return f'tiny(task = "arith", warm_start = 0, arch = "{arch}", heads = {heads}, kv_heads = {_pick(rng, _divisors(heads))})'


__all__ = ["Header", "Drawn", "draw", "tiny_model", "stdlib_flows", "ENV"]
