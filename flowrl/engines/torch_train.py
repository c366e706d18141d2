"""A :class:`~flowrl.engines.base.TrainEngine` over a transformers model on one device.

``role="actor"``: a causal LM; outputs per-token ``logprobs`` and ``entropy``.
``role="critic"``: the transformers base model plus ``Linear(hidden, 1)`` value head;
outputs per-token ``values``.

Exactness matters more than speed here: every per-token quantity is computed in
float32, and gradient accumulation over micro-batches equals one big batch because
the loss function normalises by whole-batch counts (see :data:`~flowrl.engines.base.LossFn`).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flowrl.algos.losses import combine_metrics
from flowrl.algos.schedules import lr_factor
from flowrl.catalog.precision import DEFAULT_PRECISION, PRECISIONS, keeps_masters
from flowrl.engines import batching
from flowrl.engines.base import Denominator, EngineConfigError, EngineError, LossFn, accelerator, load_tensors_file
from flowrl.engines.precision import MasterWeights
from flowrl.engines.route_replay import replayed_routes
from flowrl.engines.types import ROUTES, TokenBatch

STATE_FILE = "engine_state.pt"
"""File name, inside the directory given to ``save``/``load``, of the full engine state."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class OptimConfig:
    """AdamW and learning-rate schedule settings."""

    lr: float = 1e-5
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW moment decay rates."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up, from lr/warmup_steps to lr."""
    schedule: str = "constant"
    """Decay after the warm-up: a name of :data:`flowrl.algos.schedules.LR_SCHEDULES`."""
    total_steps: int = 0
    """Optimizer steps the schedule spans, warm-up included (the decay ends there)."""
    min_lr_ratio: float = 0.0
    """The decayed rate's floor, as a fraction of ``lr``."""

    def lr_factor(self, step: int) -> float:
        """The multiplier of ``lr`` at optimizer step ``step`` (0-based), the same in every train
        engine (:func:`flowrl.algos.schedules.lr_factor`)."""
        return lr_factor(step, schedule=self.schedule, warmup=max(int(self.warmup_steps), 0),
                         total=int(self.total_steps), min_ratio=float(self.min_lr_ratio))
    max_grad_norm: float | None = 1.0
    """Clip the global L2 grad norm to this; None disables clipping (the norm is still reported)."""


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-token log-probabilities aligned with ``input_ids``.

    ``logits``: [B, T, V] (already divided by the temperature); ``input_ids``,
    ``attention_mask``: [B, T]. Returns [B, T] float32 where entry ``t >= 1`` is
    ``log_softmax(logits[b, t-1])[input_ids[b, t]]``; position 0 and padding are 0.
    """
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return _shift_right(picked) * attention_mask.to(picked.dtype)


def token_entropy(logits: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of the distribution that predicts each token.

    ``logits``: [B, T, V]; returns [B, T] float32 aligned like :func:`token_logprobs`
    (entry ``t`` is the entropy of ``softmax(logits[b, t-1])``; 0 at position 0 and padding).
    """
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return _shift_right(ent) * attention_mask.to(ent.dtype)


def _shift_right(x: torch.Tensor) -> torch.Tensor:
    """[B, T-1] predictions for tokens 1..T-1 -> [B, T] with a 0 column at position 0."""
    return torch.cat([x.new_zeros(x.shape[0], 1), x], dim=1)


def trim_padding(batch: TokenBatch) -> TokenBatch:
    """Drop trailing columns that are padding in every row (right padding makes that exact).

    Per-token extras ([B, T]) are trimmed with the tokens; per-row extras ([B]) are kept.
    """
    width = int(batch.attention_mask.sum(dim=1).max().item()) if batch.size else 0
    width = max(width, 1)
    full = batch.input_ids.shape[1]
    if width == full:
        return batch
    cut = lambda t: t[:, :width] if t.dim() >= 2 and t.shape[1] == full else t  # noqa: E731
    return TokenBatch(
        input_ids=batch.input_ids[:, :width],
        attention_mask=batch.attention_mask[:, :width],
        response_mask=batch.response_mask[:, :width],
        extras={k: cut(v) for k, v in batch.extras.items()},
    )


