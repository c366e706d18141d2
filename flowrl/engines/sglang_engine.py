"""A :class:`~flowrl.engines.base.RolloutEngine` over SGLang's offline ``sglang.Engine``.

The same code runs on GPUs and, for tests, on the CPU: there the defaults are
SGLang's plain-torch paths (``attention_backend="torch_native"``,
``sampling_backend="pytorch"``, no overlap schedule) and a fixed KV pool
(``max_total_tokens``). The CPU install itself is the Makefile's (``sglang`` without
its CUDA-only dependencies, plus ``cpu_shims/``); nothing here is CPU-specific
beyond those defaults and, with tp > 1, the cores each rank runs on (:func:`cpu_rank_binding`:
SGLang otherwise wants a NUMA node per rank).

Sampling matches :class:`~flowrl.engines.vllm_engine.VLLMRolloutEngine`:

* each of the ``n`` samples of prompt ``i`` is its own request with seed
  ``spec.seed + i * n + j`` (SGLang's ``sampling_seed``), so no two samples share
  a random stream;
* top-k and top-p are applied by :class:`TopKTopPProcessor`, an SGLang custom logit
  processor that keeps only the top-k, then nucleus tokens of ``softmax(logits / T)``
  (vLLM's order and rule). SGLang then samples from, and reports the log of,
  ``softmax(kept / T)``: the returned logprobs are those of the distribution the
  token was drawn from, like vLLM's ``processed_logprobs``. (SGLang's own top-k/top-p
  would report logprobs before renormalisation.) Greedy requests report
  ``log_softmax(logits)``.

Seeds: SGLang honours ``sampling_seed`` only in its deterministic-inference mode
(``deterministic=True``), which needs a GPU attention backend (fa3, flashinfer,
triton...). Elsewhere requests draw from the scheduler's generator, seeded once by
``seed``: runs are not reproducible sample for sample.

Weights: :meth:`update_weights` hands ``(hf_name, tensor)`` pairs to
``update_weights_from_tensor`` inside a ``begin_weight_update`` /
``end_weight_update`` session; SGLang's loader fuses q/k/v into ``qkv_proj`` and
gate/up into ``gate_up_proj`` and shards them by tp (the layout
:mod:`flowrl.compiler.reshard` plans for ``sglang``), and the radix (prefix) cache
is flushed, so KV computed with the old weights is never reused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

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
    "install SGLang: `pip install sglang` on NVIDIA GPUs; on CPU machines `make test` installs "
    "`sglang==0.5.23` without its CUDA-only dependencies (see the Makefile); or use the rollout engine 'vllm'"
)

_FINISH_REASONS = {"stop": "stop", "length": "length"}
"""SGLang finish reason types -> Completion.finish_reason; anything else ("abort") is an error."""


@dataclass(frozen=True)
class SGLangOptions:
    """Options of :class:`SGLangRolloutEngine`; None means "pick the platform's default"."""

    dtype: str = "auto"
    """Weights/activations dtype ("float32", "bfloat16", "auto" = the checkpoint's)."""
    max_model_len: int = 1024
    """Longest prompt + response, in tokens (SGLang's ``context_length``)."""
    seed: int = 0
    """Engine seed (SGLang's ``random_seed``): the generator of requests whose seed is not honoured."""
    mem_fraction_static: float | None = None
    """Fraction of GPU memory for weights + KV pool (the flow's ``mem_fraction``); None: SGLang's."""
    tensor_parallel_size: int = 1
    """GPUs one engine shards the model over (SGLang's ``tp_size``). Data parallelism is one
    engine per replica (the runtime's worker group), as for vLLM: SGLang's in-engine
    ``dp_size`` refuses tensor weight updates."""
    max_total_tokens: int | None = None
    """KV pool size in tokens; default 32768 on CPU (SGLang's own sizing reserves ~15 GB there)."""
    device: str | None = None
    """"cuda" or "cpu"; default "cuda" when torch sees a GPU."""
    attention_backend: str | None = None
    """Default "torch_native" on CPU, SGLang's choice on GPUs."""
    sampling_backend: str | None = None
    """Default "pytorch" on CPU, SGLang's choice on GPUs."""
    deterministic: bool = False
    """SGLang's deterministic inference: honours per-request seeds (needs a GPU attention backend)."""
    threads: int | None = None
    """CPU only: torch threads of SGLang's scheduler process; default this process's count."""
    enable_memory_saver: bool | None = None
    """SGLang's memory saver (:meth:`SGLangRolloutEngine.sleep`); default on GPUs."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments passed to ``sglang.Engine`` as they are (e.g. chunked_prefill_size)."""


class TopKTopPProcessor:
    """SGLang custom logit processor: keep the top-k, then the top-p nucleus of ``softmax(logits / T)``.

    Per row, ``custom_params = {"temperature": T > 0, "top_k": k or -1, "top_p": p}``.
    Returns the ``[rows, vocab]`` logits with every other token set to ``-inf``.
    The rules are vLLM's: top-k keeps logits >= the k-th largest (ties kept); the
    nucleus drops the least likely tokens whose total mass is <= 1 - p (computed
    after top-k), always keeping the most likely one.
    """

    def __call__(self, logits: torch.Tensor, custom_param_list: list[dict] | None = None) -> torch.Tensor:
        params = custom_param_list or []
        if len(params) != logits.shape[0]:
            raise EngineError(f"TopKTopPProcessor got {len(params)} parameter sets for {logits.shape[0]} rows")
        dev = logits.device
        temp = torch.tensor([float(p["temperature"]) for p in params], device=dev).unsqueeze(1)
        top_k = torch.tensor([int(p["top_k"]) for p in params], device=dev)
        top_p = torch.tensor([float(p["top_p"]) for p in params], device=dev).unsqueeze(1)
        vocab = logits.shape[-1]
        scaled, order = (logits.float() / temp).sort(dim=-1)  # ascending
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        kth = scaled.gather(1, (vocab - k).unsqueeze(1))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        mass_below = scaled.softmax(dim=-1).cumsum(dim=-1)
        drop = mass_below <= 1 - top_p
        drop[:, -1] = False
        keep_sorted = ~(drop | scaled.isinf())
        keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
        return logits.masked_fill(~keep, float("-inf"))


def _import_sglang():
    """Import sglang or raise :class:`EngineNotInstalledError` with the install command."""
    try:
        import sglang
        from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor
    except ImportError as err:
        raise EngineNotInstalledError(
            f"rollout engine 'sglang' needs the sglang package ({err}); {INSTALL_HINT}"
        ) from err
    return sglang, CustomLogitProcessor


class SGLangRolloutEngine:
    """Rollout engine backed by one ``sglang.Engine`` (its scheduler runs in child processes).

    Args:
        model_path: transformers checkpoint dir (config, safetensors, tokenizer).
        options: :class:`SGLangOptions`; keyword ``overrides`` replace its fields.
    """

    Options = SGLangOptions
    """The keyword ``overrides`` it takes (the runtime's registry reads their names)."""

    def __init__(self, model_path: str, options: SGLangOptions | None = None, **overrides: Any):
        if not os.path.isdir(model_path):
            raise EngineConfigError(f"model_path={model_path!r} is not a directory; pass a save_pretrained dir")
        options = options or SGLangOptions()
        unknown = sorted(set(overrides) - set(SGLangOptions.__dataclass_fields__))
        if unknown:
            raise EngineConfigError(
                f"unknown SGLang option {unknown[0]!r}; known: {', '.join(SGLangOptions.__dataclass_fields__)}"
            )
        options = SGLangOptions(**{**options.__dict__, **overrides})
        sglang, custom_processor = _import_sglang()
        self.options = options
        self.device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
        cpu = self.device == "cpu"
        kwargs: dict[str, Any] = {
            "model_path": model_path,
            "device": self.device,
            "dtype": options.dtype,
            "context_length": options.max_model_len,
            "random_seed": options.seed,
            "tp_size": options.tensor_parallel_size,
            "enable_custom_logit_processor": True,
            "enable_deterministic_inference": options.deterministic,
            "log_level": "error",
        }
        cpu_defaults = {"max_total_tokens": 32768, "attention_backend": "torch_native", "sampling_backend": "pytorch"}
        for key in ("mem_fraction_static", "max_total_tokens", "attention_backend", "sampling_backend"):
            value = getattr(options, key)
            value = cpu_defaults.get(key) if value is None and cpu else value
            if value is not None:
                kwargs[key] = value
        if cpu:
            kwargs["disable_overlap_schedule"] = True  # the set-up measured on CPU (see module docstring)
        saver = options.enable_memory_saver if options.enable_memory_saver is not None else not cpu
        if saver:
            kwargs["enable_memory_saver"] = True
        self._memory_saver = saver
        kwargs.update(options.engine_kwargs)
        # SGLang's own serialiser (CustomLogitProcessor.to_str) applied to our class: dill pickles
        # it by reference, so SGLang's scheduler imports this module to run it.
        self._processor = custom_processor.to_str.__func__(TopKTopPProcessor)
        threads = options.threads or torch.get_num_threads()
        env = {"OMP_NUM_THREADS": str(threads)} if cpu else {}
        if cpu and "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ:
            bind = cpu_rank_binding(options.tensor_parallel_size, _numa_nodes(), sorted(os.sched_getaffinity(0)))
            if bind is not None:
                env[_BIND] = bind
        with _environment(env):
            self.engine = sglang.Engine(**kwargs)
        self._children = list(self.engine.get_all_child_pids())
        # sglang.Engine.shutdown kills *every* child of this process (Ray's included, in a
        # driver); shutdown() below stops only SGLang's own processes.
        import atexit

        atexit.unregister(self.engine.shutdown)
        atexit.register(self.shutdown)
        self.vocab_size = _vocab_size(model_path)
        tokenizer = self.engine.tokenizer_manager.tokenizer
        self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        self._special_texts = _special_texts(tokenizer)

    # ------------------------------------------------------------------ sampling

    def _sampling_params(self, spec: SamplingSpec, seed: int | None) -> tuple[dict, str | None]:
        """SGLang sampling params of one request, and the logit processor it needs (or None)."""
        params: dict[str, Any] = {
            "temperature": spec.temperature,
            "max_new_tokens": spec.max_tokens,
            "stop": list(spec.stop) or None,
        }
        if seed is not None:
            params["sampling_seed"] = seed
        filtered = spec.top_k > 0 or spec.top_p < 1.0
        if spec.temperature == 0.0 or not filtered:
            return params, None
        params["custom_params"] = {"temperature": spec.temperature, "top_k": spec.top_k, "top_p": spec.top_p}
        return params, self._processor

    def generate(self, prompts: list[list[int]], spec: SamplingSpec) -> list[list[Completion]]:
        """``spec.n`` completions per prompt, grouped per prompt in prompt order.

        ``Completion.logprobs[k]`` is the sampled token's log-probability under
        ``log_softmax(processed logits)`` (divided by T, top-k/top-p applied; greedy:
        raw logits). Sample ``j`` of prompt ``i`` uses seed ``spec.seed + i * n + j``.
        """
        check_sampling_spec(spec)
        check_prompts(prompts, self.vocab_size)
        check_lengths(prompts, spec.max_tokens, self.options.max_model_len)
        # Greedy samples are identical: decode once per prompt and repeat.
        copies = spec.n if spec.temperature == 0.0 else 1
        per_prompt = spec.n // copies
        # SGLang matches stop strings against text decoded *with* special tokens; when a stop
        # string overlaps a special token's text ("a" in "<pad>") that would end completions
        # vLLM keeps going, so such stops are cut here instead (same rule as vLLM's).
        cut_here = _overlaps_any(spec.stop, self._special_texts)
        request_spec = replace(spec, stop=()) if cut_here else spec
        rows, params, processors = [], [], []
        for i, prompt in enumerate(prompts):
            base = derive_seed(spec, i)
            for j in range(per_prompt):
                p, proc = self._sampling_params(request_spec, None if base is None else base + j)
                rows.append(list(prompt))
                params.append(p)
                processors.append(proc)
        outputs = self.engine.generate(
            input_ids=rows, sampling_params=params, return_logprob=True,
            custom_logit_processor=processors if any(processors) else None,
        )
        completions = [_completion(prompt, out) for prompt, out in zip(rows, outputs)]
        if cut_here:
            completions = [_cut_at_stop(c, spec.stop, self._decode) for c in completions]
        return [completions[i * per_prompt: (i + 1) * per_prompt] * copies for i in range(len(prompts))]

    # ------------------------------------------------------------------- weights

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load ``(hf_name, tensor)`` pairs in place and flush the radix cache.

        Pass full tensors in transformers naming (``model.layers.0.self_attn.q_proj.weight``);
        SGLang fuses and shards them.
        """
        pairs = [(name, tensor.detach()) for name, tensor in named_tensors]
        if not pairs:
            raise EngineConfigError("update_weights got no tensors; pass train_engine.named_weights()")
        _check_result("begin_weight_update", self.engine.begin_weight_update())
        try:
            result = self.engine.update_weights_from_tensor(named_tensors=pairs, flush_cache=True)
        finally:
            _check_result("end_weight_update", self.engine.end_weight_update())
        _check_result("update_weights_from_tensor", result)

    # ------------------------------------------------------------- memory phases

    def sleep(self) -> None:
        """SGLang ``release_memory_occupation()``: weights and KV cache out of GPU memory (memory saver on)."""
        self._check_memory_saver()
        self.engine.release_memory_occupation()  # returns None; a failure raises

    def wake_up(self, tags: list[str] | None = None) -> None:
        """SGLang ``resume_memory_occupation(tags)``: ``["weights"]``, then ``["kv_cache"]``; None: both."""
        self._check_memory_saver()
        self.engine.resume_memory_occupation(tags=tags)

    def _check_memory_saver(self) -> None:
        if not self._memory_saver:
            raise EngineConfigError("this SGLang engine was built without enable_memory_saver (off on CPU); "
                                    "build it with enable_memory_saver=True on a GPU")

    def shutdown(self) -> None:
        """Stop SGLang's scheduler and detokenizer processes (and theirs); leaves other children alone."""
        engine, self.engine = getattr(self, "engine", None), None
        if engine is None:
            return
        import psutil

        procs = []
        for pid in self._children:
            try:
                proc = psutil.Process(pid)
                procs += proc.children(recursive=True) + [proc]
            except psutil.NoSuchProcess:
                pass
        for proc in procs:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=30)


