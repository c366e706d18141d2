"""Shared cases of the Megatron engine tests: one batch, one loss, one reference step, and
the comparisons. A module of its own (not conftest) so that ``from mcore_cases import ...``
resolves here and nowhere else, in pytest and in the spawned rank processes alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from flowrl.engines.torch_train import OptimConfig, TorchTrainEngine
from flowrl.engines.types import TokenBatch

OPTIM = OptimConfig(lr=1e-4, max_grad_norm=1.0, eps=1e-3)
"""Clipping is active on the test batch (grad norm ~3), so the clip path is compared too.

``eps = 1e-3``: AdamW's first step moves a weight by lr * g / (|g| + eps), whose slope in g is
at most lr / eps. With the default eps = 1e-8 that is 1e4, so gradient entries near 0 that two
layouts round ~1e-9 apart (other reduction orders, other CPUs) could move weights up to lr = 1e-4
apart; with eps = 1e-3 the slope is 0.1 and gradients within TOL give weights within TOL."""

MICRO_BATCH = 2
TOL = 1e-5
"""The acceptance tolerance (fp32) for losses, gradients, log-probabilities and weights."""


def make_batch(rows: int = 8, width: int = 12, seed: int = 0, vocab: int = 17) -> TokenBatch:
    """Right-padded rows of random tokens: a 3-token prompt, a response, padding; random advantages."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, width + 1, (rows,), generator=g)
    lengths[0] = width
    attn = (torch.arange(width)[None] < lengths[:, None]).long()
    ids = torch.randint(4, vocab, (rows, width), generator=g) * attn
    ids[:, 0] = 1  # <bos>
    resp = ((torch.arange(width)[None] >= 3) & (attn > 0)).float()
    adv = torch.randn(rows, width, generator=g) * resp
    old = torch.randn(rows, width, generator=g) * 0.1 * resp
    return TokenBatch(ids, attn, resp, {"advantages": adv, "old_logprobs": old})


def pg_loss(outputs: dict, mb: TokenBatch, denom: dict) -> tuple:
    """Policy gradient with an entropy bonus, token-mean over the *global* token count."""
    mask = mb.response_mask
    pg = -(outputs["logprobs"] * mb.extras["advantages"] * mask).sum()
    ent = (outputs["entropy"] * mask).sum()
    loss = (pg - 0.01 * ent) / denom["tokens"]
    return loss, {"entropy_sum": ent.detach()}


def value_loss(outputs: dict, mb: TokenBatch, denom: dict) -> torch.Tensor:
    """A critic's squared error to the advantages, over the *global* token count."""
    mask = mb.response_mask
    return (((outputs["values"] - mb.extras["advantages"]) ** 2) * mask).sum() / denom["tokens"]


@dataclass
class StepResult:
    """Everything compared between engines for one training step on :func:`make_batch`."""

    forward: dict[str, torch.Tensor]
    """forward(batch, entropy=True) before the step: logprobs, entropy [B, T]."""
    stats: dict[str, float]
    """train_step's returned stats."""
    grads: dict[str, torch.Tensor]
    """HF-named gradients of the step, before clipping."""
    weights: dict[str, torch.Tensor]
    """HF-named weights after the step."""
    initial: dict[str, torch.Tensor]
    """HF-named weights before the step (from named_weights)."""


def run_megatron(path: str, batch: TokenBatch | None = None, save_and_reload: str | None = None,
                 then: Callable[[Any], None] | None = None, **layout) -> StepResult:
    """Build a MegatronTrainEngine with ``layout`` and run the reference step on it (on ``batch``,
    default :func:`make_batch`). With ``save_and_reload`` (a directory) the engine then saves, takes
    another step and loads what it saved, which must give back the step's weights exactly; ``then``
    is called with the engine last (more checks on the same ranks)."""
    from flowrl.engines.megatron import MegatronTrainEngine

    batch = make_batch() if batch is None else batch
    with MegatronTrainEngine(path, optim=OPTIM, **layout) as eng:
        initial = {k: v.clone() for k, v in eng.named_weights()}
        forward = eng.forward(batch, entropy=True, micro_batch_size=3)
        stats = eng.train_step(batch, pg_loss, micro_batch_size=MICRO_BATCH, capture_grads=True)
        grads = {k: v.clone() for k, v in eng.last_gradients()}
        weights = {k: v.clone() for k, v in eng.named_weights()}
        if save_and_reload:
            eng.save(save_and_reload)
            eng.train_step(batch, pg_loss, micro_batch_size=MICRO_BATCH)
            assert not all(torch.equal(v, weights[k]) for k, v in eng.named_weights())  # the step moved them
            eng.load(save_and_reload)
            assert_close(dict(eng.named_weights()), weights, tol=0.0)  # and the load put them back
        if then is not None:
            then(eng)
    return StepResult(forward, stats, grads, weights, initial)


def run_torch(path: str) -> StepResult:
    """The same step on the torch engine (grads from an unclipped twin: the torch engine clips in place)."""
    batch = make_batch()
    eng = TorchTrainEngine(path, optim=OPTIM)
    initial = {k: v.clone() for k, v in eng.named_weights()}
    forward = eng.forward(batch, entropy=True)
    stats = eng.train_step(batch, pg_loss, micro_batch_size=MICRO_BATCH)
    weights = {k: v.clone() for k, v in eng.named_weights()}
    twin = TorchTrainEngine(path, optim=OptimConfig(lr=OPTIM.lr, max_grad_norm=None))
    twin.train_step(batch, pg_loss, micro_batch_size=MICRO_BATCH)
    grads = {k: p.grad.clone() for k, p in twin.model.named_parameters()}
    if getattr(twin.model, "_weight_conversions", None):  # transformers 5 fused experts: checkpoint names
        from transformers.core_model_loading import revert_weight_conversion

        grads = revert_weight_conversion(twin.model, grads)
    return StepResult(forward, stats, grads, weights, initial)


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = TOL) -> None:
    """Same keys, and every tensor within ``tol`` (max abs difference)."""
    assert sorted(a) == sorted(b)
    worst = {k: float((a[k] - b[k]).abs().max()) for k in a}
    bad = {k: v for k, v in worst.items() if not v <= tol}
    assert not bad, f"max |diff| above {tol}: {bad}"


def assert_same_step(got: StepResult, ref: StepResult, tol: float = TOL) -> None:
    """Losses, metrics, grad norm, forward outputs, gradients and updated weights all agree."""
    for key in ("loss", "entropy_sum", "grad_norm", "lr"):
        assert abs(got.stats[key] - ref.stats[key]) <= tol * max(1.0, abs(ref.stats[key])), key
    assert got.stats["skipped"] == 0.0
    assert_close(got.forward, ref.forward, tol)
    assert_close(got.grads, ref.grads, tol)
    assert_close(got.weights, ref.weights, tol)
