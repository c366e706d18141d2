"""Tiny reward models: a task's tiny model fit to preference pairs, cached on disk.

What a flow's ``tiny_rm(task = "arith")`` resolves to, as RLHF pipelines build theirs: sample a
policy's completions of the train prompts, and fit a scalar head (and the model under it) to
prefer the right answer over wrong ones by the Bradley-Terry loss
``-log sigmoid(r(chosen) - r(rejected))``.

* **The policy it judges**: the task's warm-started tiny model (what ``tiny(task = ...)`` of the
  same seed starts RL from) samples ``samples`` completions of every train prompt at
  ``temperature``.
* **The model it starts from**: the same tiny model warm-started further, to
  ``base_accuracy`` (a judge must know more than the policy it judges).
* **The pairs**: the row's answer (what SFT trains on) is chosen over (1) each sample the task's
  verifier scores wrong, as its token row was sampled (through EOS, or cut at the budget): the
  mistakes the policy makes; (2) ``swapped`` answers of other rows: answers that do not fit the
  prompt; (3) ``perturbed`` copies of the answer with one digit changed: the near misses RL
  drifts to once it leaves its own samples. Each kind was added after RL against a model fit
  without it found what that model misjudged (``PreferenceConfig``'s fields say what happened);
  pairs of made-up wrong answers alone were ranked perfectly on held-out prompts and the
  policy's own samples at chance (within-prompt AUC 0.56).
* **The model**: a one-label sequence classifier (``AutoModelForSequenceClassification``), its
  score at a row's last token (EOS, after the completion) being the reward; saved with its
  tokenizer, so the torch engine's ``reward`` role loads it as it is.
* **Reproducible**: sampling and training are seeded and run with the warm start's pinned thread
  count (:data:`~flowrl.models.warmstart.SFT_THREADS`).
* **Measured**: ``reward.json`` holds the final loss and, on held-out prompts, how often the model
  ranks a right sample of the policy over a wrong one (``test_auc``) and the row's answer over a
  wrong sample (``test_pair_accuracy``).
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from flowrl.engines.types import TokenBatch
from flowrl.models.warmstart import (
    SFT_THREADS,
    SFTConfig,
    TinyModelConfig,
    WarmStartError,
    WarmStartResult,
    default_cache_dir,
    read_entry,
    task_sft,
    torch_threads,
    warm_start,
)
from flowrl.rewards.verifiers import get_verifier
from flowrl.tasks import get_task

REWARD_CACHE_VERSION = 1
"""Bump when the reward-model procedure changes, so stale cache entries are not reused."""


@dataclass(frozen=True)
class PreferenceConfig:
    """How a tiny reward model is fit (defaults measured on the arith task, see the module docstring)."""

    steps: int = 4000
    """Optimizer steps of the Bradley-Terry fit."""
    batch_size: int = 64
    """Pairs per step."""
    lr: float = 3e-4
    """AdamW learning rate (1e-3 did not fit the model's own mistakes: loss stayed at 0.67)."""
    samples: int = 8
    """Completions of the warm-started model per train prompt; its wrong ones are the rejected."""
    temperature: float = 1.0
    """Sampling temperature of those completions (RL samples at 1.0)."""
    base_accuracy: float = 0.8
    """The reward model starts from the task's tiny model warm-started further than a policy's:
    until the warm start's check reaches this accuracy (arith, seed 0: 840 SFT steps, 83% held-out).
    A judge must know more than the policy it judges: fit on top of the policy's own 33% model, the
    reward models ranked its samples well (AUC 0.82-0.93 on held-out prompts) yet GRPO against them
    went from 33% to 1-15% held-out accuracy (the policy found the answers they misjudge)."""
    swapped: int = 1
    """Rejected completions per train prompt taken from other rows' answers (where they differ):
    well-formed answers to other prompts, which teach the model that an answer must fit its
    prompt. Without them the policy found a form its own samples never took (a 3-digit number
    starting with 1, whatever the sum) that the model scored high, and its held-out accuracy fell
    from 33% to 1% while the reward rose."""
    perturbed: int = 2
    """Rejected completions per train prompt made from its answer with one character changed to
    another of its kind (a digit to another digit), at every position alike: the mistakes a policy
    drifts to once RL pushes it off its own samples. Without them a model that ranked the policy's
    samples with AUC 0.95 scored a wrong tens digit above the right one (99+14: 183 over 113), and
    GRPO against it took held-out accuracy from 33% to 15%."""


def last_token_scores(scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-prefix scores ``[B, T]`` -> each row's score at its last real token ``[B]``.

    >>> last_token_scores(torch.tensor([[1., 2., 0.], [4., 5., 6.]]), torch.tensor([[1, 1, 0], [1, 1, 1]]))
    tensor([2., 6.])
    """
    last = attention_mask.long().sum(-1).clamp(min=1) - 1
    return scores[torch.arange(scores.shape[0]), last]


def _scores(model, rows: list[list[int]], pad_id: int) -> torch.Tensor:
    """The reward of each token row (its score at the last token)."""
    batch = TokenBatch.from_rows(rows, pad_id)
    hidden = model.base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    return last_token_scores(model.score(hidden).squeeze(-1), batch.attention_mask)


def _classifier(base_dir: str | Path, tok, seed: int):
    """A one-label sequence classifier on the causal LM ``base_dir`` (its LM head left out, a new score head)."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the load report lists the LM head left out and the new head: both intended
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # the new score head
            model = AutoModelForSequenceClassification.from_pretrained(str(base_dir), num_labels=1,
                                                                       dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(level)
    model.config.pad_token_id = tok.pad_token_id
    return model


def _fit(model, pairs: list[tuple[list[int], list[int]]], pad_id: int, *, steps: int, lr: float,
         batch_size: int | None, rng: random.Random) -> list[float]:
    """Bradley-Terry fit of ``model`` on (chosen, rejected) token rows; the loss of every step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        batch = pairs if batch_size is None or batch_size >= len(pairs) else rng.sample(pairs, batch_size)
        margin = _scores(model, [c for c, _ in batch], pad_id) - _scores(model, [r for _, r in batch], pad_id)
        loss = -torch.nn.functional.logsigmoid(margin).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses


def train_reward_model(base_dir: str | Path, out_dir: str | Path, pairs: list[tuple[str, str]], *,
                       steps: int = 30, lr: float = 1e-3, seed: int = 0) -> Path:
    """A one-label sequence classifier from the checkpoint ``base_dir``, fit to ``pairs`` of
    (chosen, rejected) texts (each tokenized whole) by the Bradley-Terry loss on every pair each
    step, saved (with the tokenizer) to ``out_dir``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base_dir))
    model = _classifier(base_dir, tok, seed)
    rows = [(tok(c).input_ids, tok(r).input_ids) for c, r in pairs]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        _fit(model, rows, tok.pad_token_id, steps=steps, lr=lr, batch_size=None, rng=random.Random(seed))
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


@torch.no_grad()
def sample_completions(model, tok, prompts: list[str], *, n: int, temperature: float, max_new_tokens: int,
                       batch_size: int = 512) -> list[list[tuple[str, list[int]]]]:
    """``n`` sampled completions of each prompt, in order, each as (text without special tokens, its
    token ids through EOS, or all of them when it stopped at ``max_new_tokens``: what a rollout's row
    holds); seeded by the caller's torch generator."""
    tok.padding_side = "left"
    eos = tok.eos_token_id
    out: list[list[tuple[str, list[int]]]] = []
    for start in range(0, len(prompts), batch_size):
        enc = tok(prompts[start:start + batch_size], return_tensors="pt", padding=True)
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature,
                             top_k=0, top_p=1.0, num_return_sequences=n, pad_token_id=tok.pad_token_id,
                             eos_token_id=eos)
        rows = []
        for ids in gen[:, enc.input_ids.shape[1]:].tolist():
            ids = ids[:ids.index(eos) + 1] if eos in ids else ids
            rows.append((tok.decode(ids, skip_special_tokens=True), ids))
        out += [rows[i:i + n] for i in range(0, len(rows), n)]
    return out


