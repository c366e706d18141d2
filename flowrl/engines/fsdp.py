"""The ``fsdp`` :class:`~flowrl.engines.base.TrainEngine`: ``dp`` FSDP2 rank processes.

``FsdpTrainEngine`` is the driver-side handle. It starts ``dp`` ranks through
:func:`~flowrl.engines.rank_hosts.start_ranks` (the machinery the megatron engine uses: forked
processes, or under Ray one actor per rank), each
hosting one :class:`~flowrl.engines.fsdp_rank.FsdpRank`: a transformers model whose
decoder layers and root are wrapped with ``torch.distributed.fsdp.fully_shard`` on a 1-D
``dp`` DeviceMesh (gloo on CPU, NCCL on GPUs), so parameters, gradients and AdamW state
are sharded ``1/dp`` per rank. Every Protocol call goes to all ranks; each takes its
contiguous slice of the batch rows and the answers are merged here:

* ``forward``: each rank's ``[rows_r, T]`` outputs, concatenated in rank order.
* ``train_step``: per-rank micro-batches with the GLOBAL denominator, gradients
  reduce-scattered as a sum, metrics combined over ranks, global grad-norm clipping
  (DTensor-aware ``clip_grad_norm_``), one AdamW step.
* ``named_weights``: full tensors (all-gathered) in transformers naming.
* ``save`` / ``load``: torch.distributed.checkpoint (sharded) + per-rank scheduler/RNG.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from flowrl.catalog.precision import DEFAULT_PRECISION, PRECISIONS
from flowrl.engines import batching
from flowrl.engines.base import Denominator, EngineConfigError, LossFn
from flowrl.engines.fsdp_rank import FsdpOptions, FsdpRank
from flowrl.engines.rank_hosts import start_ranks
from flowrl.engines.ranks import RankedTrainEngine, RankPlacement, RankProcessError, cloudpickle_module
from flowrl.engines.torch_train import _DTYPES, OptimConfig
from flowrl.engines.types import TokenBatch

META_FILE = "fsdp_engine.json"
"""Written by :meth:`FsdpTrainEngine.save`: dp, role, step and model path."""

_PRELOAD = ("flowrl.engines.fsdp_rank", "transformers", "torch.distributed.fsdp",
            "torch.distributed.checkpoint")
"""Modules the fork server imports once (seconds of CPU per rank otherwise)."""


class FsdpRankError(RankProcessError):
    """An fsdp rank process raised or died; the engine's processes have been stopped."""


