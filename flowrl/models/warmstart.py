"""Supervised warm start of a tiny model on a task's train split, cached on disk.

GRPO from random weights does not learn arithmetic (the model collapses to the best
constant answer; see ENVIRONMENT.md), so RL runs start from a model that a short
supervised phase has taken partway: it emits well-formed answers and gets some right.

The result is cached in ``<cache_dir>/<key>/`` where ``key`` hashes (task, task spec,
model config, SFT config, seed): a second call with the same arguments returns at once.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from flowrl.models.tiny import build_tiny_model, load_tokenizer
from flowrl.warmcache import (  # noqa: F401  (re-exported: the warm start's public names)
    CACHE_VERSION,
    SFTConfig,
    TinyModelConfig,
    WarmStartError,
    WarmStartResult,
    cache_key,
    cached,
    default_cache_dir,
    read_entry,
    task_model_config,
    task_sft,
)
from flowrl.tasks import get_task



def encode_sft_batch(
    tokenizer: PreTrainedTokenizerBase, rows: list[dict[str, str]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, attention_mask, labels)``, each ``[B, T]`` int64.

    A row is ``<bos> prompt answer <eos>``; ``labels`` holds the token ids on the answer
    and EOS positions and -100 (ignored by the loss) on the prompt and the padding. A row
    with ``turns`` (see ``Task.sft_turns``) is a whole episode as the runtime lays it out:
    ``<bos> prompt turn0 <eos> obs1 turn2 <eos> ...``, labels on the model's turns and their
    EOS only (observations are the environment's tokens, as in RL's response mask).
    """
    prompts = tokenizer([r["prompt"] for r in rows]).input_ids
    eos = tokenizer.eos_token_id
    rests: list[tuple[list[int], list[int]]] = []  # per row: (tokens after the prompt, their labels)
    for r in rows:
        tokens: list[int] = []
        labels: list[int] = []
        for k, text in enumerate(r.get("turns") or [r["answer"]]):
            part = tokenizer(text, add_special_tokens=False).input_ids
            if k % 2 == 0:  # a model turn, ended by EOS
                tokens += part + [eos]
                labels += part + [eos]
            else:  # an observation
                tokens += part
                labels += [-100] * len(part)
        rests.append((tokens, labels))
    width = max(len(p) + len(t) for p, (t, _) in zip(prompts, rests))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (p, (t, lab)) in enumerate(zip(prompts, rests)):
        n = len(p) + len(t)
        ids[i, :n] = torch.tensor(p + t)
        attn[i, :n] = 1
        labels[i, len(p) : n] = torch.tensor(lab)
    return ids, attn, labels


SFT_THREADS = 1
"""Torch threads of the warm start. Float sums split over threads round differently, so
pinning the count makes the warm start the same on every machine whatever its core count
(given the same CPU instruction set). The arith tasks' ~0.2M-parameter model gains nothing from
more; the longtail task's 11.8M-parameter one would (its warm start took 1,675 s on 2 cores, most of
it 3-5 s SFT steps of 16 rows padded to their longest solution, a fifth to a half of the tokens real),
at the price of a model that depends on the thread count."""


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads, then restore the caller's count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def sft_train(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, str]],
    cfg: SFTConfig,
    *,
    seed: int = 0,
) -> list[float]:
    """Train ``model`` in place with cross-entropy on the answers; bit-reproducible.

    Data order comes from ``random.Random(seed)``, torch's generator is seeded with ``seed``
    (restored afterwards) and the thread count is pinned to ``SFT_THREADS``: the same
    model, rows, config and seed give the same weights bit for bit. With a
    ``cfg.stop_at_accuracy``, the first ``cfg.check_rows`` rows are the validation rows of the
    check and are not trained on (``split_check_rows``). Returns the loss of every step taken
    (nats/token); its length is the number of steps, fewer than ``cfg.steps`` when
    ``cfg.stop_at_accuracy`` was reached.
    """
    train, check = split_check_rows(rows, cfg)
    if cfg.batch_size > len(train):
        raise WarmStartError(f"SFT batch_size={cfg.batch_size} exceeds the {len(train)} training rows; lower it")
    with torch.random.fork_rng(devices=[]), torch_threads(SFT_THREADS):  # leave the caller's RNG and threads alone
        torch.manual_seed(seed)
        return _sft_loop(model, tokenizer, train, check, cfg, random.Random(seed))


