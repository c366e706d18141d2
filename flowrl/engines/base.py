"""The two engine Protocols every backend implements, and the errors they raise.

* :class:`RolloutEngine` samples completions (vLLM, SGLang, transformers ``generate``).
* :class:`TrainEngine` computes per-token log-probabilities / values and takes
  optimizer steps (transformers + torch, FSDP, Megatron).

Tensors follow the conventions of :mod:`flowrl.engines.types`: right-padded
``[B, T]`` rows, ``logprobs[b, t] = log p(input_ids[b, t] | input_ids[b, :t])``
(0 at position 0 and on padding), ``response_mask`` 1 exactly on response tokens.

Engines that take turns on shared GPUs also implement :class:`SleepingEngine` (rollout)
or :class:`OffloadingEngine` (train). The runtime talks to engines only through these
Protocols; which adapter backs an engine name is the engine's catalogue record
(:mod:`flowrl.engines.registry` builds it).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from typing import Any, Callable, Protocol, Union, runtime_checkable

import torch

from flowrl.engines.types import Completion, SamplingSpec, TokenBatch


class EngineError(Exception):
    """Base class of every error an engine raises on purpose (bad input, bad config)."""


class EngineConfigError(EngineError):
    """An engine option or call argument has a value the engine cannot use."""


class EngineNotInstalledError(EngineError):
    """The Python package behind an engine is missing; the message names the install command."""


Denominator = dict[str, int]
"""``{"tokens": response tokens in the whole batch, "sequences": rows in the whole batch}``."""

LossResult = Union[torch.Tensor, tuple[torch.Tensor, dict[str, Any]]]
"""A scalar loss, or ``(loss, metrics)``; metric values are floats or 0-d tensors."""

LossFn = Callable[[dict[str, torch.Tensor], TokenBatch, Denominator], LossResult]
"""``loss_fn(outputs, micro_batch, denominator)``.

``outputs`` holds ``[b, t]`` tensors *with grad* for the micro-batch (``"logprobs"``
and ``"entropy"`` from an actor, ``"values"`` from a critic). The loss must be
normalised by ``denominator`` (global counts of the whole batch), never by the
micro-batch's own counts, so that summing micro-batch losses gives the loss of the
whole batch. Returned metrics are summed over micro-batches the same way.
"""


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples completions from a policy whose weights can be replaced in place."""

    def generate(self, prompts: list[list[int]], spec: SamplingSpec) -> list[list[Completion]]:
        """Sample ``spec.n`` completions for each prompt.

        ``prompts``: P lists of token ids. Returns P lists (in prompt order) of
        ``spec.n`` :class:`Completion` each, with per-token log-probabilities under
        the sampling distribution (``log_softmax(logits / T)``, after top-k/top-p).
        """
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load ``(hf_name, tensor)`` pairs (transformers naming, full tensors) in place.

        Caches derived from the old weights (prefix KV cache) are dropped, so the next
        :meth:`generate` uses only the new weights.
        """
        ...

    def shutdown(self) -> None:
        """Release the engine's processes and memory; the engine is unusable afterwards."""
        ...