def _completion_row(tok, prompt: str, completion: str) -> list[int]:
    """``<bos> prompt completion <eos>``: the token row of a rollout that wrote ``completion`` and stopped."""
    return tok(prompt).input_ids + tok(completion, add_special_tokens=False).input_ids + [tok.eos_token_id]


def preference_pairs(policy, tok, task: str, rows: list[dict], cfg: PreferenceConfig
                     ) -> tuple[list[tuple[list[int], list[int]]], list[list[tuple[str, float, list[int]]]]]:
    """``(pairs, samples)``: (chosen, rejected) token rows, the row's answer chosen over each wrong
    sample of ``policy`` on ``rows`` (its token row as sampled), over ``cfg.swapped`` answers of other
    rows and over ``cfg.perturbed`` copies of itself with one character changed (:func:`perturb`);
    and each row's samples as (text, verifier score, token ids)."""
    spec = get_task(task)
    verify = get_verifier(spec.verifier)
    sampled = sample_completions(policy, tok, [r["prompt"] for r in rows], n=cfg.samples,
                                 temperature=cfg.temperature, max_new_tokens=spec.max_new_tokens)
    flat = [t for group in sampled for t, _ in group]
    right = verify(flat, [r["answer"] for r in rows for _ in range(cfg.samples)])
    scored = [[(t, right[i * cfg.samples + j], ids) for j, (t, ids) in enumerate(group)]
              for i, group in enumerate(sampled)]
    pairs = []
    rng = random.Random(len(rows))
    answers = [r["answer"] for r in rows]
    for r, group in zip(rows, scored):
        prompt = tok(r["prompt"]).input_ids
        chosen = _completion_row(tok, r["prompt"], r["answer"])
        pairs += [(chosen, prompt + ids) for _, ok, ids in group if ok < 1.0]
        others = [a for a in rng.sample(answers, min(len(answers), 4 * cfg.swapped)) if a != r["answer"]]
        pairs += [(chosen, _completion_row(tok, r["prompt"], a)) for a in others[:cfg.swapped]]
        pairs += [(chosen, _completion_row(tok, r["prompt"], perturb(r["answer"], rng)))
                  for _ in range(cfg.perturbed) if any(_kind_of(c) for c in r["answer"])]
    return pairs, scored


