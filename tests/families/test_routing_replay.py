"""Routing replay (R3) on the tiny Qwen3-MoE: the torch trainer routes each token by given experts
(flowrl.engines.route_replay), vLLM returns the experts it routed each token to (router hooks on
CPU), and a trainer replaying vLLM's routes computes vLLM's routing exactly.

The compiler's side (the `routing` option, where it is refused) is in tests/compiler/test_routing.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from family_cases import PROMPTS, build_family, max_gap, pg_loss
from flowrl.engines.base import EngineConfigError
from flowrl.engines.route_replay import moe_routers, replayed_routes, router_top_k
from flowrl.engines.torch_train import OptimConfig, TorchTrainEngine
from flowrl.engines.types import ROUTES, Completion, SamplingSpec, TokenBatch


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    return build_family("qwen3_moe", tmp_path_factory.mktemp("r3") / "m")


def _batch(routes: torch.Tensor | None = None) -> TokenBatch:
    rows = [p + [7, 8, 9, 10][: 2 + i % 3] for i, p in enumerate(PROMPTS)]
    batch = TokenBatch.from_rows(rows, pad_id=0)
    batch.response_mask[:, 5:] = batch.attention_mask[:, 5:].float()
    if routes is not None:
        batch.extras[ROUTES] = routes
    return batch


def native_top_k(model, batch: TokenBatch) -> torch.Tensor:
    """The experts the model's own routers pick: [B, T, L, k]."""
    return router_top_k(model, batch.input_ids, batch.attention_mask)


def forced_logprobs(model, batch: TokenBatch, routes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``batch`` with each router's forward replaced by one that picks ``routes`` (written
    here independently of route_replay: weights = softmax of the logits at the forced experts,
    renormalised; -1: the router's own top-k), and per token the layers whose forced experts are not
    the router's own top-k."""
    originals = {}
    differ = torch.zeros(batch.input_ids.shape)
    for layer, router in enumerate(moe_routers(model)):
        def forward(hidden, router=router, layer=layer):
            logits = torch.nn.functional.linear(hidden.reshape(-1, router.hidden_dim), router.weight)
            given = routes[:, :, layer].reshape(-1, router.top_k).long()
            own = torch.topk(logits, router.top_k, -1).indices
            experts = torch.where(given < 0, own, given)  # -1: the router's own choice
            differ.add_((own.sort(-1).values != experts.sort(-1).values).any(-1).view(differ.shape).float())
            weights = torch.softmax(logits.float(), -1).gather(-1, experts)
            return logits, (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), experts
        originals[router] = router.forward
        router.forward = forward
    try:
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    finally:
        for router, fwd in originals.items():
            router.forward = fwd
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros(lp.shape[0], 1), lp], 1) * batch.attention_mask, differ * batch.attention_mask


def test_replaying_the_routers_own_choice_changes_nothing(moe_path):
    trainer = TorchTrainEngine(moe_path)
    native = trainer.forward(_batch())
    routes = native_top_k(trainer.model, _batch())
    assert routes.shape[2:] == (2, 2)
    replayed = trainer.forward(_batch(routes.to(torch.int16)))
    assert torch.allclose(replayed["logprobs"], native["logprobs"], atol=1e-6)
    assert float(replayed["routes_differ"].sum()) == 0 and "routes_differ" not in native


def test_forced_routes_reproduce_a_forward_routed_by_them(moe_path):
    """Routes that differ from the router's own (each expert id + 1 mod 8) move the log-probs, to what
    a forward forced onto those experts computes, which counts the same differing (token, layer) routes
    (in layer 1 against the router's choice on layer 0's forced output); -1 (no route) keeps the
    trainer's own routing there."""
    trainer = TorchTrainEngine(moe_path)
    batch = _batch()
    native = native_top_k(trainer.model, batch)
    forced = (native + 1) % 8
    out = trainer.forward(_batch(forced.to(torch.int16)))
    expected, differ = forced_logprobs(trainer.model, batch, forced)
    assert torch.allclose(out["logprobs"], expected, atol=1e-5)
    moved = (out["logprobs"] - trainer.forward(batch)["logprobs"]).abs().max()
    assert moved > 0.05, moved
    assert torch.equal(out["routes_differ"], differ)
    assert torch.equal(out["routes_differ"][:, :5], 2.0 * batch.attention_mask[:, :5].float())  # equal prompts
    partial = forced.clone()
    partial[:, 6:] = -1  # positions 6.. route natively
    got = trainer.forward(_batch(partial.to(torch.int16)))
    assert torch.allclose(got["logprobs"], forced_logprobs(trainer.model, batch, partial)[0], atol=1e-5)
    assert float(got["routes_differ"][:, 6:].sum()) == 0