def split_check_rows(rows: list[dict[str, str]], cfg: SFTConfig) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """``(rows trained on, validation rows of the stop check)``: the first ``cfg.check_rows``
    rows are kept out of training when ``cfg.stop_at_accuracy`` is set; else all rows train."""
    if cfg.stop_at_accuracy is None:
        return rows, []
    if cfg.check_rows < 1 or cfg.check_rows >= len(rows):
        raise WarmStartError(
            f"SFT check_rows={cfg.check_rows} must be at least 1 and leave rows to train on ({len(rows)} rows); "
            "lower it, or set stop_at_accuracy=None"
        )
    return rows[cfg.check_rows :], rows[: cfg.check_rows]


def _sft_loop(model, tokenizer, rows, check_rows, cfg: SFTConfig, rng: random.Random) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas)
    check = _encode_chunks(tokenizer, check_rows) if check_rows else []  # once: tokenizing costs a third of a check
    model.train()
    losses = []
    for step in range(1, cfg.steps + 1):
        ids, attn, labels = encode_sft_batch(tokenizer, rng.sample(rows, cfg.batch_size))
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if cfg.stop_at_accuracy is not None and step % cfg.check_every == 0:
            if _accuracy(model, check) >= cfg.stop_at_accuracy:
                break
    model.eval()
    return losses


def teacher_forced_accuracy(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, rows: list[dict[str, str]], *, batch_size: int = 512
) -> float:
    """Greedy exact-match accuracy in [0, 1], computed in one forward pass per batch.

    Greedy decoding yields ``answer <eos>`` exactly when, fed the right prefix, the model's
    argmax at every answer and EOS position is the right token; so the fraction of rows
    whose argmax matches all their labels (``encode_sft_batch``) is the greedy accuracy
    of ``evaluate_accuracy`` at the cost of one forward pass instead of one per generated
    token. (They differ only where greedy text holds a special token that decoding drops,
    or where ``answer <eos>`` is longer than ``evaluate_accuracy``'s ``max_new_tokens``.)
    """
    if not rows:
        raise WarmStartError("teacher_forced_accuracy: no rows to score")
    return _accuracy(model, _encode_chunks(tokenizer, rows, batch_size))