_KINDS = ("0123456789", "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _kind_of(c: str) -> str:
    """The characters of ``c``'s kind (digits, lower- or upper-case letters), or "" for any other."""
    return next((k for k in _KINDS if c in k), "")


def perturb(answer: str, rng: random.Random) -> str:
    """``answer`` with one digit or letter (uniformly among them) changed to another of its kind.

    >>> perturb("113", random.Random(0)) != "113"
    True
    """
    positions = [i for i, c in enumerate(answer) if _kind_of(c)]
    i = rng.choice(positions)
    kind = _kind_of(answer[i])
    return answer[:i] + rng.choice([c for c in kind if c != answer[i]]) + answer[i + 1:]


@torch.no_grad()
def ranking_quality(model, tok, rows: list[dict], samples: list[list[tuple[str, float, list[int]]]]) -> dict:
    """On ``rows`` (held out) and the policy's scored ``samples`` of them: ``test_auc``, the share of
    (right sample, wrong sample) pairs of one prompt ranked right first, over prompts with both, and
    ``test_pair_accuracy``, the share of (answer, wrong sample) pairs ranked answer first."""
    pad = tok.pad_token_id
    wins = pairs = 0
    aucs = []
    for r, group in zip(rows, samples):
        if all(ok >= 1.0 for _, ok, _ in group):
            continue
        prompt = tok(r["prompt"]).input_ids
        ranked = _scores(model, [prompt + ids for _, _, ids in group]
                         + [_completion_row(tok, r["prompt"], r["answer"])], pad)
        answer, sample_scores = ranked[-1], ranked[:-1]
        bad = torch.stack([s for s, (_, ok, _) in zip(sample_scores, group) if ok < 1.0])
        good = [s for s, (_, ok, _) in zip(sample_scores, group) if ok >= 1.0]
        wins += int((answer > bad).sum())
        pairs += len(bad)
        if good:
            aucs.append(float((torch.stack(good)[:, None] > bad[None, :]).float().mean()))
    return {"test_pair_accuracy": wins / pairs if pairs else None,
            "test_auc": sum(aucs) / len(aucs) if aucs else None, "test_auc_prompts": len(aucs)}


def reward_cache_key(sampler: WarmStartResult, base: WarmStartResult, cfg: PreferenceConfig, seed: int
                     ) -> tuple[str, dict]:
    """``(hex key, the dict it hashes)`` of one reward model: the warm starts it samples and starts from,
    the fit, the seed."""
    inputs = {"version": REWARD_CACHE_VERSION, "sampler": sampler.path.name, "base": base.path.name,
              "preferences": asdict(cfg), "seed": seed}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16], inputs