def test_replayed_update_trains_the_router(moe_path):
    """Under replay the mixing weights come from the router's logits: the router still gets gradients."""
    trainer = TorchTrainEngine(moe_path, optim=OptimConfig(lr=1e-2))
    batch = _batch()
    batch = _batch((native_top_k(trainer.model, batch) + 3).remainder(8).to(torch.int16))
    batch.extras["rollout_logprobs"] = torch.zeros(batch.input_ids.shape)
    router = moe_routers(trainer.model)[0].weight
    before = router.detach().clone()
    trainer.train_step(batch, pg_loss, micro_batch_size=4)
    assert not torch.equal(before, router.detach())


def test_routes_of_the_wrong_shape_are_refused(moe_path):
    trainer = TorchTrainEngine(moe_path)
    batch = _batch()
    bad = torch.zeros(*batch.input_ids.shape, 3, 2, dtype=torch.int16)  # 3 layers for a 2-layer model
    with pytest.raises(EngineConfigError, match="model with 2 MoE layers"):
        trainer.forward(_batch(bad))
    with pytest.raises(EngineConfigError, match="expert id >= 8"):
        trainer.forward(_batch(torch.full((*batch.input_ids.shape, 2, 2), 8, dtype=torch.int16)))
    dense = TorchTrainEngine(build_family("llama", Path(trainer.model.config._name_or_path).parent / "dense"))
    with pytest.raises(EngineConfigError, match="model with 0 MoE layers"):
        with replayed_routes(dense.model, bad, torch.zeros(batch.input_ids.shape)):
            pass


def test_completions_routes_pad_into_the_batch():
    import numpy as np

    a = Completion((1, 2), (3,), (-0.1,), "stop", routed_experts=np.array([[[0, 1]], [[2, 3]], [[-1, -1]]]))
    b = Completion((1,), (3,), (-0.2,), "stop", routed_experts=np.array([[[4, 5]], [[-1, -1]]]))
    routes = TokenBatch.from_completions([a, b], pad_id=0).extras[ROUTES]
    assert routes.shape == (2, 3, 1, 2) and routes.dtype == torch.int16
    assert routes[1].tolist() == [[[4, 5]], [[-1, -1]], [[-1, -1]]]
    with pytest.raises(ValueError, match="some completions carry routed experts"):
        TokenBatch.from_completions([a, Completion((1,), (3,), (-0.2,), "stop")], pad_id=0)


# ---- vLLM's routes ------------------------------------------------------------------------------------

SPEC = SamplingSpec(n=2, temperature=1.0, max_tokens=12, seed=5, routes=True)


def _differing(routes: torch.Tensor, own: torch.Tensor, attention_mask: torch.Tensor) -> tuple[int, int]:
    """(token-layers whose routes differ from ``own`` as sets, token-layers with a route)."""
    has = (routes[..., 0] >= 0) & attention_mask.bool()[..., None]
    differ = (routes.long().sort(-1).values != own.sort(-1).values).any(-1) & has
    return int(differ.sum()), int(has.sum())


def test_vllm_returns_the_experts_it_routed_each_token_to(moe_path):
    """vLLM's routes (its routers' own ids, captured on CPU) for every prompt and response token but the
    last; in fp32 they are the trainer's own top-k, and the trainer replaying them matches vLLM."""
    pytest.importorskip("vllm")
    from flowrl.engines.vllm_engine import VLLMRolloutEngine

    rollout = VLLMRolloutEngine(moe_path, dtype="float32", max_model_len=64)
    try:
        routed = [c for g in rollout.generate(PROMPTS, SPEC) for c in g]
        plain = [c for g in rollout.generate(PROMPTS, replace(SPEC, routes=False)) for c in g]
    finally:
        rollout.shutdown()
    assert [c.response_ids for c in routed] == [c.response_ids for c in plain]  # recording changes nothing
    assert all(c.routed_experts is None for c in plain)
    for c in routed:
        n = len(c.prompt_ids) + len(c.response_ids)
        assert c.routed_experts.shape == (n, 2, 2)
        assert (c.routed_experts[:-1] >= 0).all() and (c.routed_experts[-1] == -1).all()  # last: never forwarded
    batch = TokenBatch.from_completions(routed, pad_id=0)
    trainer = TorchTrainEngine(moe_path)
    differ, total = _differing(batch.extras[ROUTES], native_top_k(trainer.model, batch), batch.attention_mask)
    out = trainer.forward(batch)
    gap = max_gap(out["logprobs"], batch)
    print(f"\nvLLM fp32 routes: {differ} of {total} token-layers differ from the trainer's; replayed gap {gap}")
    assert total == sum(2 * (len(c.prompt_ids) + len(c.response_ids) - 1) for c in routed)
    assert differ == 0 and float(out["routes_differ"].sum()) == 0
    assert gap[0] <= 1e-4


