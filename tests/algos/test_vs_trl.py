"""flowrl's losses against TRL's own code (``trl==1.16.0``, ``GRPOTrainer._compute_loss``) on the same tensors.

TRL computes its loss inside a trainer method; it is called here on a stand-in for the
trainer that holds only what the method reads (the loss settings, an accelerator of one
process, metric buffers), with the policy's per-token log-probs handed to it instead of a
model forward. Values and gradients (w.r.t. the current log-probs) must agree to 1e-6;
float64 keeps rounding (~1e-15) far below that, so any difference is a formula difference.

Pairs compared (TRL ``loss_type`` / setting -> flowrl):

* ``grpo`` -> ``ppo_clip_loss(agg = "seq-mean-token-mean")``; ``bnpo`` and ``dapo`` (with
  clip-higher) -> ``agg = "token-mean"``; ``dr_grpo`` -> ``"seq-mean-token-sum"`` divided by
  TRL's constant ``max_completion_length``;
* ``importance_sampling_level = "sequence"`` (GSPO) -> ``gspo_loss``;
* ``cispo`` (``epsilon_high`` = the largest weight) -> ``cispo_loss(clip_high = epsilon_high - 1)``;
* ``beta > 0`` (k3 KL in the loss) -> ``+ beta * kl_loss(kind = "k3")``;
* vLLM importance sampling (TRL multiplies the policy term by its ratio) -> ``is_weights``;
* ``RLOOTrainer``'s advantages (``_generate_and_score_completions``, the only place TRL computes
  them: no standalone function exists) -> ``rloo_advantages``, with TRL's sequence-level k1 KL in
  the reward -> ``sequence_reward_to_tokens`` + ``kl_penalty_in_reward`` summed per row. That
  method is called on a stand-in whose generation, reward functions and log-prob forward return
  fixed tensors, so what runs is TRL's own reward-to-advantage code.

Skipped when TRL is not installed (it is the ``bench`` extra's dependency).
"""

from __future__ import annotations

import collections
import types
import warnings

import pytest
import torch

import trl.trainer.grpo_trainer as trl_grpo  # noqa: E402  (`make` installs the bench extra: never skipped)
import trl.trainer.rloo_trainer as trl_rloo  # noqa: E402

from flowrl.algos import (  # noqa: E402
    cispo_loss,
    gspo_loss,
    importance_correction,
    kl_loss,
    kl_penalty_in_reward,
    ppo_clip_loss,
    rloo_advantages,
    sequence_reward_to_tokens,
)

B, T, MAX_LEN = 6, 5, 8


def _trainer(loss_type: str, logps: torch.Tensor, *, level="token", beta=0.0, eps_low=0.2, eps_high=0.2,
             use_is=False):
    """What ``GRPOTrainer._compute_loss`` reads of ``self``, with one process and no accumulation."""
    accelerator = types.SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction="sum": x,
                                        gather_for_metrics=lambda x: x, sync_gradients=True)
    args = types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1)
    self = types.SimpleNamespace(
        loss_type=loss_type, importance_sampling_level=level, beta=beta, epsilon_low=eps_low, epsilon_high=eps_high,
        args=args, accelerator=accelerator, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=MAX_LEN, _entropy_bonus_enabled=False,
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=use_is,
        vllm_importance_sampling_correction=use_is, _metrics={"train": collections.defaultdict(list)})
    self._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.zeros_like(logps), None)
    return self


def _batch(seed: int, spread: float = 0.8):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, dtype=torch.float64)
    for i, n in enumerate((5, 3, 1, 4, 2, 5)):
        mask[i, :n] = 1
    old = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5 - 1.0
    # rows drift from the old policy by different amounts, so some ratios are clipped, some not
    drift = torch.randn(B, T, generator=g, dtype=torch.float64) * spread * torch.linspace(0.05, 1.0, B)[:, None]
    logps = (old + drift).requires_grad_(True)
    ref = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return logps, old, ref, adv, mask


def _trl_loss(self, logps, old, ref, adv, mask, is_ratio=None):
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum()}
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trl_grpo.GRPOTrainer._compute_loss(self, None, inputs)


