"""One rank of the ``fsdp`` train engine: a transformers model sharded with FSDP2 over a dp mesh.

An :class:`FsdpRank` lives in its own process (started by
:class:`~flowrl.engines.fsdp.FsdpTrainEngine` through :class:`~flowrl.engines.ranks.RankGroup`),
joins a ``torch.distributed`` group (gloo on CPU, NCCL on GPUs), builds the same model as
:class:`~flowrl.engines.torch_train.TorchTrainEngine` (it *is* one, with its model then
wrapped by ``torch.distributed.fsdp.fully_shard`` per decoder layer and at the root) and
rebuilds AdamW over the sharded (DTensor) parameters.

Every method is collective: all ranks get the same whole batch and take their contiguous
dp slice. FSDP2 all-gathers a layer's parameters before it runs, so every rank must run
the same number of forward/backward passes: a rank with fewer micro-batches than the
busiest one runs *padding* micro-batches (one row, loss ``0 * sum(outputs)``) that add
nothing to the gradients. Gradients are reduce-scattered as a SUM (divide factor 1),
because each rank's loss is already normalised by the global denominator.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flowrl.algos.losses import combine_metrics
from flowrl.catalog.precision import DEFAULT_PRECISION, keeps_masters
from flowrl.engines import batching
from flowrl.engines.base import Denominator, EngineConfigError, LossFn, accelerator, load_tensors_file
from flowrl.engines.ranks import local_device_index
from flowrl.engines.precision import MasterWeights
from flowrl.engines.torch_train import _DTYPES, OptimConfig, TorchTrainEngine, _split_loss, trim_padding
from flowrl.engines.types import TokenBatch

GRAD_STATS = ("grad_norm", "lr", "step", "skipped")
"""train_step stats that every rank computes identically (not summed across ranks)."""

DCP_DIR = "dcp"
"""Sub-directory of a checkpoint holding the sharded model/optimizer (torch.distributed.checkpoint)."""


@dataclass(frozen=True)
class FsdpOptions:
    """Everything a rank needs to build its part of the engine (picklable plain data)."""

    model_path: str
    """transformers checkpoint directory."""
    dp: int = 1
    """Data-parallel size = number of rank processes (parameters, grads and AdamW state sharded over it)."""
    role: str = "actor"
    """``"actor"`` (logprobs / entropy) or ``"critic"`` (values from a Linear(H, 1) head)."""
    optim: OptimConfig = OptimConfig()
    """AdamW / warm-up / clipping settings (the torch engine's)."""
    temperature: float = 1.0
    """Logits are divided by this before log_softmax."""
    dtype: str = "float32"
    """Parameter dtype name."""
    seed: int = 0
    """Global torch seed of each rank and the critic head's init seed."""
    compute_entropy: bool = True
    """Whether ``train_step`` passes ``"entropy"`` to the loss (actor)."""
    attn_implementation: str | None = None
    """transformers attention backend; None keeps its default."""
    offload: bool = False
    """GPU only: keep sharded parameters, grads and optimizer state in host memory (FSDP2 CPUOffloadPolicy)."""
    threads: int | None = None
    """torch intra-op threads per rank; None = cpu_count // dp."""
    backend: str | None = None
    """torch.distributed backend; None = "nccl" with CUDA, else "gloo"."""
    precision: str = DEFAULT_PRECISION
    """A 16-bit ``dtype``'s training (:mod:`flowrl.catalog.precision`): ``"mixed"`` shards fp32 parameters
    (the masters) and computes in ``dtype`` (FSDP2's ``MixedPrecisionPolicy``), ``"pure"`` shards ``dtype``."""
    lora: dict | None = None
    """Train LoRA adapters only (an actor): the plan's ``{"r", "alpha", "dropout", "targets"}``
    (:mod:`flowrl.engines.lora`). PEFT wraps the model before FSDP shards it; the frozen base weights
    are sharded like the adapters, only the adapters have gradients (reduce-scattered over dp) and
    AdamW states, and a resync gathers the adapters alone."""


def _compute_dtype(options: FsdpOptions) -> torch.dtype | None:
    """The 16-bit dtype a mixed-precision rank computes in while its sharded parameters, gradients and
    AdamW moments are fp32 (veRL's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``);
    None: it computes in its parameters' dtype."""
    return _DTYPES[options.dtype] if keeps_masters(options.dtype, options.precision) else None


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly) sharded DTensor, on CPU (collective for DTensors)."""
    return (t.full_tensor() if _is_dtensor(t) else t).detach().cpu()


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks (``model.model.layers`` for both the causal LM and the critic's base)."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise EngineConfigError(
            f"cannot find decoder layers at model.model.layers in {type(model).__name__}; "
            "the fsdp engine supports Llama/Qwen2-style transformers checkpoints"
        )
    return list(layers)


def _trained_state(engine: TorchTrainEngine, state: dict) -> dict:
    """What a checkpoint keeps of a model's state dict: all of it, or for a LoRA engine its adapters (the
    trainable parameters; the frozen base is the model checkpoint's, never changed: a few % of the bytes)."""
    if engine.lora is None:
        return state
    trained = {name for name, p in engine.model.named_parameters() if p.requires_grad}
    return {name: t for name, t in state.items() if name in trained}