@contextmanager
def _environment(values: dict[str, str]):
    """Set environment variables for the duration of a ``with`` block (SGLang's children inherit them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_BIND = "SGLANG_CPU_OMP_THREADS_BIND"
"""SGLang's list of each CPU rank's cores (``"0-15|16-31"``, one group per rank)."""


def cpu_rank_binding(tp: int, numa_nodes: int, cores: list[int]) -> str | None:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for a CPU engine of ``tp`` ranks, or None to keep SGLang's own.

    Without it SGLang gives each rank a NUMA node of its own and refuses more ranks than nodes
    (an ``AssertionError`` when the engine starts: a one-node machine ran no ``sglang(tp = 2)``).
    Here the cores this process may use are cut into ``tp`` contiguous groups, one per rank
    (ranks share cores when there are fewer cores than ranks), as vLLM's CPU workers are told
    not to bind (``flowrl.engines.vllm_engine``).

    >>> cpu_rank_binding(2, 1, [0, 1, 2, 3]), cpu_rank_binding(4, 1, [0, 1]), cpu_rank_binding(2, 2, [0, 1])
    ('0-1|2-3', '0|1|0|1', None)
    """
    if tp <= 1 or numa_nodes >= tp or not cores:
        return None
    if len(cores) < tp:
        return "|".join(str(cores[r % len(cores)]) for r in range(tp))
    per = len(cores) // tp
    groups = [cores[r * per:(r + 1) * per] for r in range(tp)]
    return "|".join(_core_ranges(g) for g in groups)