@runtime_checkable
class TrainEngine(Protocol):
    """Computes per-token quantities of a model and trains it."""

    def forward(
        self, batch: TokenBatch, *, entropy: bool = False, values: bool = False
    ) -> dict[str, torch.Tensor]:
        """Per-token outputs without grad, each ``[B, T]`` float32, 0 at position 0 and on padding.

        ``"logprobs"`` (actor), ``"entropy"`` (actor, nats, when ``entropy``),
        ``"values"`` (critic; ``values[b, t]`` estimates the return of the state
        ``input_ids[b, :t]``, i.e. before token ``t`` is emitted).
        """
        ...

    def train_step(
        self, batch: TokenBatch, loss_fn: LossFn, *, micro_batch_size: int
    ) -> dict[str, float]:
        """One optimizer step over the whole ``batch``.

        Splits it into micro-batches of ``micro_batch_size`` rows, calls
        ``loss_fn(outputs, micro, denominator)`` on each, accumulates gradients,
        clips the global grad norm and steps the optimizer once. Returns at least
        ``loss`` (sum of micro losses), ``grad_norm`` (before clipping) and ``lr``
        (the rate this step used).
        """
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` pairs in transformers naming, for rollout-engine resync."""
        ...

    def adopt_weights(
        self, home: Callable[[Iterable[tuple[str, torch.Tensor]]], dict[str, torch.Tensor]]
    ) -> int:
        """Let the weights live where a weight sync sends them from without a copy: ``home`` takes
        :meth:`named_weights` and returns a tensor per name (same shape, dtype, device; the value
        copied in) for the engine to keep each weight in. Returns how many moved (0, without
        calling ``home``, where the engine's weights cannot move: sharded over rank processes)."""
        ...

    def save(self, path: str) -> None:
        """Write model, optimizer, lr-scheduler and RNG state into directory ``path``."""
        ...

    def load(self, path: str) -> None:
        """Restore what :meth:`save` wrote; the next step is bit-identical to an uninterrupted run."""
        ...


@runtime_checkable
class SleepingEngine(Protocol):
    """A rollout engine that gives its GPU memory to a colocated train engine between generations
    (its record's ``frees_memory = "sleep"``; the plan's ``EnginePlan.releases``)."""

    def sleep(self) -> None:
        """Offload the weights to host memory and free the KV cache (vLLM ``sleep(level=1)``,
        SGLang ``release_memory_occupation``); nothing may run until :meth:`wake_up`."""
        ...

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what :meth:`sleep` freed: ``["weights"]`` first (to load new weights while the
        trainer still holds its memory), then ``["kv_cache"]``; None: everything."""
        ...


@runtime_checkable
class OffloadingEngine(Protocol):
    """A train engine that moves its state to host memory while a colocated rollout engine generates
    (its record's ``frees_memory = "offload"``)."""

    def offload(self) -> int:
        """Parameters, gradients and optimizer states to host memory; returns the bytes moved."""
        ...

    def reload(self) -> int:
        """Bring back what :meth:`offload` moved, in place and bit-identical; returns the bytes moved."""
        ...


DEVICE_ENV = "FLOWRL_DEVICE"
"""Environment variable naming the device every engine of this process computes on, set by the
runtime for a plan's actors (``cpu`` for a plan on the ``cpu`` platform: on a machine with GPUs,
Ray's logical GPU slots name real GPUs, which the plan did not plan for)."""

DEVICES = ("cpu", "cuda")
"""What :data:`DEVICE_ENV` may say."""


def accelerator() -> str:
    """The device of an engine built without one: what :data:`DEVICE_ENV` says where the runtime set it,
    else ``cuda`` where this process sees a GPU (under Ray, the one its placement-group bundle gave
    it; a forked rank, its host's), else ``cpu``. The torch engines default to it, as the FSDP and
    Megatron ranks pick theirs, so a plan on GPUs trains and generates on them without a device in
    the flow, and a plan on the CPU stays there."""
    told = os.environ.get(DEVICE_ENV)
    if told:
        if told not in DEVICES:
            raise EngineConfigError(f"{DEVICE_ENV}={told!r}; hint: one of {', '.join(DEVICES)}, or unset it")
        return told
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_tensors_file(file: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """What ``torch.save`` wrote to ``file`` (an engine's checkpoint state), read with
    ``weights_only=True``: tensors, numbers, strings and containers only, so a file someone replaced
    (a pickle with code in it) runs nothing; such a file is an :class:`EngineError` naming it."""
    try:
        return torch.load(file, map_location=map_location, weights_only=True)
    except Exception as e:  # UnpicklingError (a forbidden global), a truncated or foreign file
        first = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip().split(". ")[0]  # torch's message: bold, and advice we do not give
        name = os.fspath(file) if isinstance(file, (str, os.PathLike)) else "an item of a checkpoint"
        raise EngineError(f"{name} is not an engine checkpoint this flowrl wrote ({type(e).__name__}: "
                          f"{first[:300]}); it was not loaded; hint: it was damaged or replaced: resume from "
                          f"another checkpoint (`--resume-step`), or start a new run") from None


def check_sampling_spec(spec: SamplingSpec, *, routes: bool = False) -> None:
    """Raise :class:`EngineConfigError` naming the first out-of-range field of ``spec``, or its
    ``routes`` when the engine cannot return routed experts (``routes=False``)."""
    if spec.routes and not routes:
        raise EngineConfigError("SamplingSpec.routes=True asked of a rollout engine that cannot return a "
                                "mixture of experts' routes; use vllm (routing replay)")
    checks = (
        (spec.n >= 1, "n", spec.n, "use n >= 1 completions per prompt"),
        (spec.temperature >= 0.0, "temperature", spec.temperature, "use 0 (greedy) or a positive value"),
        (0.0 < spec.top_p <= 1.0, "top_p", spec.top_p, "use a value in (0, 1]"),
        (spec.top_k == -1 or spec.top_k >= 1, "top_k", spec.top_k, "use -1 (off) or k >= 1"),
        (spec.max_tokens >= 1, "max_tokens", spec.max_tokens, "use max_tokens >= 1"),
    )
    for ok, name, value, hint in checks:
        if not ok:
            raise EngineConfigError(f"SamplingSpec.{name}={value!r} is out of range; {hint}")


def check_lengths(prompts: list[list[int]], max_tokens: int, max_model_len: int) -> None:
    """Raise :class:`EngineConfigError` for a prompt whose length plus ``max_tokens`` exceeds ``max_model_len``."""
    for i, prompt in enumerate(prompts):
        if len(prompt) + max_tokens > max_model_len:
            raise EngineConfigError(
                f"prompt {i} has {len(prompt)} tokens + max_tokens={max_tokens} > max_model_len={max_model_len}; "
                "shorten the prompt, lower max_tokens or raise max_model_len"
            )


def check_prompts(prompts: list[list[int]], vocab_size: int | None = None) -> None:
    """Raise :class:`EngineConfigError` for an empty prompt or a token id outside ``[0, vocab_size)``."""
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise EngineConfigError(f"prompt {i} is empty; every prompt needs at least one token (e.g. BOS)")
        if vocab_size is not None:
            bad = [t for t in prompt if not 0 <= int(t) < vocab_size]
            if bad:
                raise EngineConfigError(
                    f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {vocab_size}); "
                    "tokenize with the model's own tokenizer"
                )


def derive_seed(spec: SamplingSpec, prompt_index: int) -> int | None:
    """Seed of prompt ``prompt_index``'s request; its ``n`` samples use ``seed + j`` (vLLM's rule).

    Prompts are spaced ``n`` apart so no two samples of one call share a seed.
    """
    if spec.seed is None:
        return None
    return spec.seed + prompt_index * spec.n