class CriticModel(nn.Module):
    """A transformers base model with a scalar value head: hidden [B, T, H] -> values [B, T]."""

    def __init__(self, base: nn.Module, hidden_size: int, seed: int):
        super().__init__()
        self.model = base
        # Seed the head's init locally so constructing a critic does not move the global RNG.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.value_head = nn.Linear(hidden_size, 1)
        self.value_head.to(next(base.parameters()).dtype)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Returns [B, T] float32 values of the hidden state at each position (not yet shifted)."""
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()


class RewardModel(nn.Module):
    """A transformers sequence classifier with one label (a reward model's scalar head), scored at
    every position: hidden [B, T, H] -> scores [B, T], the score of the prefix ending at t. Its
    value at a row's last token is what ``AutoModelForSequenceClassification`` returns for the row."""

    def __init__(self, classifier: nn.Module):
        super().__init__()
        self.classifier = classifier

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.classifier.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                            position_ids=position_ids).last_hidden_state
        return self.classifier.score(hidden).squeeze(-1).float()


def _load_model(path: str, role: str, dtype: torch.dtype, attn: str | None, seed: int) -> nn.Module:
    """Build the actor (causal LM), critic (base model + head) or reward model (a one-label sequence
    classifier) from a transformers checkpoint dir."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn is not None:
        kwargs["attn_implementation"] = attn
    if role == "actor":
        return _without_dropout(AutoModelForCausalLM.from_pretrained(path, **kwargs))
    if role == "reward":
        # A checkpoint without a score head (a causal LM) gets one initialised from `seed`, not the global RNG.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return RewardModel(_without_dropout(AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=1, **kwargs)))
    base = _without_dropout(AutoModel.from_pretrained(path, **kwargs))
    return CriticModel(base, base.config.hidden_size, seed)


def _sliding_window(path: str) -> int | None:
    """The sliding attention window of the checkpoint at ``path`` (tokens), None when attention is global."""
    import json

    from flowrl.catalog.architectures import sliding_window

    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        return sliding_window(json.load(f))


def _without_dropout(model: nn.Module) -> nn.Module:
    """Turn dropout off, as RL trainers do (veRL, OpenRLHF, TRL's ``disable_dropout``; our Megatron
    engine builds with zero dropouts): the engine runs in train mode, and its log-probs must be the
    rollout engine's for the same weights. GPT-2 configs ship 0.1 dropouts: left on, train-mode
    log-probs of a tiny GPT-2 were 0.07 nats off vLLM's (Llama's default dropout is 0: 2e-5)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):  # Llama-family attention reads a float
            module.attention_dropout = 0.0
    return model