class FsdpRank:
    """One process of the fsdp engine (see the module docstring).

    Args:
        rank, world_size: this process's rank and the group size (= dp).
        init_method: ``torch.distributed`` rendezvous URL (``tcp://host:port``).
        options: the engine's :class:`FsdpOptions`.
    """

    def __init__(self, rank: int, world_size: int, init_method: str, options: FsdpOptions):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if world_size != options.dp:
            raise EngineConfigError(f"world_size={world_size} != dp={options.dp}")
        self.options = options
        self.rank, self.world = rank, world_size
        torch.set_num_threads(options.threads or max(1, (os.cpu_count() or 1) // world_size))
        cuda = accelerator() == "cuda"
        device = f"cuda:{local_device_index()}" if cuda else "cpu"  # the GPU its host gave this rank
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(options.backend or ("nccl" if cuda else "gloo"), init_method=init_method,
                                rank=rank, world_size=world_size)
        self.mesh = init_device_mesh("cuda" if cuda else "cpu", (world_size,), mesh_dim_names=("dp",))
        torch.manual_seed(options.seed)
        self.engine = TorchTrainEngine(
            options.model_path, role=options.role, optim=options.optim, temperature=options.temperature,
            dtype="float32" if _compute_dtype(options) else options.dtype, precision=options.precision,
            device=device, seed=options.seed, compute_entropy=options.compute_entropy,
            attn_implementation=options.attn_implementation, lora=options.lora,
        )
        self._shard(offload=options.offload and cuda)
        self.coords = {"rank": rank, "dp": rank}
        self._grads: dict[str, torch.Tensor] = {}

    def _shard(self, offload: bool) -> None:
        """Wrap each decoder layer and the root with FSDP2, then rebuild AdamW over the DTensor parameters."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        from flowrl.engines.lora import base_model

        eng = self.engine
        policy = CPUOffloadPolicy() if offload else OffloadPolicy()
        # mixed precision: all-gather the fp32 shards cast to the 16-bit dtype, reduce-scatter grads in fp32
        compute = _compute_dtype(self.options)
        mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if compute else MixedPrecisionPolicy()
        root = base_model(eng.model)  # under PEFT's wrapper (LoRA): the transformers model, adapters inside
        for layer in _decoder_layers(root):
            fully_shard(layer, mesh=self.mesh, offload_policy=policy, mp_policy=mp)
        fully_shard(root, mesh=self.mesh, offload_policy=policy, mp_policy=mp)
        for module in eng.model.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                # Losses are normalised by the global denominator: the dp gradients must add, not average.
                module.set_gradient_divide_factor(1.0)
                # A divide factor makes FSDP use PREMUL_SUM, which gloo lacks: plain SUM (+ scaling) instead.
                module.set_force_sum_reduction_for_comms(True)
        # fully_shard replaced the parameters by DTensors: the optimizer must hold the new ones.
        cfg = eng.optim_config
        # The sharded parameters are the masters themselves (fp32 under mixed precision, else the dtype's).
        eng.masters = MasterWeights([p for p in eng.model.parameters() if p.requires_grad], enabled=False)
        eng.optimizer = torch.optim.AdamW(eng.masters.params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                          weight_decay=cfg.weight_decay)
        eng.scheduler = torch.optim.lr_scheduler.LambdaLR(eng.optimizer, lambda step: cfg.lr_factor(step))

    # ---------------------------------------------------------------- batches

    def _plan(self, batch: TokenBatch, size: int, tokens: int,
              pack: bool) -> tuple[list[tuple[list[int], TokenBatch]], int]:
        """This rank's micro-batches (``(rows, trimmed micro-batch)``: ``size`` rows each, or at most
        ``tokens`` real tokens with rows balanced over ranks by tokens, :func:`batching.plan_ranks`)
        and how many padding passes keep it in step with the busiest rank."""
        plans = batching.plan_ranks(batching.lengths_of(batch), self.world, max_rows=size, max_tokens=tokens,
                                    padded=not pack)
        micros = [(m, trim_padding(batch.select(torch.tensor(m, dtype=torch.long)))) for m in plans[self.rank]]
        return micros, max(len(p) for p in plans) - len(micros)

    # ---------------------------------------------------------------- forward

    def forward(self, batch: TokenBatch, entropy: bool, values: bool, micro_batch_size: int,
                micro_batch_tokens: int = 0, pack: bool = False, adapters: bool = True) -> dict[str, torch.Tensor]:
        """This rank's rows of the per-token outputs, in ascending row order
        (:func:`batching.rank_rows`): ``{key: [rows_r, T]}`` float32 on CPU (rows_r may be 0);
        ``adapters=False``: the base model's, the LoRA adapters disabled on every rank."""
        eng = self.engine
        eng._check_request(entropy=entropy, values=values)
        micros, padding = self._plan(batch, micro_batch_size, micro_batch_tokens, pack)
        mine = sorted(i for rows, _ in micros for i in rows)
        where = {row: k for k, row in enumerate(mine)}
        width = batch.input_ids.shape[1]
        out: dict[str, torch.Tensor] = {}
        if eng.lora is not None and eng.lora.dropout:
            eng.model.eval()  # a log-prob pass runs without the adapters' dropout (the update's forward has it)
        with torch.no_grad(), eng.base_weights(not adapters):
            for rows, micro in micros:
                for key, value in eng._outputs(micro, entropy=entropy, pack=pack).items():
                    full = out.setdefault(key, torch.zeros(len(mine), width, dtype=torch.float32))
                    full[[where[r] for r in rows], : value.shape[1]] = value.detach().float().cpu()
            for _ in range(padding):  # keep FSDP's all-gathers in step with the other ranks
                dummy = eng._outputs(trim_padding(batch.select(slice(0, 1))), entropy=entropy, pack=pack)
                for key in dummy:
                    out.setdefault(key, torch.zeros(len(mine), width, dtype=torch.float32))
        eng.model.train()
        return out

    # --------------------------------------------------------------- training

    def train_step(self, batch: TokenBatch, loss_fn: LossFn, micro_batch_size: int, denominator: Denominator,
                   capture_grads: bool = False, micro_batch_tokens: int = 0, pack: bool = False) -> dict[str, float]:
        """Backward over this rank's micro-batches, FSDP grad reduce-scatter (sum), global clip, AdamW step.

        Returns the loss and loss metrics combined over all ranks
        (:func:`~flowrl.algos.losses.combine_metrics`) plus ``grad_norm`` (global L2 before
        clipping), ``lr``, ``step``, ``skipped`` and ``pad_fraction`` (of the slots all ranks ran)
        - identical on every rank.
        """
        import torch.distributed as dist

        eng = self.engine
        entropy = eng.role == "actor" and eng.compute_entropy
        eng.model.train()
        eng.optimizer.zero_grad(set_to_none=True)
        micros, padding = self._plan(batch, micro_batch_size, micro_batch_tokens, pack)
        totals: dict[str, float] = {"loss": 0.0}
        for _, micro in micros:
            outputs = eng._outputs(micro, entropy=entropy, pack=pack)
            loss, metrics = _split_loss(loss_fn(outputs, micro.to(eng.device), denominator))
            loss.backward()
            totals["loss"] += float(loss.detach())
            combine_metrics(totals, metrics)
        for _ in range(padding):  # a zero-weight pass so every rank joins the same reduce-scatters
            dummy = eng._outputs(trim_padding(batch.select(slice(0, 1))), entropy=entropy, pack=pack)
            (sum(v.sum() for v in dummy.values()) * 0.0).backward()
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, totals)
        merged: dict[str, float] = {}
        for part in gathered:
            combine_metrics(merged, part)
        if capture_grads:
            self._grads = self._collect(lambda p: p.grad, eng.model.named_parameters())
        plans = batching.plan_ranks(batching.lengths_of(batch), self.world, max_rows=micro_batch_size,
                                    max_tokens=micro_batch_tokens, padded=not pack)
        pad = batching.pad_fraction(batch, [m for plan in plans for m in plan], pack)
        return {**merged, "pad_fraction": pad, **eng._apply_gradients()}

    # ------------------------------------------------------------ weights & io

    def _collect(self, pick: Any, named: Any) -> dict[str, torch.Tensor]:
        """Full tensors (collective) of ``pick(t)`` for each ``(name, t)``; kept on rank 0 only."""
        out: dict[str, torch.Tensor] = {}
        for name, t in named:
            value = pick(t)
            if value is None:
                continue
            full = _full(value)
            if self.rank == 0:
                out[name] = full.clone()
        return out

    def gather_weights(self, source: str = "weights") -> dict[str, torch.Tensor] | None:
        """Rank 0: ``{hf_name: full tensor}`` of the weights (``source="weights"``) or of the grads
        captured by the last ``train_step(capture_grads=True)`` (``"grads"``); other ranks: None."""
        if source == "grads":
            return self._grads if self.rank == 0 else None
        if source == "merged" and self.engine.lora is not None:  # the base with the adapters merged (an export)
            from flowrl.engines.lora import merged_state

            full = self._collect(lambda t: t, self.engine.model.state_dict().items())
            if self.rank != 0:
                return None
            compute = _compute_dtype(self.options)  # mixed precision: the model's 16-bit dtype, as it computes
            return {k: t.to(compute) if compute and t.is_floating_point() else t
                    for k, t in merged_state(full, self.engine.lora).items()}
        if self.engine.lora is not None:  # the adapters only, under PEFT's names (the base never changes)
            from flowrl.engines.lora import adapter_tensors

            full = self._collect(lambda t: t, adapter_tensors(self.engine.model))
            return full if self.rank == 0 else None
        # mixed precision: the weights the ranks compute with, the fp32 masters cast (gathered in 16 bits)
        compute = _compute_dtype(self.options)
        cast = (lambda t: t.to(compute) if t.is_floating_point() else t) if compute else (lambda t: t)
        full = self._collect(cast, self.engine.model.state_dict().items())
        return full if self.rank == 0 else None

    def save(self, path: str) -> None:
        """Sharded model + AdamW state via torch.distributed.checkpoint, plus ``rank{r}.pt`` (scheduler, step, RNG)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        eng = self.engine
        # Before the first step AdamW has no state; get_optimizer_state_dict would create it
        # (a step-1 state) and change later updates, so a fresh optimizer is not saved.
        has_optim = bool(eng.optimizer.state)
        state = {"model": _trained_state(eng, get_model_state_dict(eng.model))}
        if has_optim:
            state["optim"] = get_optimizer_state_dict(eng.model, eng.optimizer)
        dcp.save(state, checkpoint_id=str(Path(path, DCP_DIR)))
        torch.save({"step": eng.step, "scheduler": eng.scheduler.state_dict(), "has_optim": has_optim,
                    "rng_cpu": torch.get_rng_state()}, Path(path, f"rank{self.rank}.pt"))

    def load(self, path: str) -> None:
        """Restore what :meth:`save` wrote (same dp)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        eng = self.engine
        extra = load_tensors_file(Path(path, f"rank{self.rank}.pt"))
        state = {"model": _trained_state(eng, get_model_state_dict(eng.model))}
        if extra["has_optim"]:
            state["optim"] = get_optimizer_state_dict(eng.model, eng.optimizer)
        dcp.load(state, storage_reader=_safe_reader(str(Path(path, DCP_DIR))), planner=_safe_load_planner())
        # LoRA: the adapters alone (the frozen base came from the model's checkpoint as the engine started)
        set_model_state_dict(eng.model, state["model"], options=StateDictOptions(strict=eng.lora is None))
        if extra["has_optim"]:
            set_optimizer_state_dict(eng.model, eng.optimizer, state["optim"])
        else:
            eng.optimizer.state.clear()
        eng.scheduler.load_state_dict(extra["scheduler"])
        eng.step = int(extra["step"])
        torch.set_rng_state(extra["rng_cpu"])

    # ---------------------------------------------------------- memory phases

    def offload(self) -> int:
        """This rank's parameter, gradient and AdamW shards to host memory; the bytes moved."""
        return self.engine.offload()

    def reload(self) -> int:
        """Bring back what :meth:`offload` moved, in place; the bytes moved."""
        return self.engine.reload()

    def state_checksums(self) -> dict[str, int]:
        """CRC-32 of this rank's parameter, gradient and optimizer-state shards."""
        return self.engine.state_checksums()

    def shutdown(self) -> None:
        """Leave the process group."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# ---- reading torch.distributed.checkpoint's files without running code ---------------------------------
# DCP reads its ``.metadata`` with pickle.load and its non-tensor items with torch.load(weights_only=False):
# a checkpoint someone hands you could run code on --resume. Both are read here with an allowlist instead.

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner")


def _safe_metadata(stream) -> Any:
    """Unpickle DCP's ``.metadata``: only DCP's own metadata records, torch sizes/dtypes and plain containers."""
    import dataclasses
    import enum
    import pickle

    class Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if module in _DCP_MODULES:  # DCP's records: dataclasses and enums (built from their fields), no functions
                found = super().find_class(module, name)
                if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                    return found
            if (module, name) in (("collections", "OrderedDict"), ("torch", "Size"), ("pathlib", "PosixPath"),
                                  ("torch.serialization", "_get_layout")):  # _get_layout: a layout looked up by name
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
                return getattr(torch, name)
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's metadata")

    return Restricted(stream).load()


def _safe_reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from flowrl.engines.base import EngineError

            path = self._get_metadata_path(kwargs.get("rank"))
            if not self.fs.exists(path):  # one metadata file for all ranks (what dcp.save writes by default)
                path = self._get_metadata_path()
            try:
                with self.fs.create_stream(path, "rb") as f:
                    metadata = _safe_metadata(f)
            except Exception as e:
                raise EngineError(f"{path} is not an engine checkpoint this flowrl wrote ({type(e).__name__}: "
                                  f"{str(e)[:200]}); it was not loaded; hint: it was damaged or replaced: resume "
                                  f"from another checkpoint (`--resume-step`), or start a new run") from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader


def _safe_reader(path: str) -> Any:
    return _safe_reader_class()(path)


def _safe_load_planner() -> Any:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            loaded = load_tensors_file(value)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeLoadPlanner()