_Chunk = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _encode_chunks(tokenizer: PreTrainedTokenizerBase, rows: list[dict[str, str]], batch_size: int = 512) -> list[_Chunk]:
    """``encode_sft_batch`` of each ``batch_size`` rows."""
    return [encode_sft_batch(tokenizer, rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]


@torch.no_grad()
def _accuracy(model: PreTrainedModel, chunks: list[_Chunk]) -> float:
    """The fraction of encoded rows whose argmax matches every label (see ``teacher_forced_accuracy``)."""
    was_training = model.training
    model.eval()
    right = rows = 0
    for ids, attn, labels in chunks:
        pred = model(input_ids=ids, attention_mask=attn).logits[:, :-1].argmax(-1)  # [B, T-1]: next token
        target = labels[:, 1:]  # [B, T-1]: -100 off the answer
        right += int(((pred == target) | (target == -100)).all(dim=1).sum())
        rows += len(ids)
    model.train(was_training)
    return right / rows


@torch.no_grad()
def greedy_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    max_new_tokens: int = 8,
    batch_size: int = 512,
) -> list[str]:
    """Greedy completion text of each prompt (special tokens removed), in order."""
    was_training = model.training
    model.eval()
    tokenizer.padding_side = "left"  # generation appends on the right
    out: list[str] = []
    for start in range(0, len(prompts), batch_size):
        enc = tokenizer(prompts[start : start + batch_size], return_tensors="pt", padding=True)
        gen = model.generate(
            **enc, max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        )
        out += tokenizer.batch_decode(gen[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
    model.train(was_training)
    return out


def evaluate_accuracy(
    model: str | Path | PreTrainedModel,
    rows: list[dict[str, str]],
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_new_tokens: int = 8,
    batch_size: int = 512,
    final: Callable[[str], str | None] | None = None,
) -> float:
    """Greedy accuracy in [0, 1]: the fraction of rows whose stripped completion equals ``answer``.

    ``model`` is a checkpoint directory or an in-memory model (then pass ``tokenizer``). ``final``
    reads the answer out of a completion first (``Task.final``; None: the whole completion).
    """
    if isinstance(model, (str, Path)):
        tokenizer = tokenizer or load_tokenizer(model)
        model = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    if tokenizer is None:
        raise WarmStartError("evaluate_accuracy: pass tokenizer= when model is an in-memory model")
    if not rows:
        raise WarmStartError("evaluate_accuracy: no rows to evaluate")
    texts = greedy_completions(
        model, tokenizer, [r["prompt"] for r in rows], max_new_tokens=max_new_tokens, batch_size=batch_size
    )
    given = [final(t) if final is not None else t for t in texts]
    return sum(g is not None and g.strip() == r["answer"].strip() for g, r in zip(given, rows)) / len(rows)


def warm_start(
    task: str = "arith",
    *,
    model_cfg: TinyModelConfig | None = None,
    sft: SFTConfig | None = None,
    seed: int = 0,
    cache_dir: str | Path | None = None,
) -> WarmStartResult:
    """Build the tiny model for ``task``, fine-tune it on the task's train split, cache it.

    The model is initialised from ``seed`` and trained with ``sft`` (data order seeded by
    ``seed`` too; bit-reproducible, see ``sft_train``); the greedy accuracy on the check rows
    and on the held-out split are stored in ``warmstart.json`` next to the weights. ``sft``
    None: the task's own settings (``Task.sft``) over ``SFTConfig``'s defaults. A task with
    ``sft_turns`` trains on those turns (``encode_sft_batch``); its held-out accuracy is then
    that of a single greedy turn (a tool call counts as wrong), its answer read by ``Task.final``.
    ``model_cfg`` None: the task's shape (``task_model_config``).
    """
    spec = get_task(task)
    sft = sft if sft is not None else task_sft(task)
    model_cfg = model_cfg if model_cfg is not None else task_model_config(task)
    found, root, key, inputs = cached(task, model_cfg, sft, seed, cache_dir)
    if found is not None:
        return found
    final = root / f"{task}-{key}"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WarmStartError(f"cannot create warm-start cache {root}: {e}; set FLOWRL_CACHE to a writable dir") from e
    # Build in a private temp dir and rename: a crash or a concurrent caller never
    # sees a half-written checkpoint.
    tmp = Path(tempfile.mkdtemp(prefix=f".{task}-{key}-", dir=root))
    try:
        build_tiny_model(tmp, chars=spec.chars, seed=seed, **asdict(model_cfg))
        tokenizer = load_tokenizer(tmp)
        model = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32)
        train = spec.rows("train")
        if spec.sft_turns is not None:
            train = [{"prompt": r["prompt"], "turns": spec.sft_turns(r)} for r in train]
        losses = sft_train(model, tokenizer, train, sft, seed=seed)
        with torch_threads(SFT_THREADS):  # the reported numbers, like the weights, do not depend on the machine
            check = teacher_forced_accuracy(model, tokenizer, train[: sft.check_rows])  # validation rows when stopping
            acc = evaluate_accuracy(model, spec.rows("test"), tokenizer=tokenizer, max_new_tokens=spec.max_new_tokens,
                                    final=spec.final)
        model.save_pretrained(tmp)
        info = {**inputs, "steps_taken": len(losses), "final_loss": losses[-1] if losses else None,
                "check_accuracy": check, "test_accuracy": acc}
        (tmp / "warmstart.json").write_text(json.dumps(info, indent=1, sort_keys=True))
        try:
            tmp.rename(final)
        except OSError:  # another process finished first: keep its copy
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return WarmStartResult(final, False, read_entry(final / "warmstart.json"))
