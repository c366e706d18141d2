"""Routing replay (R3) in a transformers mixture of experts: the trainer's forward routes each token to
the experts the rollout engine routed it to, instead of its own router's top-k.

Routes are ``[B, T, L, k]`` integer expert ids, aligned with ``input_ids`` (position ``t`` holds the
experts token ``input_ids[b, t]`` was sent to in each of the model's ``L`` MoE layers, in layer order),
-1 where the rollout engine has no route: padding, and the last sampled token of a completion, which
vLLM samples but never forwards. Such positions keep the trainer's own routing; for the last token
this changes nothing the loss reads (its hidden states reach no later position, and no log-prob is
predicted from it).

What is replayed is the *choice* of experts. The mixing weights are still the trainer's router's:
``softmax(router logits)`` at the replayed experts, renormalised over them when the model
renormalises its top-k (``norm_topk_prob``), so the router keeps its gradient, as veRL's and
slime's R3 do (Ma et al. 2025, "Stabilizing MoE RL by aligning training and inference routers").

A router here is the module at ``model.layers.{i}.mlp.gate`` of a model whose MoE block calls it on
``hidden.view(-1, H)`` (rows in ``[B, T]`` order) and reads ``(logits, weights, experts)`` back, with
``top_k`` and ``norm_topk_prob`` attributes (transformers 5's ``Qwen3MoeTopKRouter``). A model
without such routers is refused: replaying routes into a model whose routing is not understood
would be silent nonsense.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from flowrl.engines.base import EngineConfigError

ROUTER = "mlp.gate"
"""The router's module name inside a decoder layer (``model.layers.{i}.mlp.gate``), in transformers'
models and vLLM's alike."""

NO_ROUTE = -1
"""The expert id of a position without a route (native routing there)."""


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The routers of ``model``'s MoE layers, in layer order (empty for a dense model).

    Raises :class:`EngineConfigError` for a layer whose ``mlp.gate`` is not a top-k router this
    module can replay into (no ``top_k`` / ``norm_topk_prob``)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return []
    routers = []
    for i, layer in enumerate(layers):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is None or not hasattr(getattr(layer, "mlp", None), "experts"):
            continue  # a dense layer (or a dense model's gate projection, which is `gate_proj`)
        if not (hasattr(gate, "top_k") and hasattr(gate, "norm_topk_prob")):
            raise EngineConfigError(f"layer {i}'s router ({type(gate).__name__}) is not a top-k router with "
                                    "`top_k` and `norm_topk_prob`; routing replay knows transformers' "
                                    "Qwen3-MoE-style routers only")
        routers.append(gate)
    return routers


@torch.no_grad()
def router_top_k(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The experts ``model``'s own routers pick for each token of a forward: [B, T, L, k] (native
    routing; what a rollout engine's routes are compared with)."""
    seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, a, out: seen.append(out[2].detach()))
             for r in moe_routers(model)]
    try:
        model(input_ids=input_ids, attention_mask=attention_mask)
    finally:
        for h in hooks:
            h.remove()
    b, t = input_ids.shape
    return torch.stack([s.view(b, t, -1) for s in seen], dim=2)


@contextmanager
def replayed_routes(model: nn.Module, routes: torch.Tensor, differ: torch.Tensor) -> Iterator[None]:
    """Within the block, every forward of ``model`` on a ``[B, T]`` batch routes by ``routes``.

    ``routes``: [B, T, L, k] expert ids (``NO_ROUTE`` where native routing applies). ``differ``: a
    [B, T] float tensor the hooks add to: per token, the number of layers where the replayed experts
    (as a set) differ from the ones the trainer's own router would have picked.
    """
    routers = moe_routers(model)
    if routes.dim() != 4 or routes.shape[2] != len(routers):
        raise EngineConfigError(f"routes of shape {tuple(routes.shape)} for a model with {len(routers)} MoE "
                                "layers; expected [B, T, layers, top_k] from the rollout engine of this model")
    handles = [r.register_forward_hook(_replay_hook(i, routes, differ)) for i, r in enumerate(routers)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _replay_hook(layer: int, routes: torch.Tensor, differ: torch.Tensor):
    """A forward hook on router ``layer`` swapping its (weights, experts) for the replayed ones."""

    def hook(module: nn.Module, args, output):
        logits, weights, experts = output
        k = int(module.top_k)
        if routes.shape[3] != k:
            raise EngineConfigError(f"routes give {routes.shape[3]} experts per token, the router picks {k}")
        given = routes[:, :, layer].reshape(-1, k).to(device=experts.device, dtype=torch.long)
        if given.shape[0] != experts.shape[0]:
            raise EngineConfigError(f"routes cover {given.shape[0]} tokens, the router saw {experts.shape[0]}")
        if bool((given >= logits.shape[-1]).any()):
            raise EngineConfigError(f"a replayed expert id >= {logits.shape[-1]}, this layer's expert count")
        has = (given != NO_ROUTE).all(-1)
        chosen = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, given.clamp(min=0))
        if module.norm_topk_prob:
            chosen = chosen / chosen.sum(dim=-1, keepdim=True)
        new_experts = torch.where(has[:, None], given, experts)
        new_weights = torch.where(has[:, None], chosen.to(weights.dtype), weights)
        flips = (new_experts.sort(-1).values != experts.sort(-1).values).any(-1) & has
        differ.add_(flips.view(differ.shape).to(differ.device, differ.dtype))
        return logits, new_weights, new_experts

    return hook


__all__ = ["ROUTER", "NO_ROUTE", "moe_routers", "replayed_routes", "router_top_k"]
