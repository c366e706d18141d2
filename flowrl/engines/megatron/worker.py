"""One Megatron rank: the model shard, optimizer and schedule calls of a single process.

A :class:`MegatronRank` lives in its own process (spawned by
:class:`~flowrl.engines.megatron.engine.MegatronTrainEngine`, or hosted by a Ray actor),
joins a ``torch.distributed`` group (gloo on CPU, NCCL on GPUs), initialises Megatron's
``parallel_state`` for (tp, pp, dp, cp) and builds its ``GPTModel`` stage. Every method is
collective: all ranks of the group call it with the same arguments (each rank then
takes its data-parallel slice), like Megatron's own training loop.

Per-token math on the last pipeline stage works on *vocab-parallel* logits
``[b, t, V/tp]``: log-probabilities come from Megatron's
``vocab_parallel_cross_entropy`` and entropy from the same max / sum-exp all-reduces,
so no rank ever materialises the full vocabulary.

With context parallelism (cp > 1) each micro-batch is padded to a multiple of ``2 * cp``
tokens and every CP rank runs the model on its two load-balanced chunks
(:mod:`~flowrl.engines.megatron.context_parallel`: all-gathered K/V, queries at global
positions). Per-token outputs are computed on the local tokens, then all-gathered back
into token order, so ``loss_fn`` sees the whole ``[b, T]`` micro-batch on every CP rank
(each keeps the gradient of its own tokens) and any loss works unchanged.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

from flowrl.algos.losses import combine_metrics
from flowrl.algos.schedules import lr_factor
from flowrl.engines.ranks import dp_slices, local_device_index
from flowrl.engines.base import Denominator, EngineConfigError, EngineError, accelerator, load_tensors_file
from flowrl.engines.megatron.context_parallel import cp_layer_spec, cp_token_index, gather_sequence, padded_width
from flowrl.engines.megatron.convert import (
    Layout,
    ModelSpec,
    check_layout,
    expert_index,
    experts_to_global,
    hf_to_megatron,
    megatron_to_hf,
    merge_tp,
    padded_vocab_size,
    set_rope_frequencies,
    shard_state,
    to_global_names,
    tp_rule,
)
from flowrl.engines.types import TokenBatch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_PAD_LOGIT = -1.0e30
"""Logit given to padded vocabulary rows: exp() of it is exactly 0 after the max shift."""


@dataclass(frozen=True)
class RankOptions:
    """Everything a rank needs to build its part of the engine (picklable plain data)."""

    model_path: str
    """transformers checkpoint directory (config.json + *.safetensors)."""
    tp: int = 1
    """Tensor-parallel size (splits heads, MLP and vocabulary)."""
    pp: int = 1
    """Pipeline-parallel size (splits the layers into stages)."""
    dp: int = 1
    """Data-parallel size (splits the batch rows)."""
    cp: int = 1
    """Context-parallel size (splits each sequence into 2*cp chunks, two per CP rank)."""
    ep: int = 1
    """Expert-parallel size (a mixture of experts: each of ``ep`` data-parallel ranks holds
    ``experts / ep`` experts of every MoE layer; tokens travel to their experts by all-to-all).
    It divides ``dp``: Megatron carves expert-parallel groups out of the data-parallel ranks."""
    role: str = "actor"
    """``"actor"`` (logprobs / entropy) or ``"critic"`` (values from a Linear(H, 1) head)."""
    temperature: float = 1.0
    """Logits are divided by this before log_softmax."""
    lr: float = 1e-5
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW moment decay rates."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay, applied to every parameter (like the torch engine)."""
    warmup_steps: int = 0
    """Linear warm-up steps (the torch engine's schedule)."""
    lr_schedule: str = "constant"
    """Decay after the warm-up (:data:`flowrl.algos.schedules.LR_SCHEDULES`)."""
    total_steps: int = 0
    """Optimizer steps the schedule spans, warm-up included."""
    min_lr_ratio: float = 0.0
    """The decayed rate's floor, as a fraction of ``lr``."""
    max_grad_norm: float | None = 1.0
    """Global L2 clip; None disables clipping (the norm is still reported)."""
    seed: int = 0
    """Megatron's RNG seed and the critic head's init seed."""
    dtype: str = "float32"
    """Parameter dtype: the model computes in it (bf16 runs on CPU too, through torch's own kernels); a
    16-bit one trains mixed: Megatron's ``bf16``/``fp16`` optimizer keeps fp32 main params and Adam
    moments (with the distributed optimizer, sharded over dp) and fp32 grad buffers."""
    distributed_optimizer: bool = True
    """Shard optimizer state across data-parallel ranks (Megatron's distributed optimizer) when dp > 1."""
    vocab_divisible_by: int = 1
    """Pad the vocabulary to a multiple of ``vocab_divisible_by * tp``."""
    compute_entropy: bool = True
    """Whether ``train_step`` passes ``"entropy"`` to the loss (actor)."""
    threads: int | None = None
    """torch intra-op threads per rank; None = cpu_count // world_size."""
    backend: str | None = None
    """torch.distributed backend; None = "nccl" with CUDA, else "gloo"."""
    skip_cpu_shims: tuple[str, ...] = ()
    """Names of CPU shims *not* to apply (tests use it to show each shim is needed)."""

    @property
    def world_size(self) -> int:
        """Number of rank processes: tp * pp * dp * cp."""
        return self.tp * self.pp * self.dp * self.cp


