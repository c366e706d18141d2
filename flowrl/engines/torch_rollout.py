"""A :class:`~flowrl.engines.base.RolloutEngine` over transformers ``generate`` (no vLLM needed).

Slower than vLLM but dependency-free and exact: it samples with the same rules
(temperature, then top-k, then top-p) and reports the log-probability of each
sampled token under that processed distribution, like vLLM's
``logprobs_mode="processed_logprobs"``. Stop strings are applied after sampling
(the response is cut at the first token whose text completes a stop string).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from flowrl.data.chat import stop_ids
from flowrl.engines.base import (
    EngineConfigError,
    accelerator,
    check_lengths,
    check_prompts,
    check_sampling_spec,
)
from flowrl.engines.types import Completion, SamplingSpec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchRolloutEngine:
    """Rollout engine on one torch device.

    Args:
        model_path: transformers checkpoint dir; its tokenizer (if saved there) decodes
            text and matches stop strings.
        dtype: parameter dtype name; logprobs are computed in float32 either way.
        device: torch device string; None: :func:`~flowrl.engines.base.accelerator` (``cuda`` where
            this process sees a GPU, else ``cpu``).
        seed: seeds calls whose ``SamplingSpec.seed`` is None, so a run is reproducible.
        max_batch_rows: most sequences (prompts x n) generated at once.
        max_model_len: longest prompt + completion in tokens; None: the checkpoint's positions only.
        attn_implementation: transformers attention backend; None keeps its default.
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        device: str | None = None,
        seed: int = 0,
        max_batch_rows: int = 256,
        max_model_len: int | None = None,
        attn_implementation: str | None = None,
    ):
        from transformers import AutoModelForCausalLM, GenerationConfig

        if dtype not in _DTYPES:
            raise EngineConfigError(f"dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)}")
        if not os.path.isdir(model_path):
            raise EngineConfigError(f"model_path={model_path!r} is not a directory; pass a save_pretrained dir")
        kwargs = {"dtype": _DTYPES[dtype]}
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        self.device = torch.device(device or accelerator())
        self.model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs).to(self.device).eval()
        self._slices: dict | None = None
        """Checkpoint names of fused weights (:func:`_checkpoint_slices`), found on the first update naming one."""
        self.tokenizer = _load_tokenizer(model_path)
        self.eos_ids = set(stop_ids(self.tokenizer, self.model.generation_config))
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad_id = pad if pad is not None else min(self.eos_ids, default=0)
        # A checkpoint's generation_config.json may carry sampling defaults (top_k=50,
        # repetition penalties...). Only SamplingSpec may shape the distribution.
        self.model.generation_config = GenerationConfig(
            eos_token_id=sorted(self.eos_ids) or None, pad_token_id=self.pad_id
        )
        self.vocab_size = int(self.model.config.get_text_config().vocab_size)
        self.max_batch_rows = max_batch_rows
        self.max_model_len = max_model_len
        self._seeds = torch.Generator().manual_seed(seed)

    def generate(self, prompts: list[list[int]], spec: SamplingSpec) -> list[list[Completion]]:
        """``spec.n`` completions per prompt, grouped per prompt in prompt order.

        Each completion's ``logprobs[k]`` is ``log_softmax(processed_logits)[token_k]``
        where processed means divided by ``T`` then top-k / top-p filtered (greedy: raw).
        """
        check_sampling_spec(spec)
        check_prompts(prompts, self.vocab_size)
        if self.max_model_len is not None:
            check_lengths(prompts, spec.max_tokens, self.max_model_len)
        if spec.stop and self.tokenizer is None:
            raise EngineConfigError("stop strings need a tokenizer; save one into the model dir")
        seed = spec.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seeds))
        rows = [p for p in prompts for _ in range(spec.n)]
        completions: list[Completion] = []
        with torch.random.fork_rng(devices=self._rng_devices()):
            torch.manual_seed(seed)
            for start in range(0, len(rows), self.max_batch_rows):
                completions += self._generate_rows(rows[start : start + self.max_batch_rows], spec)
        return [completions[i * spec.n : (i + 1) * spec.n] for i in range(len(prompts))]

    def _rng_devices(self) -> list:
        return [self.device] if self.device.type == "cuda" else []

    @torch.no_grad()
    def _generate_rows(self, rows: list[list[int]], spec: SamplingSpec) -> list[Completion]:
        """Sample one completion per row (rows left-padded together, as decoder-only generate needs)."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            attn[i, width - len(r) :] = 1
        greedy = spec.temperature == 0.0
        sampling = {} if greedy else {
            "temperature": spec.temperature,
            "top_k": spec.top_k if spec.top_k > 0 else 0,  # 0 disables transformers' top-k
            "top_p": spec.top_p,
        }
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=attn.to(self.device),
            do_sample=not greedy,
            max_new_tokens=spec.max_tokens,
            output_scores=True,
            return_dict_in_generate=True,
            **sampling,
        )
        tokens = out.sequences[:, width:].cpu()  # [R, S]
        scores = torch.stack(out.scores, dim=1).float().cpu()  # [R, S, V], processed logits
        logps = torch.log_softmax(scores, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return [
            self._completion(rows[i], tokens[i].tolist(), logps[i].tolist(), spec)
            for i in range(len(rows))
        ]

    def _completion(self, prompt: list[int], tokens: list[int], logps: list[float], spec: SamplingSpec) -> Completion:
        """Cut a generated row at its first EOS (kept) or stop-string completion (kept as tokens)."""
        length, reason, text = len(tokens), "length", None
        for k, tok in enumerate(tokens):
            if tok in self.eos_ids:
                length, reason = k + 1, "stop"
                break
            if spec.stop:
                text_k = self._decode(tokens[: k + 1])
                hit = _first_stop(text_k, spec.stop)
                if hit is not None:
                    length, reason, text = k + 1, "stop", text_k[:hit]
                    break
        if text is None:
            text = self._decode(tokens[:length])
        return Completion(
            prompt_ids=tuple(prompt),
            response_ids=tuple(tokens[:length]),
            logprobs=tuple(logps[:length]),
            finish_reason=reason,
            text=text,
        )

    def _decode(self, tokens: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(hf_name, tensor)`` pairs into the model's parameters in place.

        Names are transformers state-dict keys or, for weights transformers 5 fuses in memory (a
        mixture of experts' ``mlp.experts.gate_up_proj``), the checkpoint's own
        (``mlp.experts.3.up_proj.weight``), each copied into its rows of the fused parameter
        (:func:`_checkpoint_slices`); an unknown name or a shape mismatch raises
        :class:`EngineConfigError` before later tensors are copied.
        """
        state = self.model.state_dict()  # detached views sharing the parameters' storage
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in state:
                    if self._slices is None:
                        self._slices = _checkpoint_slices(self.model)
                    if name not in self._slices:
                        raise EngineConfigError(
                            f"update_weights got unknown weight {name!r}; expected transformers names like "
                            f"{next(iter(state))!r}"
                        )
                    key, index = self._slices[name]
                    _check_shape(name, tensor, index.shape)
                    state[key].view(-1)[index.view(-1)] = tensor.reshape(-1).to(state[key])
                    continue
                _check_shape(name, tensor, state[name].shape)
                state[name].copy_(tensor)

    def shutdown(self) -> None:
        """Drop the model so its memory can be freed."""
        self.model = None


