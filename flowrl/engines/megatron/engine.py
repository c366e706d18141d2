"""The ``megatron`` :class:`~flowrl.engines.base.TrainEngine`: a group of Megatron rank processes.

``MegatronTrainEngine`` is the driver-side handle. It starts ``tp * pp * dp * cp`` ranks
(:func:`~flowrl.engines.rank_hosts.start_ranks`: processes forked here, or under Ray one actor per
rank in the bundle the plan gave it), each hosting one
:class:`~flowrl.engines.megatron.worker.MegatronRank`; the ranks form one
``torch.distributed`` group (gloo on CPU, NCCL on GPUs) with Megatron's
``parallel_state`` laid out as (tp, pp, dp, cp). Every Protocol call is broadcast to all
ranks (each takes its data-parallel slice; CP ranks split each sequence), and the answers
are merged here:

* ``forward``: per-token ``[B, T]`` outputs from the last pipeline stage's tp-rank-0,
  cp-rank-0 process of each dp rank, concatenated in dp order.
* ``train_step``: Megatron's forward/backward schedule (pipelined when pp > 1) over
  micro-batches, grad all-reduce / reduce-scatter over dp x cp, Megatron's optimizer
  (distributed optimizer when dp * cp > 1), one step. Returns the summed loss and metrics.
* ``named_weights``: each stage's weights all-gathered over TP and converted to
  transformers names and layouts, stages concatenated (what a rollout resync sends).
* ``save`` / ``load``: one file per rank (model shard, optimizer shard, step, RNG).

Only the rank processes apply the CPU shims (:mod:`flowrl.engines.megatron.cpu_shims`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

from flowrl.catalog.architectures import expert_layout_problems
from flowrl.catalog.precision import DEFAULT_PRECISION, DTYPE_BYTES, PRECISIONS, keeps_masters
from flowrl.engines.base import Denominator, EngineConfigError, EngineNotInstalledError, LossFn
from flowrl.engines.megatron.worker import RankOptions, StepRecord
from flowrl.engines.rank_hosts import start_ranks
from flowrl.engines.ranks import RankedTrainEngine, RankGroup, RankPlacement, RankProcessError, cloudpickle_module
from flowrl.engines.torch_train import OptimConfig
from flowrl.engines.types import TokenBatch

META_FILE = "megatron_engine.json"
"""Written by :meth:`MegatronTrainEngine.save` next to the per-rank files: layout, role and step."""

INSTALL_HINT = "pip install --no-deps --ignore-requires-python megatron-core==0.19.2"


class MegatronRankError(RankProcessError):
    """A rank process raised or died; the engine's processes have been stopped.

    ``remote_traceback`` holds the rank's traceback text.
    """


_PRELOAD = (
    "flowrl.engines.megatron.worker",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.pipeline_parallel",
)
"""Modules the fork server imports once; every rank forked from it starts with them loaded
(importing torch + Megatron costs ~10 s of CPU per process otherwise)."""


def _rank_group(options: RankOptions, start_timeout_s: float, placement: RankPlacement | None = None) -> RankGroup:
    """Start ``tp * pp * dp * cp`` :class:`~flowrl.engines.megatron.worker.MegatronRank` ranks: forked
    processes, or Ray actors where ``placement`` says (:func:`~flowrl.engines.rank_hosts.start_ranks`)."""
    from flowrl.engines.megatron.worker import MegatronRank

    return start_ranks(MegatronRank, options, options.world_size, start_timeout_s, name="megatron",
                       preload=_PRELOAD, error_cls=MegatronRankError, placement=placement)


class MegatronTrainEngine(RankedTrainEngine):
    """Train engine over Megatron-core with tensor, pipeline, data and context parallelism.

    Args:
        model_path: transformers checkpoint directory (a family convert.py converts; config.json + safetensors).
        role: ``"actor"`` (logprobs, entropy) or ``"critic"`` (values, Linear(H, 1) head
            seeded like the torch engine's).
        optim: AdamW / warm-up / clipping settings (shared with the torch engine).
        temperature: logits are divided by it before log_softmax.
        tp, pp, dp, cp: tensor-, pipeline-, data- and context-parallel sizes; ``tp * pp * dp * cp``
            processes. cp > 1 splits every sequence into ``2 * cp`` chunks, two per CP rank
            (:mod:`~flowrl.engines.megatron.context_parallel`).
        ep: expert-parallel size (a mixture of experts): each of ``ep`` data-parallel ranks holds
            ``experts / ep`` experts of every MoE layer; it divides ``dp`` and adds no processes.
        dtype: parameter dtype: the model computes in it and :meth:`named_weights` yields it
            (``"bfloat16"`` runs on CPU too).
        precision: a 16-bit ``dtype``'s training (:mod:`flowrl.catalog.precision`): ``"mixed"`` only:
            Megatron's ``bf16`` optimizer (fp32 main params and Adam moments, sharded over dp by its
            distributed optimizer; fp32 grad buffers). Its gradient clipping asserts fp32 gradients,
            so ``"pure"`` is refused (and by ``flowrl check``: E616).
        seed: Megatron's RNG seed and the critic head's init seed.
        compute_entropy: pass ``"entropy"`` to the loss in ``train_step`` (actor).
        distributed_optimizer: shard optimizer state over dp ranks when dp > 1.
        vocab_divisible_by: pad the vocabulary to a multiple of this times ``tp``.
        threads: torch threads per rank (default: CPU cores / world size).
        timeout_s: longest wait for one call before the ranks are declared stuck.
        skip_cpu_shims: names of :data:`~flowrl.engines.megatron.cpu_shims.SHIMS` not to
            apply (tests show with it that each shim is needed).
        device: accepted for signature compatibility with the torch engine; ranks use
            CUDA when it is available, else the CPU.
        placement: under Ray, where each rank's actor runs (the runtime passes it); None: the
            ranks are processes forked on this machine.
    """

    meta_file = META_FILE
    engine_name = "Megatron"
    sharding_key = "layout"

    def __init__(
        self,
        model_path: str,
        *,
        role: str = "actor",
        optim: OptimConfig = OptimConfig(),
        temperature: float = 1.0,
        tp: int = 1,
        pp: int = 1,
        dp: int = 1,
        cp: int = 1,
        ep: int = 1,
        dtype: str = "float32",
        precision: str = DEFAULT_PRECISION,
        seed: int = 0,
        compute_entropy: bool = True,
        distributed_optimizer: bool = True,
        vocab_divisible_by: int = 1,
        threads: int | None = None,
        timeout_s: float = 600.0,
        skip_cpu_shims: tuple[str, ...] = (),
        device: str | None = None,
        placement: RankPlacement | None = None,
        **unused: Any,
    ):
        _check_installed()
        _check_args(model_path, role, temperature, tp, pp, dp, cp, ep, dtype)
        if precision not in PRECISIONS:
            raise EngineConfigError(f"precision={precision!r} is not supported; use one of {sorted(PRECISIONS)}")
        if not keeps_masters(dtype, precision) and DTYPE_BYTES.get(dtype, 4) < 4:
            raise EngineConfigError(f"precision={precision!r} with dtype={dtype!r}: Megatron's optimizer trains a "
                                    "16-bit model with fp32 main params (its gradient clipping needs fp32 "
                                    "gradients); use precision='mixed' (flowrl check refuses this: E616)")
        from flowrl.engines.megatron.convert import ModelSpec, check_layout

        spec = ModelSpec.from_pretrained(model_path)
        check_layout(spec, tp, pp, ep)  # fail before spawning anything
        problems = expert_layout_problems(spec.experts, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep)
        if problems:
            raise EngineConfigError("; ".join(reason for _, reason in problems))
        self.role = role
        self.temperature = float(temperature)
        self.timeout_s = float(timeout_s)
        self.options = RankOptions(
            model_path=str(model_path), tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, role=role, temperature=float(temperature),
            lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay,
            warmup_steps=optim.warmup_steps, lr_schedule=optim.schedule, total_steps=optim.total_steps,
            min_lr_ratio=optim.min_lr_ratio, max_grad_norm=optim.max_grad_norm, seed=seed, dtype=dtype,

            distributed_optimizer=distributed_optimizer, vocab_divisible_by=vocab_divisible_by,
            compute_entropy=compute_entropy, threads=threads, skip_cpu_shims=tuple(skip_cpu_shims),
        )
        self.step = 0
        self._start(_rank_group(self.options, self.timeout_s, placement))

    @property
    def layout(self) -> dict[str, int]:
        """``{"tp": ..., "pp": ..., "dp": ..., "cp": ..., "ep": ...}``."""
        o = self.options
        return {"tp": o.tp, "pp": o.pp, "dp": o.dp, "cp": o.cp, "ep": o.ep}

    # ------------------------------------------------------------------ forward

    def forward(
        self, batch: TokenBatch, *, entropy: bool = False, values: bool = False, micro_batch_size: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Per-token outputs without grad, each ``[B, T]`` float32 on CPU (0 at position 0 and padding).

        Actor: ``"logprobs"`` and, with ``entropy=True``, ``"entropy"`` (nats), from the
        vocab-parallel logits divided by the temperature. Critic: ``"values"``
        (``values[b, t]`` = value of ``input_ids[b, :t]``). ``micro_batch_size`` bounds the
        rows each dp rank runs at once (default: all its rows).
        """
        if values and self.role != "critic":
            raise EngineConfigError("values=True asked of an actor engine; build MegatronTrainEngine(role='critic')")
        if entropy and self.role != "actor":
            raise EngineConfigError("entropy=True asked of a critic engine; entropy comes from an actor")
        if batch.size == 0:
            raise EngineConfigError("forward got an empty batch (0 rows)")
        size = micro_batch_size or batch.size
        records: list[StepRecord] = self._group.call("forward", self.timeout_s, batch=batch, entropy=entropy,
                                                     micro_batch_size=size)
        parts = [r for r in self._output_records(records) if r.outputs]
        return {key: torch.cat([r.outputs[key] for r in parts]) for key in parts[0].outputs}

    def _output_records(self, records: list[StepRecord]) -> list[StepRecord]:
        """Records of the last stage's tp-rank-0, cp-rank-0 processes, in dp order (they hold the outputs)."""
        last = self.options.pp - 1
        chosen = [r for r in records if r.coords["pp"] == last and r.coords["tp"] == 0 and r.coords["cp"] == 0]
        return sorted(chosen, key=lambda r: r.coords["dp"])

    # --------------------------------------------------------------- training

    def train_step(
        self, batch: TokenBatch, loss_fn: LossFn, *, micro_batch_size: int, denominator: Denominator | None = None,
        capture_grads: bool = False,
    ) -> dict[str, float]:
        """One optimizer step over ``batch`` (see :meth:`TrainEngine.train_step`).

        The batch is split into dp contiguous slices, each into micro-batches of
        ``micro_batch_size`` rows. ``loss_fn(outputs, micro, denominator)`` runs on the
        last pipeline stage with ``[b, t]`` outputs that carry grad; ``denominator``
        (default: counts of the whole ``batch``) is global. Returns ``loss`` and the loss
        function's metrics summed over all micro-batches of all dp ranks, ``grad_norm``
        (global L2 before clipping), ``lr``, ``step`` and ``skipped``. With
        ``capture_grads`` the synchronised, unclipped gradients are kept for
        :meth:`last_gradients` (a testing and debugging aid; it costs a copy of the grads).
        """
        cloudpickle = cloudpickle_module()
        if micro_batch_size < 1:
            raise EngineConfigError(f"micro_batch_size={micro_batch_size} must be >= 1")
        if batch.size < self.options.dp:
            raise EngineConfigError(
                f"train_step got {batch.size} rows but dp={self.options.dp}; every data-parallel rank needs a row"
            )
        denominator = denominator or {"tokens": int(batch.response_mask.sum().item()), "sequences": batch.size}
        records: list[StepRecord] = self._group.call(
            "train_step", self.timeout_s, batch=batch, loss_fn=cloudpickle.dumps(loss_fn),
            micro_batch_size=micro_batch_size, denominator=denominator, capture_grads=capture_grads,
        )
        self.step = int(records[0].stats["step"])
        # dp ranks already summed their metrics; any last-stage record holds the totals.
        return dict(self._output_records(records)[0].stats)

    # ------------------------------------------------------------ weights & io

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` pairs in transformers naming and layout, full (TP-gathered) tensors.

        Pipeline stages come in order (embeddings, layers, final norm, ``lm_head``). A
        critic yields ``value_head.weight`` / ``value_head.bias`` instead of ``lm_head``.
        """
        yield from self._gather("weights")

    def last_gradients(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, grad)`` of the last ``train_step(capture_grads=True)``: summed over
        micro-batches and dp ranks, before clipping, in transformers naming and layout."""
        yield from self._gather("grads")

    def _gather(self, source: str) -> Iterator[tuple[str, torch.Tensor]]:
        records = self._group.call("gather_hf_weights", self.timeout_s, source=source)
        coords = self._group.coords
        order = sorted(range(len(records)), key=lambda r: coords[r]["pp"])
        for r in order:
            for name, tensor in records[r].items():
                yield name, tensor


def _check_installed() -> None:
    import importlib.util

    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        raise EngineNotInstalledError(f"the megatron train engine needs megatron-core; install it with: {INSTALL_HINT}")


def _check_args(model_path: str, role: str, temperature: float, tp: int, pp: int, dp: int, cp: int, ep: int,
                dtype: str) -> None:
    sizes = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": ep}
    bad = ", ".join(f"{k}={v!r}" for k, v in sizes.items() if not (isinstance(v, int) and v >= 1))
    checks = (
        (role in ("actor", "critic"), f"role={role!r} is not a train-engine role; use 'actor' or 'critic'"),
        (temperature > 0, f"temperature={temperature!r} must be > 0 for training (logits / T)"),
        (not bad, f"{bad}: each of tp, pp, dp, cp and ep must be an integer >= 1"),
        (dtype in ("float32", "bfloat16", "float16"), f"dtype={dtype!r} is not supported; use float32, bfloat16 or float16"),
        (os.path.isdir(model_path), f"model_path={model_path!r} is not a directory; pass a save_pretrained dir"),
    )
    for ok, message in checks:
        if not ok:
            raise EngineConfigError(message)