class TorchTrainEngine:
    """Train engine over a transformers model (single process, any torch device).

    Args:
        model_path: directory of a transformers checkpoint (``save_pretrained`` output).
        role: ``"actor"`` (causal LM, logprobs/entropy), ``"critic"`` (values) or ``"reward"``
            (a reward model: ``forward`` returns ``"scores"``, the score of each prefix).
        optim: AdamW / schedule / clipping settings.
        temperature: logits are divided by this before log_softmax, so logprobs match
            a rollout engine sampling at the same temperature.
        dtype: parameter dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``): the dtype the
            model computes in and :meth:`named_weights` yields; per-token outputs are always float32.
        precision: a 16-bit ``dtype``'s training (:mod:`flowrl.catalog.precision`): ``"mixed"``
            keeps fp32 master weights of the trainable parameters and fp32 AdamW moments
            (:class:`~flowrl.engines.precision.MasterWeights`), ``"pure"`` updates the 16-bit
            weights themselves. A float32 model trains in float32 either way.
        device: torch device string; None: :func:`~flowrl.engines.base.accelerator` (``cuda`` where
            this process sees a GPU, else ``cpu``).
        seed: seeds the critic head's initialisation.
        compute_entropy: whether ``train_step`` passes ``"entropy"`` to the loss (actor).
        attn_implementation: transformers attention backend; None keeps its default.
        lora: train LoRA adapters only (an actor): the plan's ``{"r", "alpha", "dropout", "targets"}``
            (:mod:`flowrl.engines.lora`). The base weights are frozen and out of the optimizer;
            :meth:`named_weights` yields the adapter tensors only.
    """

    def __init__(
        self,
        model_path: str,
        *,
        role: str = "actor",
        optim: OptimConfig = OptimConfig(),
        temperature: float = 1.0,
        dtype: str = "float32",
        device: str | None = None,
        seed: int = 0,
        compute_entropy: bool = True,
        attn_implementation: str | None = None,
        lora: dict | None = None,
        precision: str = DEFAULT_PRECISION,
    ):
        if role not in ("actor", "critic", "reward"):
            raise EngineConfigError(f"role={role!r} is not a train-engine role; use 'actor', 'critic' or 'reward'")
        if dtype not in _DTYPES:
            raise EngineConfigError(f"dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)}")
        if precision not in PRECISIONS:
            raise EngineConfigError(f"precision={precision!r} is not supported; use one of {sorted(PRECISIONS)}")
        if not temperature > 0:
            raise EngineConfigError(f"temperature={temperature!r} must be > 0 for training (logits / T)")
        if not os.path.isdir(model_path):
            raise EngineConfigError(f"model_path={model_path!r} is not a directory; pass a save_pretrained dir")
        self.role = role
        self.optim_config = optim
        self.temperature = float(temperature)
        self.device = torch.device(device or accelerator())
        self.compute_entropy = compute_entropy
        self.model = _load_model(model_path, role, _DTYPES[dtype], attn_implementation, seed).to(self.device)
        self._window = _sliding_window(model_path)  # a packed row's mask cannot apply it (_packed_outputs)
        self.lora = None
        if lora is not None:
            from flowrl.engines import lora as adapters

            if role != "actor":
                raise EngineConfigError(f"lora is for actors (a policy's adapters), not a {role}")
            self.lora = adapters.config_of(lora, model_path)
            self.model = adapters.wrap(self.model, self.lora, seed)
        _own_storage(self.model)
        self.model.train()
        # Mixed precision: AdamW updates fp32 masters of the 16-bit parameters (flowrl.engines.precision).
        self.masters = MasterWeights([p for p in self.model.parameters() if p.requires_grad],
                                     enabled=keeps_masters(dtype, precision))
        self.optimizer = torch.optim.AdamW(
            self.masters.params,
            lr=optim.lr,
            betas=optim.betas,
            eps=optim.eps,
            weight_decay=optim.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: optim.lr_factor(step))
        self.step = 0

    # ------------------------------------------------------------------ forward

    def _outputs(self, batch: TokenBatch, *, entropy: bool, pack: bool = False) -> dict[str, torch.Tensor]:
        """Per-token outputs of ``batch`` ([B, T] float32 each), with grad if grad mode is on; with
        ``pack`` the rows run as one packed row (:func:`_packed_outputs`), same outputs."""
        if pack:
            return self._packed_outputs(batch, entropy=entropy)
        ids = batch.input_ids.to(self.device)
        attn = batch.attention_mask.to(self.device)
        if self.role == "reward":  # [B, T]: the reward model's score of the prefix ending at t
            return {"scores": self.model(ids, attn) * attn.float()}
        if self.role == "critic":
            raw = self.model(ids, attn)  # [B, T]: value of the prefix ending at t
            # values[t] must estimate the state *before* token t, i.e. the hidden state at t-1.
            return {"values": _shift_right(raw[:, :-1]) * attn.float()}
        routes = batch.extras.get(ROUTES)
        if routes is None:
            logits = self.model(input_ids=ids, attention_mask=attn).logits.float() / self.temperature
            out = {}
        else:  # routing replay: the rollout engine's experts (flowrl.engines.route_replay)
            differ = torch.zeros(ids.shape, dtype=torch.float32, device=self.device)
            with replayed_routes(self.model, routes.to(self.device), differ):
                logits = self.model(input_ids=ids, attention_mask=attn).logits.float() / self.temperature
            out = {"routes_differ": differ * attn.float()}
        out["logprobs"] = token_logprobs(logits, ids, attn)
        if entropy:
            out["entropy"] = token_entropy(logits, attn)
        return out

    def _packed_outputs(self, batch: TokenBatch, *, entropy: bool) -> dict[str, torch.Tensor]:
        """:meth:`_outputs` of ``batch``'s B rows run as one packed row of L tokens
        (:func:`flowrl.engines.batching.pack`: attention within each sequence, positions restarting),
        scattered back to [B, T]. Predictions never cross a sequence start (``position_ids == 0``)."""
        if ROUTES in batch.extras:
            raise EngineConfigError("pack=True with routing replay: the replayed routes are per padded row; "
                                    "use routing = \"native\" or pack = false")
        window = self._window
        if window is not None and int(batch.attention_mask.sum(dim=1).max()) > window:
            raise EngineConfigError(f"pack=True on a model with a {window}-token sliding window and a longer "
                                    "sequence: the packed row's mask does not apply the window; use pack = false")
        dtype = next(self.model.parameters()).dtype
        p = batching.pack(batch, dtype=dtype if dtype.is_floating_point else torch.float32)
        ids, pos, mask = p.input_ids.to(self.device), p.position_ids.to(self.device), p.attention_mask.to(self.device)
        inside = (pos != 0).long()  # [1, L]: 0 at each sequence's first token (nothing predicts it)
        width = batch.input_ids.shape[1]
        if self.role == "reward":
            return {"scores": batching.unpack(self.model(ids, mask, pos), p.lengths, width)}
        if self.role == "critic":
            raw = self.model(ids, mask, pos)  # [1, L]
            return {"values": batching.unpack(_shift_right(raw[:, :-1]) * inside.float(), p.lengths, width)}
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float() / self.temperature
        out = {"logprobs": batching.unpack(token_logprobs(logits, ids, inside), p.lengths, width)}
        if entropy:
            out["entropy"] = batching.unpack(token_entropy(logits, inside), p.lengths, width)
        return out

    def _micro_batches(self, batch: TokenBatch, rows: int, tokens: int,
                       pack: bool) -> list[tuple[torch.Tensor, TokenBatch]]:
        """``(row indices, trimmed micro-batch)`` pairs covering ``batch`` (:func:`batching.plan_ranks`, one rank)."""
        if tokens < 0:
            raise EngineConfigError(f"micro_batch_tokens={tokens} must be >= 0 (0: micro-batches by rows)")
        plan = batching.plan_ranks(batching.lengths_of(batch), 1, max_rows=rows, max_tokens=tokens, padded=not pack)[0]
        return [(idx, trim_padding(batch.select(idx))) for idx in (torch.tensor(m, dtype=torch.long) for m in plan)]

    def forward(
        self,
        batch: TokenBatch,
        *,
        entropy: bool = False,
        values: bool = False,
        micro_batch_size: int | None = None,
        micro_batch_tokens: int = 0,
        pack: bool = False,
        adapters: bool = True,
    ) -> dict[str, torch.Tensor]:
        """Per-token outputs without grad, each [B, T] float32 on CPU.

        Actor: ``"logprobs"`` (log_softmax(logits / temperature) of each token) and,
        with ``entropy=True``, ``"entropy"`` (nats). A batch carrying ``extras["routed_experts"]``
        (a mixture of experts' routes from the rollout engine, [B, T, layers, top_k]) is forwarded
        with those experts instead of the router's top-k (:mod:`flowrl.engines.route_replay`), and
        ``"routes_differ"`` counts, per token, the layers where they differ from the router's own.
        Critic: ``"values"``, where
        ``values[b, t]`` is the value of the state ``input_ids[b, :t]``. Position 0
        and padding are 0. ``micro_batch_size`` bounds the rows run at once; ``micro_batch_tokens``
        (> 0) the real tokens instead; ``pack`` runs each micro-batch as one packed row.
        ``adapters=False`` (a LoRA engine): the base model's outputs, the adapters disabled
        (:meth:`base_weights`): a frozen reference made from this policy, computed without a copy.
        """
        self._check_request(entropy=entropy, values=values)
        size = micro_batch_size or max(batch.size, 1)
        width = batch.input_ids.shape[1]
        out: dict[str, torch.Tensor] = {}
        if self.lora is not None and self.lora.dropout:
            self.model.eval()  # a log-prob pass runs without the adapters' dropout (the update's forward has it)
        with torch.no_grad(), self.base_weights(not adapters):
            for rows, micro in self._micro_batches(batch, size, micro_batch_tokens, pack):
                for key, value in self._outputs(micro, entropy=entropy, pack=pack).items():
                    full = out.setdefault(key, torch.zeros(batch.size, width, dtype=torch.float32))
                    full[rows, : value.shape[1]] = value.detach().float().cpu()
        self.model.train()
        return out

    def base_weights(self, off: bool = True):
        """A context in which the model computes as its base, the LoRA adapters disabled
        (:func:`flowrl.engines.lora.adapters_disabled`); ``off=False``: as it is. An engine without
        adapters has no base to fall back to: :class:`EngineConfigError`."""
        if not off:
            return contextlib.nullcontext()
        if self.lora is None:
            raise EngineConfigError("adapters=False asked of an engine that trains no LoRA adapters: its weights "
                                    "are the model's; a frozen reference of a full-weight policy has an engine "
                                    "of its own")
        from flowrl.engines.lora import adapters_disabled

        return adapters_disabled(self.model)

    def _check_request(self, *, entropy: bool, values: bool) -> None:
        if values and self.role != "critic":
            raise EngineConfigError("values=True asked of an actor engine; build a TorchTrainEngine(role='critic')")
        if entropy and self.role != "actor":
            raise EngineConfigError("entropy=True asked of a critic engine; entropy comes from an actor")

    # --------------------------------------------------------------- training

    def train_step(
        self,
        batch: TokenBatch,
        loss_fn: LossFn,
        *,
        micro_batch_size: int,
        denominator: Denominator | None = None,
        micro_batch_tokens: int = 0,
        pack: bool = False,
    ) -> dict[str, float]:
        """One AdamW step over ``batch`` with gradient accumulation over micro-batches.

        Micro-batches hold ``micro_batch_size`` rows, or with ``micro_batch_tokens > 0`` at most that
        many real tokens (a longer row alone); ``pack`` runs each as one packed row
        (:mod:`flowrl.engines.batching`). The denominator is the whole batch's either way, so the
        gradient is the padded path's up to float rounding. ``pad_fraction`` reports the share of
        padding in the token slots the model ran.

        ``loss_fn(outputs, micro, denominator)`` gets [b, t] outputs with grad and the
        whole-batch ``denominator`` (``{"tokens": response tokens, "sequences": B}``;
        a data-parallel caller passes the global one). Returns ``loss`` (sum of micro
        losses), ``grad_norm`` (L2, before clipping), ``lr`` (used by this step),
        ``step`` (steps taken so far), ``skipped`` (1.0 if a non-finite loss or grad norm
        skipped the update) and the loss function's metrics combined over micro-batches
        (:func:`~flowrl.algos.losses.combine_metrics`: summed, ``*_max``/``*_min`` by max/min).
        """
        if micro_batch_size < 1:
            raise EngineConfigError(f"micro_batch_size={micro_batch_size} must be >= 1")
        if batch.size == 0:
            raise EngineConfigError("train_step got an empty batch (0 rows)")
        denominator = denominator or {
            "tokens": int(batch.response_mask.sum().item()),
            "sequences": batch.size,
        }
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        self.masters.zero_grad()
        totals: dict[str, float] = {"loss": 0.0}
        micros = self._micro_batches(batch, micro_batch_size, micro_batch_tokens, pack)
        for _, micro in micros:
            outputs = self._outputs(micro, entropy=self.role == "actor" and self.compute_entropy, pack=pack)
            # the loss mixes the outputs (on the engine's device) with the batch's masks and extras
            loss, metrics = _split_loss(loss_fn(outputs, micro.to(self.device), denominator))
            loss.backward()
            totals["loss"] += float(loss.detach())
            combine_metrics(totals, metrics)
        pad = batching.pad_fraction(batch, [rows.tolist() for rows, _ in micros], pack)
        return {**totals, "pad_fraction": pad, **self._apply_gradients(totals["loss"])}

    def _apply_gradients(self, loss: float = 0.0) -> dict[str, float]:
        """Clip, step optimizer and schedule; skip the update if the loss or the grad norm is not finite.
        Under mixed precision the gradients move to the fp32 masters first, and the 16-bit weights
        are cast from the updated masters after the step."""
        self.masters.grads_to_masters()
        params = [p for p in self.masters.params if p.requires_grad]
        max_norm = self.optim_config.max_grad_norm
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else math.inf))
        lr = float(self.scheduler.get_last_lr()[0])
        skipped = not (math.isfinite(norm) and math.isfinite(loss))
        if skipped:
            # A NaN/inf gradient would poison AdamW's moments for good; drop it instead (an inf loss
            # whose gradient happens to be finite is no sounder a direction).
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.masters.masters_to_model()
        self.scheduler.step()
        self.step += 1
        return {"grad_norm": norm, "lr": lr, "step": float(self.step), "skipped": float(skipped)}

    # ------------------------------------------------------------ weights & io

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` in transformers checkpoint naming (``model.layers.0...``, ``lm_head.weight``).

        Tensors are detached views of the live parameters (no copy): consume them before
        the next ``train_step``. A critic yields its base model under ``model.`` plus
        ``value_head.weight`` / ``value_head.bias``.

        transformers 5 holds some families' weights fused in memory (a mixture of experts' experts
        as one ``mlp.experts.gate_up_proj`` [experts, 2 * width, hidden]); they are split back into
        the checkpoint's tensors (``mlp.experts.{e}.gate_proj.weight``...: copies), the names
        every rollout engine loads (SGLang ignores the fused ones without an error), by undoing
        the conversions ``from_pretrained`` applied. Dense families' state dicts are their
        checkpoints' already (no conversion applied).

        With LoRA: the adapter tensors only, under PEFT's names
        (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``); the base weights never
        change, and the rollout engine has them.
        """
        if self.lora is not None:
            from flowrl.engines.lora import adapter_tensors

            yield from adapter_tensors(self.model)
            return
        state = self.model.state_dict()
        if getattr(self.model, "_weight_conversions", None):  # what from_pretrained converted (actor only)
            from transformers.core_model_loading import revert_weight_conversion

            state = revert_weight_conversion(self.model, state)
        for name, tensor in state.items():
            yield name, tensor.detach()

    def adopt_weights(self, home: Callable[[Iterable[tuple[str, torch.Tensor]]], dict[str, torch.Tensor]]) -> int:
        """Move the parameters and buffers into the tensors ``home`` makes for :meth:`named_weights`
        (name -> a tensor of the same shape, dtype and device, the value copied in): each lives
        there from now on (``param.data``; the optimizer keeps its references). A weight sync
        lays these out as its messages, so it sends them without copying
        (:meth:`flowrl.runtime.sync.BroadcastSync.home`). Returns how many moved.

        Nothing moves (``home`` is not called) for LoRA (the adapters are separate tensors) or a
        model whose checkpoint names differ from its parameters' (converted weights); a tensor
        that does not match is left where it is."""
        if self.lora is not None or getattr(self.model, "_weight_conversions", None):
            return 0
        homes = home(self.named_weights())
        moved = 0
        with torch.no_grad():
            for name, tensor in [*self.model.named_parameters(), *self.model.named_buffers()]:
                place = homes.get(name)
                if place is None or (place.shape, place.dtype, place.device) != (tensor.shape, tensor.dtype,
                                                                                 tensor.device):
                    continue
                if place.data_ptr() != tensor.data_ptr():
                    place.copy_(tensor)
                    tensor.data = place
                moved += 1
        return moved

    def save(self, path: str) -> None:
        """Write ``path/engine_state.pt``: model, fp32 master weights (mixed precision), optimizer,
        scheduler, step and torch RNG states."""
        os.makedirs(path, exist_ok=True)
        state = {
            "role": self.role,
            "step": self.step,
            "model": self.model.state_dict(),
            "masters": self.masters.state(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }
        torch.save(state, os.path.join(path, STATE_FILE))

    def load(self, path: str) -> None:
        """Restore the state :meth:`save` wrote in ``path``; the next step then matches bit for bit."""
        file = os.path.join(path, STATE_FILE)
        if not os.path.isfile(file):
            raise EngineError(f"no train-engine checkpoint at {file!r}; pass a directory written by save()")
        state = load_tensors_file(file, map_location=self.device)
        if state["role"] != self.role:
            raise EngineConfigError(
                f"checkpoint {path!r} holds a {state['role']} engine, this engine is a {self.role}; "
                f"build TorchTrainEngine(role={state['role']!r}) to load it"
            )
        self.model.load_state_dict(state["model"])
        if state.get("masters"):
            self.masters.load_state(state["masters"])
        else:  # saved in float32 or pure: the masters start from the weights
            self.masters.from_model()
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        torch.set_rng_state(state["rng_cpu"].cpu())
        if state["rng_cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in state["rng_cuda"]])

    # ------------------------------------------------------- memory phases

    def offload(self) -> int:
        """Parameters, gradients and optimizer states to host memory (a colocated rollout engine
        generates meanwhile); returns the bytes moved. Call :meth:`reload` before the next call."""
        from flowrl.engines.offload import HostStash, module_tensors, optimizer_tensors

        self._stash = getattr(self, "_stash", None) or HostStash()
        return self._stash.offload([*module_tensors(self.model), *optimizer_tensors(self.optimizer)])

    def reload(self) -> int:
        """Bring back what :meth:`offload` moved, in place (bit-identical); returns the bytes moved."""
        stash = getattr(self, "_stash", None)
        return stash.reload() if stash is not None else 0

    def state_checksums(self) -> dict[str, int]:
        """CRC-32 of every parameter, gradient and optimizer-state tensor (``offload`` round trips keep them)."""
        from flowrl.engines.offload import state_checksums

        return state_checksums(self.model, self.optimizer)

    def save_pretrained(self, path: str) -> None:
        """Write the actor as a transformers checkpoint dir (a rollout engine can start from it)."""
        if self.role != "actor":
            raise EngineConfigError("save_pretrained exports actors only; a critic has no LM head to serve")
        if self.lora is not None:  # servable without PEFT: a copy of the base with the adapters merged in
            import copy

            copy.deepcopy(self.model).merge_and_unload(safe_merge=True).save_pretrained(path)
            return
        self.model.save_pretrained(path)


def _own_storage(model: nn.Module) -> None:
    """Give parameters still backed by the checkpoint file (safetensors maps them on CPU) memory of
    their own: it can then be offloaded and restored in place (:meth:`TorchTrainEngine.offload`)."""
    with torch.no_grad():
        for p in model.parameters():
            if not p.untyped_storage().resizable():
                p.data = p.data.clone()


def _split_loss(result: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """Accept ``loss`` or ``(loss, metrics)``; check the loss is a 0-d tensor that has grad."""
    loss, metrics = result if isinstance(result, tuple) else (result, {})
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise EngineConfigError(f"loss_fn returned {shape}; it must return a scalar tensor (0-d), e.g. .sum()/denom")
    if not loss.requires_grad:
        raise EngineConfigError("loss_fn returned a tensor without grad; build it from the outputs it was given")
    return loss, metrics