def _check_shape(name: str, tensor: torch.Tensor, shape) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise EngineConfigError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                                f"the model has {tuple(shape)}")


def _checkpoint_slices(model) -> dict[str, tuple[str, torch.Tensor]]:
    """Checkpoint name -> (the state-dict key holding it, the flat indices of its elements there), for
    the weights ``from_pretrained`` fused (its ``_weight_conversions``; {} when it fused none).

    Found by undoing the conversions on each fused parameter's element indices: the reverse
    conversion (chunks, splits) moves indices exactly as it moves weights.
    """
    if not getattr(model, "_weight_conversions", None):
        return {}
    from transformers.core_model_loading import revert_weight_conversion

    out = {}
    for key, tensor in model.state_dict().items():
        index = torch.arange(tensor.numel()).view(tensor.shape)
        for name, part in revert_weight_conversion(model, {key: index}).items():
            if name != key:
                out[name] = (key, part)
    return out


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Index in ``text`` of the earliest occurrence of any stop string, or None."""
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None


def _load_tokenizer(model_path: str):
    """The checkpoint's tokenizer, or None if the dir has none (then text is empty)."""
    from transformers import AutoTokenizer

    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any(os.path.exists(os.path.join(model_path, f)) for f in files):
        return None
    return AutoTokenizer.from_pretrained(model_path)