@dataclass
class StepRecord:
    """What one rank reports after a schedule call (merged by the engine)."""

    coords: dict[str, int]
    """``{"rank", "tp", "pp", "dp", "cp"}`` of the reporting rank."""
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    """forward: per-token ``[rows, T]`` float32 outputs of this rank's dp slice (last stage only)."""
    stats: dict[str, float] = field(default_factory=dict)
    """train_step: summed loss/metrics (last stage) and grad_norm, lr, step, skipped."""


class ValueHead(torch.nn.Module):
    """The critic's ``Linear(H, 1)``, in the place of ``GPTModel.output_layer`` (replicated over TP).

    Called like Megatron's output layer: ``(hidden [s, b, H], weight=None, ...) -> (values [s, b, 1], None)``.
    """

    def __init__(self, hidden: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden))
        self.bias = torch.nn.Parameter(torch.zeros(1))

    def forward(self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None) -> tuple:
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None


def critic_head_init(hidden: int, seed: int) -> dict[str, torch.Tensor]:
    """The value head the torch engine's critic starts from (same seed -> same tensors).

    Returns ``{"value_head.weight": [1, H], "value_head.bias": [1]}``.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = torch.nn.Linear(hidden, 1)
    return {"value_head.weight": head.weight.detach().clone(), "value_head.bias": head.bias.detach().clone()}


def load_hf_state(path: str) -> dict[str, torch.Tensor]:
    """All tensors of the ``*.safetensors`` files in ``path`` (transformers naming)."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise EngineConfigError(f"no *.safetensors file in {path!r}; save the model with safe_serialization=True")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def micro_batches(batch: TokenBatch, size: int) -> list[TokenBatch]:
    """Consecutive micro-batches of ``size`` rows, each trimmed of all-padding columns."""
    from flowrl.engines.torch_train import trim_padding

    return [trim_padding(batch.select(slice(s, s + size))) for s in range(0, batch.size, size)]


def _shift_right(x: torch.Tensor) -> torch.Tensor:
    """[b, t-1] predictions of tokens 1..t-1 -> [b, t] with 0 at position 0."""
    return torch.cat([x.new_zeros(x.shape[0], 1), x], dim=1)