def shift_vllm_routes(worker, shift: int) -> int:
    """Run in vLLM's worker: each MoE layer's router picks, for every token, its own experts' ids +
    ``shift`` (mod the experts), weighted by the softmax of the router logits there, renormalised (the
    rule the trainer replays by); ``shift = 0`` restores vLLM's own routing. Returns the layers changed."""
    changed = 0
    for module in worker.model_runner.model.modules():
        router = getattr(module, "router", None)
        if not hasattr(router, "_routing_replay_out"):
            continue
        changed += 1
        if shift == 0:
            router.__dict__.pop("select_experts", None)
            continue
        own = type(router).select_experts

        def select(hidden_states, router_logits, topk_indices_dtype=None, *, input_ids=None, router=router, own=own):
            weights, ids = own(router, hidden_states, router_logits, topk_indices_dtype, input_ids=input_ids)
            ids = ((ids.long() + shift) % router_logits.shape[-1]).to(ids.dtype).contiguous()
            chosen = torch.softmax(router_logits.float(), -1).gather(-1, ids.long())
            weights = (chosen / chosen.sum(-1, keepdim=True)).to(weights.dtype).contiguous()
            if router._routing_replay_out is not None:
                router._routing_replay_out[: ids.shape[0]].copy_(ids.to(torch.int16))
            return weights, ids

        router.select_experts = select
    return changed


def test_the_trainer_replaying_forced_routes_matches_vllm_routed_by_them(moe_path):
    """vLLM forced to route every token to other experts than its router's top-2 (each id + 1): the
    routes it returns are those, the trainer's own routing is then nats off vLLM's log-probs, and the
    trainer replaying vLLM's routes matches them to 1e-4."""
    pytest.importorskip("vllm")
    from flowrl.engines.vllm_engine import VLLMRolloutEngine

    rollout = VLLMRolloutEngine(moe_path, dtype="float32", max_model_len=64)
    try:
        assert rollout.llm.collective_rpc(shift_vllm_routes, args=(1,)) == [2]
        forced = [c for g in rollout.generate(PROMPTS, SPEC) for c in g]
        rollout.llm.collective_rpc(shift_vllm_routes, args=(0,))
    finally:
        rollout.shutdown()
    batch = TokenBatch.from_completions(forced, pad_id=0)
    trainer = TorchTrainEngine(moe_path)
    replayed = max_gap(trainer.forward(batch)["logprobs"], batch)
    routes = batch.extras.pop(ROUTES)
    native = max_gap(trainer.forward(batch)["logprobs"], batch)
    differ, total = _differing(routes, native_top_k(trainer.model, batch), batch.attention_mask)
    print(f"\nforced vLLM routes: {differ} of {total} differ from the trainer's own; native gap {native}, "
          f"replayed {replayed}")
    assert differ >= total // 2  # every token of layer 0 (layer 1: most, its input moved too)
    assert native[0] > 0.1 and replayed[0] <= 1e-4


# ---- through the whole stack ---------------------------------------------------------------------------

