"""Records exchanged between the runtime and the engines.

Conventions shared by every engine and every RL function:

* A training batch is *right-padded* token rows: ``input_ids[b]`` is prompt tokens,
  then response tokens, then padding.
* Every per-token tensor is ``[B, T]`` and aligned with ``input_ids``: position ``t``
  holds the quantity for token ``input_ids[b, t]``. So ``logprobs[b, t]`` is
  ``log p(input_ids[b, t] | input_ids[b, :t])`` (position 0 has no prediction and is 0).
* ``response_mask[b, t] = 1`` exactly on response tokens (the tokens the policy
  generated and the loss is taken over); prompt and padding positions are 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from flowrl.catalog.ops import ROUTES  # a mixture of experts' routes: Completion's field, TokenBatch.extras' key


@dataclass(frozen=True)
class SamplingSpec:
    """How a rollout engine samples; every field maps onto vLLM's ``SamplingParams``."""

    n: int = 1
    """Completions per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 keeps all."""
    max_tokens: int = 32
    """Largest number of generated tokens per completion."""
    stop: tuple[str, ...] = ()
    """Strings that end a completion (not included in the output)."""
    seed: int | None = None
    """Base seed; engines derive one seed per request from it, for reproducibility."""
    routes: bool = False
    """Return each token's routed experts (:attr:`Completion.routed_experts`); engines that cannot
    refuse it (a mixture of experts' routing replay)."""


@dataclass(frozen=True)
class Completion:
    """One generated sample."""

    prompt_ids: tuple[int, ...]
    """Prompt token ids, length P."""
    response_ids: tuple[int, ...]
    """Generated token ids, length R (R <= max_tokens; EOS included when generated)."""
    logprobs: tuple[float, ...]
    """Length R: log-probability of each response token under the sampling
    distribution (temperature applied: log_softmax(logits / T))."""
    finish_reason: str
    """"stop" (EOS or a stop string) or "length"."""
    text: str = ""
    """The decoded response."""
    routed_experts: np.ndarray | None = field(default=None, compare=False)
    """Mixtures of experts, when the sampling spec asked for routes: [P + R, L, k] int16, the k
    experts each prompt and response token was routed to in each of the L MoE layers by the engine
    that sampled it; -1 where it has none (the last response token, which is sampled but never
    forwarded)."""


@dataclass
class TokenBatch:
    """A padded batch for the train engine. Shapes: B rows, T tokens."""

    input_ids: torch.Tensor
    """[B, T] int64: prompt + response + padding."""
    attention_mask: torch.Tensor
    """[B, T] int64: 1 on real tokens, 0 on padding."""
    response_mask: torch.Tensor
    """[B, T] float32: 1 on response tokens, 0 elsewhere."""
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-row ``[B]`` or per-token ``[B, T]`` tensors the loss needs:
    ``advantages``, ``old_logprobs``, ``ref_logprobs``, ``rollout_logprobs``,
    ``returns``, ``old_values``, ``rewards`` ... (names are the loss functions')."""

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, rows: slice | torch.Tensor) -> "TokenBatch":
        """The sub-batch of the given rows (for micro-batching and DP splits)."""
        return TokenBatch(
            input_ids=self.input_ids[rows],
            attention_mask=self.attention_mask[rows],
            response_mask=self.response_mask[rows],
            extras={k: v[rows] for k, v in self.extras.items()},
        )

    def to(self, device: torch.device | str) -> "TokenBatch":
        """This batch with every tensor on ``device`` (itself where they are there already): a loss
        mixes the engine's outputs, on its device, with the batch's masks and extras."""
        device = torch.device(device)
        tensors = (self.input_ids, self.attention_mask, self.response_mask, *self.extras.values())
        if all(t.device == device for t in tensors):
            return self
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return TokenBatch(move(self.input_ids), move(self.attention_mask), move(self.response_mask),
                          {k: move(v) for k, v in self.extras.items()})

    @staticmethod
    def from_rows(rows: list[list[int]], pad_id: int) -> "TokenBatch":
        """Right-padded token rows, every real token in the mask (what a reward model scores)."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            attn[i, :len(r)] = 1
        return TokenBatch(ids, attn, attn.float(), {})

    @staticmethod
    def from_completions(completions: list[Completion], pad_id: int) -> "TokenBatch":
        """Right-pad prompt+response rows; put rollout logprobs in ``extras["rollout_logprobs"]``, and
        the completions' routes, when they have some, in ``extras["routed_experts"]`` [B, T, L, k]
        (-1 on padding)."""
        rows = [list(c.prompt_ids) + list(c.response_ids) for c in completions]
        width = max(len(r) for r in rows)
        n = len(rows)
        ids = torch.full((n, width), pad_id, dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        resp = torch.zeros((n, width), dtype=torch.float32)
        rollout_lp = torch.zeros((n, width), dtype=torch.float32)
        for i, (c, row) in enumerate(zip(completions, rows)):
            p, r = len(c.prompt_ids), len(c.response_ids)
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            attn[i, : len(row)] = 1
            resp[i, p : p + r] = 1.0
            if r:
                rollout_lp[i, p : p + r] = torch.tensor(c.logprobs, dtype=torch.float32)
        extras = {"rollout_logprobs": rollout_lp}
        routes = [c.routed_experts for c in completions]
        if any(r is not None for r in routes):
            extras[ROUTES] = _padded_routes(routes, width)
        return TokenBatch(ids, attn, resp, extras)


def _padded_routes(routes: list, width: int) -> torch.Tensor:
    """Per-completion [n_i, L, k] routes -> one [B, width, L, k] int16 tensor padded with -1; every
    completion must have routes of one [L, k] shape (a batch is routed by one model)."""
    if any(r is None for r in routes):
        raise ValueError("some completions carry routed experts and some do not; a batch is routed by one engine")
    shapes = {tuple(r.shape[1:]) for r in routes}
    if len(shapes) != 1:
        raise ValueError(f"completions routed over different layers x top-k: {sorted(shapes)}")
    out = torch.full((len(routes), width, *shapes.pop()), -1, dtype=torch.int16)
    for i, r in enumerate(routes):
        out[i, : len(r)] = torch.from_numpy(np.array(r, dtype=np.int16))  # a copy: Ray hands back read-only arrays
    return out