class MegatronRank:
    """One process of the Megatron engine (see the module docstring).

    Args:
        rank, world_size: this process's global rank and the group size (= tp * pp * dp * cp).
        init_method: ``torch.distributed`` rendezvous URL (``tcp://host:port``).
        options: the engine's :class:`RankOptions`.
    """

    def __init__(self, rank: int, world_size: int, init_method: str, options: RankOptions):
        if world_size != options.world_size:
            raise EngineConfigError(f"world_size={world_size} != tp*pp*dp*cp={options.world_size}")
        self.options = options
        threads = options.threads or max(1, (os.cpu_count() or 1) // world_size)
        torch.set_num_threads(threads)
        self._init_distributed(rank, world_size, init_method)
        self.spec = ModelSpec.from_pretrained(options.model_path)
        check_layout(self.spec, options.tp, options.pp, options.ep)
        if self.spec.tie_embeddings and options.pp > 1 and options.role == "actor":
            raise EngineConfigError(
                "tied word embeddings with pp > 1 are not supported by this engine; use pp=1 or an untied checkpoint"
            )
        self.layout = Layout(options.tp, self.ps.get_tensor_model_parallel_rank(), options.pp,
                             self.ps.get_pipeline_model_parallel_rank(), options.vocab_divisible_by,
                             options.ep, self.ps.get_expert_model_parallel_rank())
        self.coords = {
            "rank": rank,
            "tp": self.layout.tp_rank,
            "pp": self.layout.pp_rank,
            "dp": self.ps.get_data_parallel_rank(),
            "cp": self.ps.get_context_parallel_rank(),
            "ep": self.layout.ep_rank,
        }
        self.first_stage = self.ps.is_pipeline_first_stage()
        self.last_stage = self.ps.is_pipeline_last_stage()
        self.step = 0
        self.model = self._build_model()
        self._load_hf(options.model_path)
        self.ddp, self.optimizer = self._wrap_and_optimize()

    # ------------------------------------------------------------------ set-up

    def _init_distributed(self, rank: int, world_size: int, init_method: str) -> None:
        import torch.distributed as dist

        from flowrl.engines.megatron.cpu_shims import apply_cpu_shims

        backend = self.options.backend or (dist.Backend.NCCL if torch.cuda.is_available() else dist.Backend.GLOO)
        if backend == dist.Backend.NCCL:
            torch.cuda.set_device(local_device_index())  # the GPU its host gave this rank
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
        apply_cpu_shims(skip=self.options.skip_cpu_shims)  # no-op when a GPU is visible
        from megatron.core import parallel_state, tensor_parallel

        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.options.tp, pipeline_model_parallel_size=self.options.pp,
            context_parallel_size=self.options.cp,
            # Experts whole on each rank (expert tensor parallelism 1), split ep ways.
            expert_model_parallel_size=self.options.ep, expert_tensor_parallel_size=1,
        )
        tensor_parallel.model_parallel_cuda_manual_seed(self.options.seed)
        self.ps = parallel_state

    def _transformer_config(self) -> Any:
        import torch.nn.functional as F
        from megatron.core.transformer import TransformerConfig

        s, o = self.spec, self.options
        dtype = _DTYPES[o.dtype]
        return TransformerConfig(
            num_layers=s.layers, hidden_size=s.hidden, num_attention_heads=s.heads, num_query_groups=s.kv_heads,
            kv_channels=s.head_dim, ffn_hidden_size=s.ffn, normalization="RMSNorm", layernorm_epsilon=s.rms_eps,
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=s.qkv_bias,
            qk_layernorm=s.qk_norm,
            hidden_dropout=0.0, attention_dropout=0.0,
            tensor_model_parallel_size=o.tp, pipeline_model_parallel_size=o.pp, context_parallel_size=o.cp,
            params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
            use_cpu_initialization=not torch.cuda.is_available(), perform_initialization=False,
            # Fused kernels are CUDA-only; the unfused paths compute the same functions.
            bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
            gradient_accumulation_fusion=False, apply_rope_fusion=False, bias_dropout_fusion=False,
            # Losses are normalised by the caller's global denominator: Megatron must not
            # divide by micro-batch count or token count again (see train_step).
            calculate_per_token_loss=True,
            # Micro-batches are trimmed to their own longest row; pipeline stages exchange shapes.
            variable_seq_lengths=True,
            # The all-to-all dispatcher takes the different token counts of the ep ranks' micro-batches
            # (the allgather one needs equal ones, and Megatron's config refuses it with
            # variable_seq_lengths); on CPU it needs two shims (cpu_shims: moe_*). Set for dense
            # models too, where it only satisfies that config check.
            moe_token_dispatcher_type="alltoall",
            **self._moe_config(),
        )

    def _moe_config(self) -> dict[str, Any]:
        """TransformerConfig fields of a mixture of experts ({} for a dense model).

        Qwen3-MoE routes by a softmax over all E experts' logits, keeps the top k and, with
        ``norm_topk_prob``, divides them by their sum: that is Megatron's default router (top k
        of the logits, then a softmax over those k). Without ``norm_topk_prob`` it is
        ``moe_router_pre_softmax`` (softmax over all E, then top k). No auxiliary load-balancing
        loss: the losses flowrl trains with are the RL objective only, as in the torch engine
        (transformers adds the router's aux loss only when ``output_router_logits`` is set).
        """
        s, o = self.spec, self.options
        if not s.moe:
            return {}
        return dict(
            num_moe_experts=s.experts, moe_router_topk=s.experts_per_token, moe_ffn_hidden_size=s.expert_ffn,
            moe_router_pre_softmax=not s.norm_topk_prob, moe_router_score_function="softmax",
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_router_dtype="fp32",
            moe_grouped_gemm=False,  # SequentialMLP: one Linear pair per expert (grouped GEMM is CUDA-only)
            moe_permute_fusion=False, moe_router_fusion=False,
            expert_model_parallel_size=o.ep, expert_tensor_parallel_size=1,
        )

    def _build_model(self) -> torch.nn.Module:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        s, o = self.spec, self.options
        self.config = self._transformer_config()
        self.padded_vocab = padded_vocab_size(s.vocab_size, o.tp, o.vocab_divisible_by)
        spec = get_gpt_layer_local_spec(num_experts=s.experts or None, moe_grouped_gemm=False,
                                        normalization="RMSNorm", qk_layernorm=s.qk_norm)
        if o.cp > 1:  # Megatron's local attention is cp=1 only; its CP attention needs Transformer Engine
            spec = cp_layer_spec(spec)
        model = GPTModel(
            self.config, spec, vocab_size=self.padded_vocab,
            max_sequence_length=s.max_position, pre_process=self.first_stage, post_process=self.last_stage,
            parallel_output=True, share_embeddings_and_output_weights=s.tie_embeddings and o.role == "actor",
            position_embedding_type="rope", rotary_base=int(s.rope_theta),
        )
        set_rope_frequencies(model, s)  # the checkpoint's RoPE (Llama 3.x scaling...), as transformers computes it
        if o.role == "critic" and self.last_stage:
            model.output_layer = ValueHead(s.hidden)
        if torch.cuda.is_available():
            model.cuda()
        return model

    def _load_hf(self, path: str) -> None:
        hf = load_hf_state(path)
        if self.options.role == "critic":
            hf.update(critic_head_init(self.spec.hidden, self.options.seed))
        full = hf_to_megatron(hf, self.spec, self.options.role)
        self.load_local(shard_state(full, self.spec, self.layout, self.options.role))

    def load_local(self, local: dict[str, torch.Tensor]) -> None:
        """Copy a local (this rank's) Megatron state dict into the live parameters, checking names and shapes."""
        params = dict(self.model.named_parameters())
        if set(params) != set(local):
            raise EngineError(
                f"rank {self.coords}: weights do not match the model: missing {sorted(set(params) - set(local))[:3]}, "
                f"unexpected {sorted(set(local) - set(params))[:3]}"
            )
        with torch.no_grad():
            for name, param in params.items():
                if param.shape != local[name].shape:
                    raise EngineError(f"{name}: checkpoint shape {tuple(local[name].shape)} != {tuple(param.shape)}")
                param.copy_(local[name])

    def _wrap_and_optimize(self) -> tuple[Any, Any]:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o = self.options
        # Megatron's DDP reduces grads (and the distributed optimizer shards its state) over
        # the dp x cp group: CP ranks hold the same weights and partial grads of them.
        use_dist_opt = o.distributed_optimizer and o.dp * o.cp > 1
        ddp = DistributedDataParallel(
            self.config,
            DistributedDataParallelConfig(use_distributed_optimizer=use_dist_opt, overlap_grad_reduce=False,
                                          grad_reduce_in_fp32=True),
            self.model,
        )
        # The schedule hands finalize_model_grads the summed token count of
        # calculate_per_token_loss and would divide the grads by it; our loss_fn already
        # divides by the global denominator, so the count is dropped.
        self.config.finalize_model_grads_func = lambda models, num_tokens=None, **kw: finalize_model_grads(
            models, None, **kw)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.betas[0],
                            adam_beta2=o.betas[1], adam_eps=o.eps, clip_grad=o.max_grad_norm or 0.0,
                            use_distributed_optimizer=use_dist_opt, params_dtype=_DTYPES[o.dtype],
                            bf16=o.dtype == "bfloat16", fp16=o.dtype == "float16"),
            [ddp],
            config_overrides={},  # weight decay on every parameter, as in the torch engine
        )
        return ddp, optimizer

    # ----------------------------------------------------------------- helpers

    def _my_rows(self, batch: TokenBatch) -> TokenBatch:
        return batch.select(dp_slices(batch.size, self.options.dp)[self.coords["dp"]])

    def _model_inputs(self, micro: TokenBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """input_ids, position_ids and attention mask of ``micro`` as this rank feeds them to the model.

        cp = 1: ``[b, t]`` ids and positions and the causal mask ``[1, 1, t, t]`` (True = masked).
        cp > 1: the width is padded to a multiple of ``2 * cp`` and this rank gets its two
        chunks, ``[b, t_pad / cp]`` ids with their global positions; the mask is None (the CP
        attention masks causally by global position).
        """
        device = torch.device(accelerator())
        ids = micro.input_ids.to(device)
        t = ids.shape[1]
        # Right padding: every real token's keys lie at or before it, so a causal mask
        # equals the causal+padding mask on the positions that count.
        if self.options.cp > 1:
            mine = self._cp_positions(t, device)
            ids = torch.nn.functional.pad(ids, (0, padded_width(t, self.options.cp) - t)).index_select(1, mine)
            return ids, mine.unsqueeze(0).expand_as(ids), None
        positions = torch.arange(t, device=device).unsqueeze(0).expand_as(ids)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=device), diagonal=1)[None, None]
        return ids, positions, mask

    def _cp_positions(self, width: int, device: torch.device) -> torch.Tensor:
        """Global positions of this CP rank's tokens in a micro-batch of ``width`` tokens (padded for CP)."""
        return cp_token_index(padded_width(width, self.options.cp), self.options.cp, self.coords["cp"], device)

    def _next_tokens(self, micro: TokenBatch, device: torch.device) -> torch.Tensor:
        """For each position the model ran on, the token that follows it (0 after the last): [b, s]."""
        ids = micro.input_ids.to(device)
        following = torch.nn.functional.pad(ids[:, 1:], (0, 1))
        if self.options.cp == 1:
            return following
        t = ids.shape[1]
        following = torch.nn.functional.pad(following, (0, padded_width(t, self.options.cp) - t))
        return following.index_select(1, self._cp_positions(t, device))

    def _align(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """[b, s] values computed at each model position for the *next* token -> [b, width] aligned with the
        token they score (0 at position 0). With cp > 1 the CP ranks' positions are gathered into token
        order first (each rank keeps the gradient of its own positions: all compute the same loss)."""
        if self.options.cp > 1:
            x = gather_sequence(x, 1, self.ps.get_context_parallel_group(), "own")
        return _shift_right(x[:, : width - 1])

    def _token_outputs(self, logits: torch.Tensor, micro: TokenBatch, *, entropy: bool) -> dict[str, torch.Tensor]:
        """Last stage: model output [b, s, V/tp] (actor) or [b, s, 1] (critic) -> per-token [b, t] outputs.

        ``s`` is the micro-batch width ``t``, or with cp > 1 this CP rank's share of it (padded).
        """
        attn = micro.attention_mask.to(logits.device).float()
        width = attn.shape[1]
        if self.options.role == "critic":
            # values[t] is the state before token t: the hidden state at t-1.
            return {"values": self._align(logits[..., 0].float(), width) * attn}
        from megatron.core import tensor_parallel

        z = logits.float() / self.options.temperature
        z = self._mask_padded_vocab(z)
        # vocab_parallel_cross_entropy shifts its input in place: give it its own copy.
        nll = tensor_parallel.vocab_parallel_cross_entropy(z.clone(), self._next_tokens(micro, z.device))
        out = {"logprobs": self._align(-nll, width) * attn}
        if entropy:
            out["entropy"] = self._align(self._vocab_parallel_entropy(z), width) * attn
        return out

    def _mask_padded_vocab(self, z: torch.Tensor) -> torch.Tensor:
        """Give padded vocabulary rows (ids >= the real vocab size) a logit whose exp is 0."""
        local = z.shape[-1]
        start = self.layout.tp_rank * local
        if start + local <= self.spec.vocab_size:
            return z
        ids = torch.arange(start, start + local, device=z.device)
        return z.masked_fill(ids >= self.spec.vocab_size, _PAD_LOGIT)

    def _vocab_parallel_entropy(self, z: torch.Tensor) -> torch.Tensor:
        """Entropy (nats) of softmax over the full vocabulary from TP-sharded logits ``z`` [b, t, V/tp].

        ``H = m + log S - P / S`` with ``S = sum exp(z - m)``, ``P = sum z exp(z - m)``
        summed across TP ranks (all-reduce forward, identity backward: every rank holds
        the same loss, and each backpropagates into its own vocabulary shard).
        """
        import torch.distributed as dist
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

        m = z.detach().max(dim=-1).values
        if self.options.tp > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=self.ps.get_tensor_model_parallel_group())
        e = torch.exp(z - m.unsqueeze(-1))
        s = reduce_from_tensor_model_parallel_region(e.sum(-1))
        p = reduce_from_tensor_model_parallel_region((e * z).sum(-1))
        return m + torch.log(s) - p / s

    def _run_schedule(self, micros: list[TokenBatch], loss_func: Callable, *, forward_only: bool,
                      force_all_reduce: bool = False) -> list[Any]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Callable]:
            micro = next(data_iterator)
            ids, positions, mask = self._model_inputs(micro)
            return model(ids, positions, mask), partial(loss_func, micro)

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micros), model=[self.ddp],
            num_microbatches=len(micros),
            seq_length=max(padded_width(m.input_ids.shape[1], self.options.cp) for m in micros),
            micro_batch_size=max(m.size for m in micros), forward_only=forward_only,
            force_all_reduce=force_all_reduce,
        )

    # ----------------------------------------------------------------- API

    def forward(self, batch: TokenBatch, *, entropy: bool, micro_batch_size: int) -> StepRecord:
        """Per-token outputs (no grad) of this rank's data-parallel slice of ``batch``.

        Only last-stage ranks return outputs: ``[rows, T]`` float32 tensors (T = the
        batch's width); the engine concatenates the dp slices in rank order.
        """
        mine = self._my_rows(batch)
        if mine.size == 0:
            return StepRecord(self.coords)
        width = batch.input_ids.shape[1]

        def collect(micro: TokenBatch, output: torch.Tensor) -> tuple:
            outs = {k: v.detach().float().cpu() for k, v in self._token_outputs(output, micro, entropy=entropy).items()}
            return output.new_zeros(()), torch.tensor(1, dtype=torch.int), outs

        self.ddp.eval()
        with torch.no_grad():
            store = self._run_schedule(micro_batches(mine, micro_batch_size), collect, forward_only=True)
        self.ddp.train()
        if not self.last_stage:
            return StepRecord(self.coords)
        outputs: dict[str, list[torch.Tensor]] = {}
        for part in store:
            for key, value in part.items():
                padded = torch.zeros(value.shape[0], width)
                padded[:, : value.shape[1]] = value
                outputs.setdefault(key, []).append(padded)
        return StepRecord(self.coords, {k: torch.cat(v) for k, v in outputs.items()})

    def train_step(self, batch: TokenBatch, loss_fn: Callable, *, micro_batch_size: int,
                   denominator: Denominator, capture_grads: bool = False) -> StepRecord:
        """Forward/backward over this rank's dp slice in micro-batches, grad sync, one optimizer step.

        Gradients are *summed* over micro-batches and data-parallel ranks
        (``calculate_per_token_loss`` turns off Megatron's own averaging), which is the
        gradient of the whole batch because ``loss_fn`` divides by the global
        ``denominator``. ``stats`` hold this rank's summed losses/metrics (last stage)
        plus ``grad_norm``, ``lr`` and ``skipped`` (identical on every rank).
        ``capture_grads`` keeps a copy of the synchronised, unclipped gradients for
        :meth:`gather_hf_weights` (``source="grads"``); with the distributed optimizer it
        makes the dp sync an all-reduce so that every rank holds whole gradients.
        """
        import torch.distributed as dist

        mine = self._my_rows(batch)
        if mine.size == 0:
            raise EngineConfigError(
                f"batch of {batch.size} rows is smaller than dp={self.options.dp}; give every dp rank a row"
            )
        want_entropy = self.options.role == "actor" and self.options.compute_entropy

        def loss_func(micro: TokenBatch, output: torch.Tensor) -> tuple:
            micro = micro.to(output.device)  # the loss mixes outputs with the batch's extras
            loss, metrics = _split_loss(loss_fn(self._token_outputs(output, micro, entropy=want_entropy),
                                                micro, denominator))
            reported = {"loss": float(loss.detach())}
            reported.update({k: float(v) for k, v in metrics.items()})
            return loss, torch.tensor(1, dtype=torch.int), reported

        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        store = self._run_schedule(micro_batches(mine, micro_batch_size), loss_func, forward_only=False,
                                   force_all_reduce=capture_grads)
        if capture_grads:
            self._grads = {n: p.main_grad.detach().clone().view_as(p) for n, p in self.model.named_parameters()}
        stats: dict[str, float] = {}
        for part in store:
            combine_metrics(stats, part)
        # Combine the metrics of all dp ranks (the last stage holds them) as the micro-batches were.
        if self.last_stage and self.options.dp > 1:
            for op, keep in ((dist.ReduceOp.MAX, lambda k: k.endswith("_max")),
                             (dist.ReduceOp.MIN, lambda k: k.endswith("_min")),
                             (dist.ReduceOp.SUM, lambda k: not k.endswith(("_max", "_min")))):
                keys = sorted(k for k in stats if keep(k))
                packed = torch.tensor([stats[k] for k in keys] or [0.0], dtype=torch.float64)
                dist.all_reduce(packed, op=op, group=self.ps.get_data_parallel_group())
                stats.update(zip(keys, packed.tolist()))
        return StepRecord(self.coords, stats={**stats, **self._apply_gradients()})

    def _apply_gradients(self) -> dict[str, float]:
        """Clip and step; skip the update (on every rank alike) if the global grad norm is not finite."""
        lr = self._lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.prepare_grads()
        norm = float(self.optimizer.get_grad_norm())  # all-reduced over model-parallel ranks
        skipped = not math.isfinite(norm)
        if not skipped:
            self.optimizer.step()  # prepares, clips to max_grad_norm and steps
        self.step += 1
        return {"grad_norm": norm, "lr": lr, "step": float(self.step), "skipped": float(skipped)}

    def _lr(self) -> float:
        """The learning rate of this step: the torch engine's schedule (:func:`flowrl.algos.schedules.lr_factor`)."""
        o = self.options
        return o.lr * lr_factor(self.step, schedule=o.lr_schedule, warmup=max(int(o.warmup_steps), 0),
                                total=int(o.total_steps), min_ratio=float(o.min_lr_ratio))

    def local_weights(self) -> dict[str, torch.Tensor]:
        """This rank's parameters, Megatron naming, stage-local layer numbers."""
        return {name: p.detach() for name, p in self.model.named_parameters()}

    def gather_hf_weights(self, source: str = "weights") -> dict[str, torch.Tensor]:
        """This pipeline stage's weights (or captured gradients) in transformers naming, full tensors.

        ``source``: ``"weights"`` or ``"grads"`` (those of the last ``train_step(capture_grads=True)``).
        Collective over the TP group, and with ep > 1 over the expert-parallel group (every rank
        must call it); only ranks with tp_rank == 0, dp_rank == 0 and cp_rank == 0 return tensors,
        the others return ``{}`` (dp and cp ranks hold the same weights; the experts of the other
        ep ranks are all-gathered).
        """
        import torch.distributed as dist

        if source == "grads" and not hasattr(self, "_grads"):
            raise EngineConfigError("no gradients captured; call train_step(..., capture_grads=True) first")
        tensors = self.local_weights() if source == "weights" else self._grads
        group = self.ps.get_tensor_model_parallel_group()
        o = self.options
        stage: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            if o.tp > 1 and tp_rule(name, o.role) != "replicated":
                shards = [torch.empty_like(tensor) for _ in range(o.tp)]
                dist.all_gather(shards, tensor.contiguous(), group=group)
            else:
                shards = [tensor]
            if o.ep > 1 and expert_index(name) is not None:
                # Every ep rank holds the same local names for its own experts (whole: expert
                # tensor parallelism 1): gather them; ep rank r's local expert j is global r E/ep + j.
                parts = [torch.empty_like(tensor) for _ in range(o.ep)]
                dist.all_gather(parts, tensor.contiguous(), group=self.ps.get_expert_model_parallel_group())
                for r, part in enumerate(parts):
                    stage.update(experts_to_global({name: part.cpu()}, self.spec, o.ep, r))
            else:
                # Copies, never the live parameters: the rank's result queue moves a CPU tensor's
                # storage into shared memory in place, and a later offload() resizing that storage
                # crashes the rank (SIGSEGV in reload). On CUDA .cpu() copies anyway.
                stage[name] = merge_tp(name, [s.to("cpu", copy=True) for s in shards], self.spec, o.role)
        if self.coords["tp"] != 0 or self.coords["dp"] != 0 or self.coords["cp"] != 0:
            return {}
        full = to_global_names(stage, self.spec, self.options.pp, self.layout.pp_rank)
        hf = megatron_to_hf(full, self.spec, self.options.role)
        if source == "weights":  # the model's dtype (torch's RMSNorm keeps fp32 weights in a bf16 model on CPU)
            dtype = _DTYPES[o.dtype]
            hf = {k: v.to(dtype) if v.is_floating_point() else v for k, v in hf.items()}
        return hf

    # ------------------------------------------------------------ checkpoints

    def checkpoint_file(self, path: str) -> str:
        """Megatron's per-rank file name: ``mp_rank_{tp:02d}_{pp:03d}_dp{dp:03d}.pt`` inside ``path``
        (``..._cp{cp:02d}_dp...`` with cp > 1: CP ranks hold different optimizer shards)."""
        c = self.coords
        cp = f"_cp{c['cp']:02d}" if self.options.cp > 1 else ""
        return os.path.join(path, f"mp_rank_{c['tp']:02d}_{c['pp']:03d}{cp}_dp{c['dp']:03d}.pt")

    def _layout(self) -> dict[str, int]:
        o = self.options
        return {"tp": o.tp, "pp": o.pp, "dp": o.dp, "cp": o.cp, "ep": o.ep}

    def save(self, path: str) -> str:
        """Write this rank's model shard, optimizer state (its dist-optimizer shard), step and RNG states."""
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        os.makedirs(path, exist_ok=True)
        state = {
            "layout": self._layout(),
            "coords": dict(self.coords),  # which tp/pp/dp/cp/ep rank wrote it (flowrl export gathers by these)
            "role": self.options.role,
            "step": self.step,
            "model": {k: v.clone() for k, v in self.local_weights().items()},
            "optimizer": self._optimizer_state() if self.step > 0 else None,
            "rng_cpu": torch.get_rng_state(),
            "rng_tracker": get_cuda_rng_tracker().get_states(),
        }
        tmp = self.checkpoint_file(path) + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.checkpoint_file(path))
        return self.checkpoint_file(path)

    def _optimizer_state(self) -> list[dict[str, Any]]:
        """The inner torch optimizer's state of each (chained) Megatron optimizer.

        With the distributed optimizer the inner AdamW holds only this dp rank's shard
        of the main parameters, so each rank saves exactly its shard. (Megatron's
        sharded ``dist_checkpointing`` format would allow changing the layout on load,
        but its writer forks a manager process and its gathers call ``.cuda()``; see
        docs/engines.md.)
        """
        return [
            {"inner": opt.optimizer.state_dict(), "main_params": [p.detach().clone() for p in _inner_params(opt)]}
            for opt in _chained(self.optimizer)
        ]

    def load(self, path: str) -> None:
        """Restore what :meth:`save` wrote for this rank (same tp/pp/dp/cp layout required)."""
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        file = self.checkpoint_file(path)
        if not os.path.isfile(file):
            raise EngineError(f"no Megatron checkpoint file {file!r}; was {path!r} written by this engine's save()?")
        state = load_tensors_file(file, map_location="cpu")
        layout = self._layout()
        if state["layout"] != layout or state["role"] != self.options.role:
            raise EngineConfigError(
                f"checkpoint {path!r} was written by a {state['role']} with layout {state['layout']}; this engine is "
                f"a {self.options.role} with {layout}; load it with the same megatron(tp, pp, dp, cp)"
            )
        self.load_local(state["model"])
        if state["optimizer"] is not None:
            for opt, entry in zip(_chained(self.optimizer), state["optimizer"]):
                opt.optimizer.load_state_dict(entry["inner"])
                # The inner optimizer's params are the fp32 main params (the dp shard of
                # them with the distributed optimizer): exact resume in bf16 too.
                with torch.no_grad():
                    for param, saved in zip(_inner_params(opt), entry["main_params"]):
                        param.copy_(saved)
        self.step = int(state["step"])
        torch.set_rng_state(state["rng_cpu"])
        get_cuda_rng_tracker().set_states(state["rng_tracker"])

    # ---------------------------------------------------------- memory phases

    def offload(self) -> int:
        """This rank's parameters, gradient buffers and optimizer shards to host memory; the bytes moved."""
        from flowrl.engines.offload import HostStash, module_tensors, optimizer_tensors

        self._stash = getattr(self, "_stash", None) or HostStash()
        tensors = [*module_tensors(self.model)]  # its params hold views of DDP's grad buffers (main_grad)
        for opt in _chained(self.optimizer):
            tensors += optimizer_tensors(opt.optimizer)
        return self._stash.offload(tensors)

    def reload(self) -> int:
        """Bring back what :meth:`offload` moved, in place; the bytes moved."""
        stash = getattr(self, "_stash", None)
        return stash.reload() if stash is not None else 0

    def state_checksums(self) -> dict[str, int]:
        """CRC-32 of this rank's parameters, gradients (``main_grad``) and optimizer states."""
        from flowrl.engines.offload import state_checksums

        out: dict[str, int] = {}
        for i, opt in enumerate(_chained(self.optimizer)):
            out.update({f"{i}/{k}": v for k, v in state_checksums(self.model, opt.optimizer).items()})
        return out

    def shutdown(self) -> None:
        """Leave the process group."""
        import torch.distributed as dist

        if dist.is_initialized():
            self.ps.destroy_model_parallel()
            dist.destroy_process_group()


def _inner_params(opt: Any) -> list[torch.Tensor]:
    """The parameters the inner torch optimizer updates (main params / their dp shard), in order."""
    return [p for group in opt.optimizer.param_groups for p in group["params"]]


def _chained(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _split_loss(result: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    from flowrl.engines.torch_train import _split_loss as check

    return check(result)