def _same(trl_value, ours, logps):
    g_trl, = torch.autograd.grad(trl_value, logps, retain_graph=True)
    g_ours, = torch.autograd.grad(ours, logps, retain_graph=True)
    assert abs(trl_value.item() - ours.item()) < 1e-6, (trl_value.item(), ours.item())
    torch.testing.assert_close(g_ours, g_trl, atol=1e-6, rtol=0)
    assert g_ours.abs().sum() > 0  # the comparison is not between two zero gradients


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("loss_type, agg, eps_high", [
    ("grpo", "seq-mean-token-mean", 0.2),
    ("bnpo", "token-mean", 0.2),
    ("dapo", "token-mean", 0.28),  # DAPO: token-level loss and clip-higher
])
def test_ppo_clip_matches_trl(seed, loss_type, agg, eps_high):
    logps, old, ref, adv, mask = _batch(seed)
    trl = _trl_loss(_trainer(loss_type, logps, eps_high=eps_high), logps, old, ref, adv, mask)
    ours, metrics = ppo_clip_loss(logps, old, adv, mask, clip_low=0.2, clip_high=eps_high, agg=agg)
    assert 0 < metrics["clipfrac"] < 1
    _same(trl, ours, logps)


@pytest.mark.parametrize("seed", range(3))
def test_dr_grpo_matches_trl(seed):
    logps, old, ref, adv, mask = _batch(seed)
    trl = _trl_loss(_trainer("dr_grpo", logps), logps, old, ref, adv, mask)
    ours, _ = ppo_clip_loss(logps, old, adv, mask, agg="seq-mean-token-sum")
    _same(trl, ours / MAX_LEN, logps)  # TRL divides by the constant max_completion_length too


@pytest.mark.parametrize("seed", range(3))
def test_k3_kl_in_the_loss_matches_trl(seed):
    logps, old, ref, adv, mask = _batch(seed)
    trl = _trl_loss(_trainer("grpo", logps, beta=0.04), logps, old, ref, adv, mask)
    pg, _ = ppo_clip_loss(logps, old, adv, mask, agg="seq-mean-token-mean")
    ours = pg + 0.04 * kl_loss(logps, ref, mask, kind="k3", agg="seq-mean-token-mean")
    _same(trl, ours, logps)


@pytest.mark.parametrize("seed", range(3))
def test_gspo_matches_trl_sequence_level_importance_sampling(seed):
    # a length-normalised ratio moves little: drift of ~1e-3, the paper's clip range 3e-4 / 4e-4
    logps, old, ref, adv, mask = _batch(seed, spread=2e-3)
    self = _trainer("grpo", logps, level="sequence", eps_low=3e-4, eps_high=4e-4)
    trl = _trl_loss(self, logps, old, ref, adv, mask)
    ours, metrics = gspo_loss(logps, old, adv, mask, clip_low=3e-4, clip_high=4e-4)
    assert 0 < metrics["clipfrac"] < 1
    _same(trl, ours, logps)


@pytest.mark.parametrize("seed", range(3))
def test_cispo_matches_trl(seed):
    logps, old, ref, adv, mask = _batch(seed, spread=1.5)  # large drifts: some weights reach the cap
    trl = _trl_loss(_trainer("cispo", logps, eps_high=2.0), logps, old, ref, adv, mask)
    ours, metrics = cispo_loss(logps, old, adv, mask, clip_high=1.0)
    assert 0 < metrics["clipfrac"] < 1
    _same(trl, ours, logps)


@pytest.mark.parametrize("level, tis, mis", [("token", 2.0, 0.0), ("token", 0.0, 2.0), ("sequence", 0.0, 3.0),
                                             ("sequence", 2.0, 0.0)])
def test_importance_weights_enter_the_loss_as_trl_applies_them(level, tis, mis):
    """TRL multiplies the policy term (not the KL term) by its rollout-correction ratio, as flowrl does."""
    logps, old, ref, adv, mask = _batch(1)
    g = torch.Generator().manual_seed(5)
    rollout = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.6
    weights, _ = importance_correction(old, rollout, mask, tis=tis, mis=mis, level=level)
    weights = weights.to(torch.float64)
    trl = _trl_loss(_trainer("dapo", logps, beta=0.04, use_is=True), logps, old, ref, adv, mask, is_ratio=weights)
    pg, _ = ppo_clip_loss(logps, old, adv, mask, agg="token-mean", is_weights=weights)
    _same(trl, pg + 0.04 * kl_loss(logps, ref, mask, kind="k3"), logps)