class FsdpTrainEngine(RankedTrainEngine):
    """Data-parallel train engine over FSDP2 (``fully_shard``), one process per dp rank.

    Args:
        model_path: transformers checkpoint directory (``save_pretrained`` output).
        role: ``"actor"`` (logprobs, entropy) or ``"critic"`` (values; the torch engine's head).
        optim: AdamW / warm-up / clipping settings.
        temperature: logits are divided by it before log_softmax.
        dp: number of rank processes (sharding and data-parallel degree).
        tp, pp: accepted so a schedule layout passes through; must be 1 (use megatron for tp/pp).
        offload: GPU only: FSDP2 CPU offload of parameters, grads and optimizer state.
        dtype: the dtype the model computes in and :meth:`named_weights` yields.
        precision: a 16-bit ``dtype``'s training (:mod:`flowrl.catalog.precision`): ``"mixed"`` shards
            fp32 parameters, gradients and AdamW moments and all-gathers the parameters cast to ``dtype``
            for the forward and backward (FSDP2's ``MixedPrecisionPolicy``, as veRL); ``"pure"`` shards
            ``dtype`` itself.
        seed: rank seed and the critic head's init seed.
        compute_entropy: pass ``"entropy"`` to the loss in ``train_step`` (actor).
        attn_implementation: transformers attention backend; None keeps its default.
        threads: torch threads per rank (default: CPU cores / dp).
        timeout_s: longest wait for one call before the ranks are declared stuck.
        device: accepted for signature compatibility; ranks use CUDA when available, else CPU.
        placement: under Ray, where each rank's actor runs (the runtime passes it); None: the
            ranks are processes forked on this machine.
        lora: train LoRA adapters only (an actor): the plan's ``{"r", "alpha", "dropout", "targets"}``.
            PEFT wraps the model in each rank before FSDP shards it; only the adapters have gradients
            (reduce-scattered over the ranks, summed) and AdamW states; :meth:`named_weights` gathers the
            adapters alone; ``forward(adapters=False)`` computes the base model's outputs.
    """

    meta_file = META_FILE
    engine_name = "fsdp"
    sharding_key = "dp"

    def __init__(
        self,
        model_path: str,
        *,
        role: str = "actor",
        optim: OptimConfig = OptimConfig(),
        temperature: float = 1.0,
        dp: int = 1,
        tp: int = 1,
        pp: int = 1,
        offload: bool = False,
        dtype: str = "float32",
        precision: str = DEFAULT_PRECISION,
        seed: int = 0,
        compute_entropy: bool = True,
        attn_implementation: str | None = None,
        threads: int | None = None,
        timeout_s: float = 600.0,
        device: str | None = None,
        placement: RankPlacement | None = None,
        lora: dict | None = None,
    ):
        _check_args(model_path, role, temperature, dp, tp, pp, dtype)
        if precision not in PRECISIONS:
            raise EngineConfigError(f"precision={precision!r} is not supported; use one of {sorted(PRECISIONS)}")
        if lora is not None and role != "actor":
            raise EngineConfigError(f"lora is for actors (a policy's adapters), not a {role}")
        self.role = role
        self.temperature = float(temperature)
        self.timeout_s = float(timeout_s)
        self.options = FsdpOptions(
            model_path=str(model_path), dp=dp, role=role, optim=optim, temperature=float(temperature), dtype=dtype,
            precision=precision, seed=seed, compute_entropy=compute_entropy,
            attn_implementation=attn_implementation, offload=offload,
            threads=threads, lora=lora,
        )
        self.step = 0
        self._start(start_ranks(FsdpRank, self.options, dp, self.timeout_s, name="fsdp", preload=_PRELOAD,
                                error_cls=FsdpRankError, placement=placement))

    @property
    def dp(self) -> int:
        """Number of data-parallel rank processes."""
        return self.options.dp

    def forward(
        self, batch: TokenBatch, *, entropy: bool = False, values: bool = False, micro_batch_size: int | None = None,
        micro_batch_tokens: int = 0, pack: bool = False, adapters: bool = True,
    ) -> dict[str, torch.Tensor]:
        """Per-token outputs without grad, each ``[B, T]`` float32 on CPU (0 at position 0 and padding).

        Actor: ``"logprobs"`` and, with ``entropy=True``, ``"entropy"`` (nats). Critic:
        ``"values"`` (``values[b, t]`` = value of ``input_ids[b, :t]``). ``micro_batch_size``
        bounds the rows each rank runs at once (default: all its rows); ``micro_batch_tokens`` (> 0)
        the real tokens instead, rows balanced over ranks by tokens; ``pack`` runs each micro-batch
        as one packed row (:mod:`flowrl.engines.batching`). ``adapters=False`` (a LoRA engine): the
        base model's outputs, the adapters disabled: a frozen reference of this policy without a copy.
        """
        if not adapters and self.options.lora is None:
            raise EngineConfigError("adapters=False asked of an engine that trains no LoRA adapters: its weights "
                                    "are the model's; a frozen reference of a full-weight policy has an engine "
                                    "of its own")
        if values and self.role != "critic":
            raise EngineConfigError("values=True asked of an actor engine; build FsdpTrainEngine(role='critic')")
        if entropy and self.role != "actor":
            raise EngineConfigError("entropy=True asked of a critic engine; entropy comes from an actor")
        if batch.size == 0:
            raise EngineConfigError("forward got an empty batch (0 rows)")
        size = micro_batch_size or max(1, -(-batch.size // self.dp))
        if size < 1:
            raise EngineConfigError(f"micro_batch_size={micro_batch_size} must be >= 1")
        if micro_batch_tokens < 0:
            raise EngineConfigError(f"micro_batch_tokens={micro_batch_tokens} must be >= 0 (0: micro-batches by rows)")
        parts = self._group.call("forward", self.timeout_s, batch=batch, entropy=entropy, values=values,
                                 micro_batch_size=size, micro_batch_tokens=micro_batch_tokens, pack=pack,
                                 adapters=adapters)
        plans = batching.plan_ranks(batching.lengths_of(batch), self.dp, max_rows=size, max_tokens=micro_batch_tokens,
                                    padded=not pack)
        order = torch.tensor([i for rows in batching.rank_rows(plans) for i in rows], dtype=torch.long)
        out = {}
        for key in parts[0]:
            out[key] = torch.zeros(batch.size, batch.input_ids.shape[1], dtype=torch.float32)
            out[key][order] = torch.cat([p[key] for p in parts])
        return out

    def train_step(
        self, batch: TokenBatch, loss_fn: LossFn, *, micro_batch_size: int, denominator: Denominator | None = None,
        capture_grads: bool = False, micro_batch_tokens: int = 0, pack: bool = False,
    ) -> dict[str, float]:
        """One optimizer step over ``batch`` (see :meth:`TrainEngine.train_step`).

        Rank ``r`` takes rows ``dp_slices(B, dp)[r]`` and splits them into micro-batches of
        ``micro_batch_size`` (or, with ``micro_batch_tokens > 0``, rows balanced over ranks by real
        tokens into micro-batches of at most that many; ``pack``: each as one packed row); ``loss_fn(outputs, micro, denominator)`` gets ``[b, t]``
        outputs with grad and the global ``denominator`` (default: counts of the whole
        ``batch``). Returns ``loss`` and the loss metrics combined over micro-batches and
        ranks (sum; ``*_max``/``*_min`` by max/min), ``grad_norm`` (global L2 before
        clipping), ``lr``, ``step`` and ``skipped``. ``capture_grads`` keeps the reduced,
        unclipped gradients for :meth:`last_gradients` (a testing aid; costs a gather).
        """
        if micro_batch_size < 1:
            raise EngineConfigError(f"micro_batch_size={micro_batch_size} must be >= 1")
        if micro_batch_tokens < 0:
            raise EngineConfigError(f"micro_batch_tokens={micro_batch_tokens} must be >= 0 (0: micro-batches by rows)")
        if batch.size < self.dp:
            raise EngineConfigError(
                f"train_step got {batch.size} rows but dp={self.dp}; every data-parallel rank needs a row"
            )
        denominator = denominator or {"tokens": int(batch.response_mask.sum().item()), "sequences": batch.size}
        stats = self._group.call(
            "train_step", self.timeout_s, batch=batch, loss_fn=cloudpickle_module().dumps(loss_fn),
            micro_batch_size=micro_batch_size, denominator=denominator, capture_grads=capture_grads,
            micro_batch_tokens=micro_batch_tokens, pack=pack,
        )
        self.step = int(stats[0]["step"])
        return dict(stats[0])

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` full (all-gathered) CPU tensors in transformers naming.

        A critic yields its base model under ``model.`` plus ``value_head.weight`` / ``value_head.bias``.
        With LoRA: the adapter tensors only, under PEFT's names
        (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), as the torch engine's.
        """
        yield from self._group.call("gather_weights", self.timeout_s, source="weights")[0].items()

    def save_pretrained(self, path: str) -> None:
        """Write the actor as a transformers checkpoint dir; with LoRA, the base with the adapters merged in
        (``W + (alpha / r) B A``: :func:`flowrl.engines.lora.merged_state`), as the torch engine writes it."""
        if self.options.lora is None:
            return super().save_pretrained(path)
        import json
        from pathlib import Path

        from flowrl.engines.hf_export import write_hf_checkpoint

        merged = self._group.call("gather_weights", self.timeout_s, source="merged")[0]
        config = json.loads(Path(self.options.model_path, "config.json").read_text())
        write_hf_checkpoint(self.options.model_path, path, merged.items(),
                            tied=bool(config.get("tie_word_embeddings", False)))

    def last_gradients(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, grad)`` of the last ``train_step(capture_grads=True)``: summed over ranks, before clipping."""
        yield from self._group.call("gather_weights", self.timeout_s, source="grads")[0].items()


def _check_args(model_path: str, role: str, temperature: float, dp: int, tp: int, pp: int, dtype: str) -> None:
    checks = (
        (role in ("actor", "critic"), f"role={role!r} is not a train-engine role; use 'actor' or 'critic'"),
        (temperature > 0, f"temperature={temperature!r} must be > 0 for training (logits / T)"),
        (isinstance(dp, int) and dp >= 1, f"dp={dp!r} must be an integer >= 1"),
        (tp == 1 and pp == 1,
         f"tp={tp!r}, pp={pp!r}: the fsdp engine shards by data parallelism only; use megatron(tp=..., pp=...)"),
        (dtype in _DTYPES, f"dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)}"),
        (os.path.isdir(model_path), f"model_path={model_path!r} is not a directory; pass a save_pretrained dir"),
    )
    for ok, message in checks:
        if not ok:
            raise EngineConfigError(message)
