"""Routing replay (R3) on the tiny Qwen3-MoE: the torch trainer routes each token by given experts
(flowrl.engines.route_replay), vLLM returns the experts it routed each token to (router hooks on
CPU), and a trainer replaying vLLM's routes computes vLLM's routing exactly.

The compiler's side (the `routing` option, where it is refused) is in tests/compiler/test_routing.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from family_cases import PROMPTS, build_family, max_gap, pg_loss
from flowrl.engines.base import EngineConfigError
from flowrl.engines.route_replay import moe_routers, replayed_routes
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
    """The experts the model's own routers pick: [B, T, L, k], recorded by hooks on its routers."""
    seen = []
    hooks = [r.register_forward_hook(lambda m, a, out: seen.append(out[2].detach())) for r in moe_routers(model)]
    try:
        with torch.no_grad():
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    finally:
        for h in hooks:
            h.remove()
    b, t = batch.input_ids.shape
    return torch.stack([s.view(b, t, -1) for s in seen], dim=2)


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