def _trl_rloo_advantages(rewards, k, *, beta=0.0, old=None, ref=None, lengths=None):
    """``RLOOTrainer._generate_and_score_completions`` on a stand-in: ``[N]`` TRL advantages and its mask.

    The stand-in's ``_generate`` returns completions of ``lengths`` tokens, its one reward
    function returns ``rewards`` and its log-prob forward returns ``ref`` for the reference
    model and ``old`` for the policy; everything after that is TRL's code.
    """
    n = rewards.shape[0]
    lengths = lengths or [T] * n
    reference = types.SimpleNamespace()

    def generate(prompts):
        return [[1, 2]] * len(prompts), [[3] * m for m in lengths], ["c"] * len(prompts)

    def logps(model, *args, **kwargs):
        return (ref if model is reference else old), None, None

    self = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), process_index=0,
                                          reduce=lambda x, reduction="sum": x, gather=lambda x: x),
        model=types.SimpleNamespace(training=True, is_gradient_checkpointing=False), ref_model=reference,
        args=types.SimpleNamespace(per_device_train_batch_size=n, gradient_checkpointing_kwargs=None),
        _tokenizer=types.SimpleNamespace(pad_token_id=0), pad_to_multiple_of=None, mask_truncated_completions=False,
        beta=beta, num_generations=k, reward_weights=torch.ones(1, dtype=torch.float64), reward_clip_range=None,
        normalize_advantages=False, reward_func_names=["r"], log_multimodal=False,
        _metrics={"train": collections.defaultdict(list)}, _pending_extra_logs={}, _pending_metrics={},
        _logs={"prompt": [], "completion": [], "advantages": [], "images": [],
               "rewards": collections.defaultdict(list), "extra": collections.defaultdict(list)},
        _generate=generate, _calculate_rewards=lambda *a: rewards[:, None], _get_per_token_logps_and_entropies=logps)
    if old is None:
        old = ref = torch.zeros(n, max(lengths), dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = trl_rloo.RLOOTrainer._generate_and_score_completions(self, [{"prompt": "p"}] * n)
    return out["advantages"], out["completion_mask"]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("k", [2, 3, 4])
def test_rloo_advantages_match_trl(seed, k):
    """RLOO's leave-one-out baseline (Ahmadian et al. 2024, Sec. 2.3) is TRL's, on random rewards."""
    g = torch.Generator().manual_seed(seed)
    n = 4 * k
    rewards = torch.randn(n, generator=g, dtype=torch.float64) * 2.0 + 0.5
    trl, _ = _trl_rloo_advantages(rewards, k)
    for group_ids in (k, torch.arange(n) // k):  # a group size, or explicit ids in TRL's block order
        ours = rloo_advantages(rewards, group_ids)
        torch.testing.assert_close(ours.double(), trl, atol=1e-6, rtol=0)
    assert trl.abs().sum() > 0


@pytest.mark.parametrize("seed", range(3))
def test_rloo_with_kl_in_the_reward_matches_trl(seed):
    """TRL's RLOO subtracts ``beta * sum_t (old - ref)`` from each reward: flowrl's k1 KL in the reward, summed."""
    g = torch.Generator().manual_seed(seed)
    k, lengths = 3, [5, 3, 1, 4, 2, 5]
    n = len(lengths)
    rewards = torch.randn(n, generator=g, dtype=torch.float64)
    old = torch.randn(n, T, generator=g, dtype=torch.float64) * 0.5 - 1.0
    ref = old + torch.randn(n, T, generator=g, dtype=torch.float64) * 0.3
    trl, mask = _trl_rloo_advantages(rewards, k, beta=0.05, old=old, ref=ref, lengths=lengths)
    assert mask.sum(dim=1).tolist() == lengths
    token_rewards = kl_penalty_in_reward(sequence_reward_to_tokens(rewards, mask), old, ref, mask, coef=0.05)
    ours = rloo_advantages(token_rewards.sum(dim=1), k)
    torch.testing.assert_close(ours.double(), trl, atol=1e-6, rtol=0)
    # the penalty changed the advantages: the comparison is not of the KL-free ones
    assert (rloo_advantages(rewards, k).double() - trl).abs().max() > 1e-3