FLOW = """import stdlib.grpo

model policy = tiny(task = "arith", arch = "qwen3_moe", warm_start = 0)
dataset arith = jsonl("{data}")
reward exact = verifier("math")

flow main(steps: int = 3, eval_every: int = 0) {{
  grpo(policy, arith, exact, batch = 4, group = 2, max_tokens = 6, lr = 5e-4, kl = 0.0, micro_batch = 8,
       routing = "replay")
}}

schedule main on cluster(nodes = 1, gpus_per_node = 1) {{
  colocate policy.train, policy.rollout, ref on all
  policy.train = torch()
  policy.rollout = vllm(tp = 1)
  resync policy via inplace() every 1
}}
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grpo_with_routing_replay_through_ray_and_vllm(tmp_path, monkeypatch):
    """3 GRPO steps with routing = "replay": vLLM records every token's experts, the trainer's update
    (whose first forward is the old policy's: the old-logprob pass is elided) replays them, and after
    every resync the mismatch is the fp32 level; metrics.jsonl counts the replayed token-layers."""
    pytest.importorskip("vllm")
    pytest.importorskip("ray")
    from flowrl.launch import run_file

    root = Path(__file__).resolve().parents[2]
    monkeypatch.syspath_prepend(str(root / "tests" / "runtime"))
    from e2e_kit import shared_ray  # one local Ray instance for the in-process runs of every module

    (tmp_path / "stdlib").symlink_to(root / "stdlib")
    (tmp_path / "r3.flow").write_text(FLOW.format(data=root / "data/arith/train.jsonl"))
    result = run_file(str(tmp_path / "r3.flow"), steps=3, out=str(tmp_path / "run"), ray_address=shared_ray())
    plan = json.loads((result.out / "plan.json").read_text())
    generate = next(o for o in plan["ops"] if o["kind"] == "generate")
    assert ROUTES in generate["fields"]
    assert len(result.rows) == 3
    for row in result.rows:
        # prompt + response tokens but each sequence's last, x 2 layers, for 4 x 2 completions
        assert row["routing/replayed"] >= 2 * 8 * 6, row
        assert 0 <= row["routing/differ"] <= row["routing/replayed"]
        assert row["mismatch/abs_max"] < 1e-4, row


def test_vllms_gpu_routes_pad_to_the_completion():
    """``CompletionOutput.routed_experts`` (GPUs) covers the tokens vLLM forwarded: [P + R - 1, L, k]
    pads to the completion with -1 at the last token; a shape that fits no completion is an error."""
    import numpy as np

    from flowrl.engines.base import EngineError
    from flowrl.engines.vllm_engine import native_routes

    c = Completion((1, 2, 3), (4, 5), (-0.1, -0.2), "stop")
    routes = native_routes(c, np.arange(16).reshape(4, 2, 2), layers=2)
    assert routes.shape == (5, 2, 2) and routes[:4].flatten().tolist() == list(range(16))
    assert (routes[4] == -1).all()
    with pytest.raises(EngineError, match=r"expected \[4 or 5, 2, k\]"):
        native_routes(c, np.zeros((3, 2, 2)), layers=2)
    with pytest.raises(EngineError, match="returned no routed_experts"):
        native_routes(c, None, layers=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU: vLLM's enable_return_routed_experts "
                                                          "does not start on CPU (Model Runner V2 needs Triton)")
def test_vllm_on_a_gpu_returns_routes_itself(moe_path):
    """On a GPU vLLM returns the routes (enable_return_routed_experts): every token but the last has one,
    and the trainer replaying them matches vLLM's log-probs (fp32)."""
    pytest.importorskip("vllm")
    from flowrl.engines.vllm_engine import VLLMRolloutEngine

    rollout = VLLMRolloutEngine(moe_path, dtype="float32", max_model_len=64)
    try:
        assert rollout._native_routes
        routed = [c for g in rollout.generate(PROMPTS, SPEC) for c in g]
    finally:
        rollout.shutdown()
    for c in routed:
        assert (c.routed_experts[:-1] >= 0).all()
    batch = TokenBatch.from_completions(routed, pad_id=0)
    trainer = TorchTrainEngine(moe_path, device="cuda")
    assert max_gap(trainer.forward(batch)["logprobs"], batch)[0] <= 1e-4


def test_routes_survive_dynamic_sampling_rows():
    """filter_groups joins the kept rows of several draws: routes [B, T, L, k] pad along T with -1."""
    from flowrl.runtime.redraw import gather_rows
    from flowrl.runtime.step import Rollouts, StepValue

    def value(width: int, fill: int) -> StepValue:
        batch = TokenBatch.from_rows([[1] * width, [2] * width], pad_id=0)
        batch.extras[ROUTES] = torch.full((2, width, 2, 2), fill, dtype=torch.int16)
        return StepValue({ROUTES: batch.extras[ROUTES]}, Rollouts("m", batch, ("a", "b")))

    out = gather_rows([(value(3, 5), torch.tensor([1])), (value(5, 6), torch.tensor([0]))], pad_id=0)
    routes = out.rollouts.batch.extras[ROUTES]
    assert routes.shape == (2, 5, 2, 2) and out[ROUTES] is routes
    assert (routes[0, :3] == 5).all() and (routes[0, 3:] == -1).all() and (routes[1] == 6).all()