def reward_start(
    task: str = "arith",
    *,
    model_cfg: TinyModelConfig = TinyModelConfig(),
    sft: SFTConfig | None = None,
    preferences: PreferenceConfig = PreferenceConfig(),
    seed: int = 0,
    cache_dir: str | Path | None = None,
) -> WarmStartResult:
    """The tiny reward model of ``task`` (see the module docstring), cached next to warm starts: the
    warm start of ``(task, model_cfg, sft, seed)`` (a policy's starting point: ``sft`` None is the
    task's) samples the preference pairs; the same model warm-started until
    ``preferences.base_accuracy`` is fit to them."""
    spec = get_task(task)
    if spec.sft_turns is not None:
        raise WarmStartError(f"task {task!r} trains multi-turn episodes; a tiny reward model scores one completion: "
                             "use a single-turn task")
    from transformers import AutoModelForCausalLM

    from flowrl.models.tiny import load_tokenizer

    sft = sft if sft is not None else task_sft(task)
    sampler = warm_start(task, model_cfg=model_cfg, sft=sft, seed=seed, cache_dir=cache_dir)
    base = warm_start(task, model_cfg=model_cfg, sft=replace(sft, stop_at_accuracy=preferences.base_accuracy),
                      seed=seed, cache_dir=cache_dir)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key, inputs = reward_cache_key(sampler, base, preferences, seed)
    final = root / f"{task}-rm-{key}"
    if (final / "reward.json").is_file():
        return WarmStartResult(final, True, read_entry(final / "reward.json"))
    tmp = Path(tempfile.mkdtemp(prefix=f".{task}-rm-{key}-", dir=root))
    try:
        tok = load_tokenizer(base.path)
        policy = AutoModelForCausalLM.from_pretrained(str(sampler.path), dtype=torch.float32).eval()
        train, test = spec.rows("train"), spec.rows("test")
        rng = random.Random(seed)
        with torch.random.fork_rng(devices=[]), torch_threads(SFT_THREADS):
            torch.manual_seed(seed)
            pairs, _ = preference_pairs(policy, tok, task, train, preferences)
            _, test_samples = preference_pairs(policy, tok, task, test, preferences)
            if not pairs:
                raise WarmStartError(f"the warm-started {task} model got every sampled train answer right: "
                                     "no preference pairs to fit a reward model to")
            model = _classifier(base.path, tok, seed)
            losses = _fit(model, pairs, tok.pad_token_id, steps=preferences.steps, lr=preferences.lr,
                          batch_size=preferences.batch_size, rng=rng)
            quality = ranking_quality(model, tok, test, test_samples)
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        info = {**inputs, "task": task, "pairs": len(pairs), "final_loss": sum(losses[-50:]) / len(losses[-50:]),
                "base_test_accuracy": base.info.get("test_accuracy"), **quality}
        (tmp / "reward.json").write_text(json.dumps(info, indent=1, sort_keys=True))
        try:
            tmp.rename(final)
        except OSError:  # another process finished first: keep its copy
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return WarmStartResult(final, False, read_entry(final / "reward.json"))


__all__ = ["PreferenceConfig", "last_token_scores", "preference_pairs", "ranking_quality", "reward_start",
           "sample_completions", "train_reward_model"]
