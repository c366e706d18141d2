"""The resharding plan in the ExecutionPlan is exact: applying its pieces to real tensors gives
the destination layout.

Source and destination shards are built here straight from the checkpoint (HF) tensors
with torch (chunk / cat / view), following each engine's documented layout, independently
of ``flowrl.compiler.reshard``'s segment tables; the plan's pieces are then copied from
source shards into empty destination shards and compared exactly. TP=2 -> TP=1 and
TP=1 -> TP=2 are covered, plus fused QKV with grouped-query attention (Megatron's
per-group interleave vs vLLM's per-rank concatenation, KV heads replicated when tp > KV
heads), fused gate/up, row-parallel and vocab-parallel tensors with a vocabulary that does
not divide by tp, and a mixture of experts (each expert's gate/up and down, the router replicated).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from flowrl.catalog.engines import ENGINES  # noqa: E402
from flowrl.catalog.models import ModelFacts, tiny_facts  # noqa: E402
from flowrl.compiler.reshard import reshard_plan  # noqa: E402

GQA = ModelFacts("gqa", hidden=64, layers=4, heads=8, kv_heads=2, intermediate=96, vocab=37, tied=False,
                 qkv_bias=True, dtype_bytes=4)
"""8 query heads in 2 KV groups (head dim 8), a bias on q/k/v, a vocabulary of 37 (prime)."""
MOE = ModelFacts("moe", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96, vocab=37, dtype_bytes=4,
                 experts=4, experts_per_token=2, expert_intermediate=48, moe_layers=2)
"""Every layer a mixture of 4 experts of width 48 (``{e}`` in the tensor names: one expert's values)."""
REPLICATED = ("norm.weight", "mlp.gate.weight")
"""Tensors every rank holds whole: the norms, a MoE layer's router."""


def hf_tensors(f: ModelFacts, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in f.tensors()}


def _rows(t: torch.Tensor, tp: int, pad: int = 1) -> list[torch.Tensor]:
    """Vocab-parallel split of dim 0: the vocabulary padded to a multiple of ``pad`` (vLLM: 64), then
    ceil(padded / tp) rows per rank, the last rank shorter (or empty)."""
    per = -(-(-(-t.shape[0] // pad) * pad) // tp)
    return [t[r * per:(r + 1) * per] for r in range(tp)]


def shards(f: ModelFacts, engine: str, tp: int, hf: dict) -> dict[str, list[torch.Tensor]]:
    """Tensor name -> one tensor per tp rank, as ``engine`` holds it (``{i}`` names, layer 0's values)."""
    lay = lambda part: hf[f"model.layers.{{i}}.{part}"]  # noqa: E731
    hd, heads, kv = f.hd, f.heads, f.kv_heads
    if engine in ("torch", "fsdp", "hf_generate"):
        return {name: [t] for name, t in hf.items()}
    names = ENGINES[engine].weight_layout.names
    out: dict[str, list[torch.Tensor]] = {}
    for suffix in (".weight", ".bias") if f.qkv_bias else (".weight",):
        q, k, v = lay("self_attn.q_proj" + suffix), lay("self_attn.k_proj" + suffix), lay("self_attn.v_proj" + suffix)
        if engine == "megatron":  # [q_g; k_g; v_g] per KV group, groups split over ranks
            qg = q.reshape(kv, heads // kv * hd, *q.shape[1:])
            kg, vg = k.reshape(kv, hd, *k.shape[1:]), v.reshape(kv, hd, *v.shape[1:])
            fused = torch.cat([qg, kg, vg], dim=1)  # [kv, group rows, ...]
            per = kv // tp
            out[names["qkv"] + suffix] = [fused[r * per:(r + 1) * per].reshape(-1, *q.shape[1:]) for r in range(tp)]
        else:  # vLLM: [q heads of the rank; the rank's KV heads (replicated when tp > kv)]
            ranks = []
            for r in range(tp):
                qs = q[r * heads // tp * hd:(r + 1) * heads // tp * hd]
                if tp <= kv:
                    ks = k[r * kv // tp * hd:(r + 1) * kv // tp * hd]
                    vs = v[r * kv // tp * hd:(r + 1) * kv // tp * hd]
                else:
                    h = r // (tp // kv)
                    ks, vs = k[h * hd:(h + 1) * hd], v[h * hd:(h + 1) * hd]
                ranks.append(torch.cat([qs, ks, vs]))
            out[names["qkv"] + suffix] = ranks
    mlps = [("gate_up", "down", "mlp.")] if f.moe_layers < f.layers else []
    mlps += [("expert_gate_up", "expert_down", "mlp.experts.{e}.")] if f.moe_layers else []
    for gate_up, down, prefix in mlps:
        gate, up = lay(prefix + "gate_proj.weight"), lay(prefix + "up_proj.weight")
        out[names[gate_up] + ".weight"] = [torch.cat([g_, u_]) for g_, u_ in zip(gate.chunk(tp), up.chunk(tp))]
        out[names[down] + ".weight"] = list(lay(prefix + "down_proj.weight").chunk(tp, dim=1))
    out[names["o"] + ".weight"] = list(lay("self_attn.o_proj.weight").chunk(tp, dim=1))
    pad = ENGINES[engine].weight_layout.vocab_pad
    out[names["embed"] + ".weight"] = _rows(hf["model.embed_tokens.weight"], tp, pad)
    if not f.tied:
        out[names["lm_head"] + ".weight"] = _rows(hf["lm_head.weight"], tp, pad)
    return out


def apply(plan, src: dict[str, list[torch.Tensor]], like: dict[str, list[torch.Tensor]]):
    """Copy every piece of ``plan`` from ``src`` shards into zeroed shards shaped like ``like``."""
    out = {name: [torch.zeros_like(t) for t in ranks] for name, ranks in like.items()}
    for t in plan.tensors:
        if t.dim < 0:
            continue  # replicated norms: copied whole
        for p in t.pieces:
            s = src[p.src_name][p.src_rank].narrow(t.dim, p.src_start, p.src_stop - p.src_start)
            out[t.name][p.dst_rank].narrow(t.dim, p.dst_start, p.dst_stop - p.dst_start).copy_(s)
    return out


CASES = [
    (tiny_facts({}), "megatron", 2, "vllm", 1),      # TP=2 -> TP=1 (the case)
    (tiny_facts({}), "megatron", 1, "vllm", 2),      # TP=1 -> TP=2
    (GQA, "megatron", 2, "vllm", 1),
    (GQA, "megatron", 1, "vllm", 2),
    (GQA, "megatron", 2, "vllm", 4),                 # vLLM replicates the 2 KV heads over 4 ranks
    (GQA, "megatron", 2, "vllm", 2),                 # same tp, different fusion: regroup only
    (GQA, "fsdp", 1, "vllm", 2),                     # unfused checkpoint names -> fused shards
    (GQA, "megatron", 2, "hf_generate", 1),          # fused shards -> unfused checkpoint names
    (GQA, "megatron", 2, "sglang", 8),
    (MOE, "torch", 1, "vllm", 2),                    # each expert's checkpoint tensors -> vLLM's stacked experts
    (MOE, "megatron", 2, "vllm", 1),
]


@pytest.mark.parametrize("f,src_engine,src_tp,dst_engine,dst_tp", CASES,
                         ids=[f"{c[0].name}-{c[1]}{c[2]}-{c[3]}{c[4]}" for c in CASES])
def test_pieces_rebuild_the_destination_exactly(f, src_engine, src_tp, dst_engine, dst_tp):
    hf = hf_tensors(f)
    src = shards(f, src_engine, src_tp, hf)
    want = shards(f, dst_engine, dst_tp, hf)
    plan = reshard_plan(f, src_engine, src_tp, 1, dst_engine, dst_tp)
    sharded = {t.name for t in plan.tensors if t.dim >= 0}
    replicated = {t.name for t in plan.tensors if t.dim < 0}
    assert sharded == {n for n in want if not n.endswith(REPLICATED)}  # every sharded tensor has a plan
    assert replicated == {n for n, _shape in f.tensors() if n.endswith(REPLICATED)}  # copied whole
    got = apply(plan, src, {n: want[n] for n in sharded})
    for name in sharded:
        for r, (a, b) in enumerate(zip(got[name], want[name])):
            assert torch.equal(a, b), f"{name} rank {r}"


@pytest.mark.parametrize("f,src_engine,src_tp,dst_engine,dst_tp", CASES[:5])
def test_every_destination_row_is_written_once(f, src_engine, src_tp, dst_engine, dst_tp):
    plan = reshard_plan(f, src_engine, src_tp, 1, dst_engine, dst_tp)
    want = shards(f, dst_engine, dst_tp, hf_tensors(f))
    for t in plan.tensors:
        if t.dim < 0:
            continue
        for r, shard in enumerate(want[t.name]):
            rows = sorted((p.dst_start, p.dst_stop) for p in t.pieces if p.dst_rank == r)
            covered = 0
            for a, b in rows:
                assert a == covered, (t.name, r, rows)  # no gap, no overlap
                covered = b
            assert covered == shard.shape[t.dim], (t.name, r)


def test_actions_name_what_happens():
    plan = reshard_plan(tiny_facts({}), "megatron", 2, 1, "vllm", 1)
    actions = {t.name: t.action for t in plan.tensors}
    assert actions["model.layers.{i}.self_attn.qkv_proj.weight"] == "regroup"
    assert actions["model.layers.{i}.mlp.gate_up_proj.weight"] == "regroup"
    assert actions["model.layers.{i}.self_attn.o_proj.weight"] == "gather"
    assert actions["lm_head.weight"] == "gather"
    assert actions["model.norm.weight"] == "copy"
    split = reshard_plan(tiny_facts({}), "fsdp", 1, 1, "vllm", 2)
    assert {t.name: t.action for t in split.tensors}["model.layers.{i}.mlp.down_proj.weight"] == "split"


def test_pipeline_stages_are_in_the_plan():
    plan = reshard_plan(GQA, "megatron", 2, 2, "vllm", 1)
    assert plan.stage_layers == (2, 2) and plan.src == "megatron(tp=2, pp=2)" and plan.dst_tp == 1