def _core_ranges(cores: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out, start = [], cores[0]
    for prev, cur in zip(cores, cores[1:] + [None]):
        if cur is None or cur != prev + 1:  # a run of consecutive cores ends at prev
            out.append(f"{start}-{prev}" if prev != start else str(start))
            start = cur
    return ",".join(out)


def _numa_nodes() -> int:
    """NUMA nodes of this machine, as SGLang counts them."""
    from sglang.srt.utils import get_cpu_ids_by_node

    return len(get_cpu_ids_by_node()) or 1


def _vocab_size(model_path: str) -> int:
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg.get("text_config", {})["vocab_size"])


def _special_texts(tokenizer) -> tuple[str, ...]:
    """Texts of the tokenizer's special tokens (what SGLang's stop-string check sees for them)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    texts = set(getattr(tokenizer, "all_special_tokens", [])) | {t.content for t in added.values() if t.special}
    return tuple(sorted(t for t in texts if t))


def _overlaps_any(stops: tuple[str, ...], texts: tuple[str, ...]) -> bool:
    """Whether some stop string could match text that includes part of one of ``texts``.

    >>> _overlaps_any(("a",), ("<pad>",)), _overlaps_any(("</answer>",), ("<|im_end|>",))
    (True, False)
    >>> _overlaps_any(("end|>x",), ("<|im_end|>",))
    True
    """
    def overlap(a: str, b: str) -> bool:
        return a in b or b in a or any(a.endswith(b[:i]) or b.endswith(a[:i]) for i in range(1, min(len(a), len(b))))

    return any(overlap(s, t) for s in stops if s for t in texts)


def _cut_at_stop(c: Completion, stops: tuple[str, ...], decode) -> Completion:
    """``c`` ended at the first token whose decoded text (special tokens skipped) holds a stop string.

    The tokens up to and including that one are kept; the text ends before the stop string.
    """
    for k in range(1, len(c.response_ids) + 1):
        text = decode(list(c.response_ids[:k]))
        hits = [text.index(s) for s in stops if s and s in text]
        if hits:
            return replace(c, response_ids=c.response_ids[:k], logprobs=c.logprobs[:k], finish_reason="stop",
                           text=text[: min(hits)])
    return c


def _check_result(what: str, result: Any) -> None:
    """SGLang control calls return ``(success, message)``; raise :class:`EngineError` on failure."""
    success, message = result[0], result[1]
    if not success:
        raise EngineError(f"SGLang {what} failed: {message}")


def _completion(prompt: list[int], out: dict) -> Completion:
    """Turn one SGLang output dict into a :class:`Completion`."""
    meta = out["meta_info"]
    finish = meta.get("finish_reason") or {}
    reason = _FINISH_REASONS.get(finish.get("type"))
    if reason is None:
        raise EngineError(f"SGLang finished a request with {finish!r}; expected type 'stop' or 'length'")
    tokens = list(out["output_ids"])
    logprobs = tuple(float(lp) for lp, _, _ in meta["output_token_logprobs"])
    if len(logprobs) != len(tokens):
        raise EngineError(f"SGLang returned {len(logprobs)} logprobs for {len(tokens)} tokens")
    return Completion(
        prompt_ids=tuple(prompt),
        response_ids=tuple(tokens),
        logprobs=logprobs,
        finish_reason=reason,
        text=out["text"],
    )
