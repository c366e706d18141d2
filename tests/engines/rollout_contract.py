"""Behaviour every RolloutEngine must show, checked against the torch train engine.

Each ``check_*`` function takes a live engine and the tiny checkpoint's dir; the
per-backend test files call them, so vLLM and the transformers engine are held
to the same contract.
"""

from __future__ import annotations

import torch
from engine_testkit import (
    EOS_ID,
    PROMPTS,
    build_tokenizer,
    completions_batch,
    encode,
    make_trainer,
    max_logprob_gap,
    train_a_few_steps,
)

from flowrl.engines.base import EngineConfigError, RolloutEngine
from flowrl.engines.types import SamplingSpec

TOL = 1e-4
"""Largest allowed |rollout logprob - trainer logprob| (float32 on both sides)."""

LONG_PROMPT = encode("abcdefghijklmnopqrstuvwxyz0123456789 abcdefgh")
"""45 tokens: longer than one 32-token KV block, so vLLM's prefix cache holds it."""


def prompts() -> list[list[int]]:
    return [encode(p) for p in PROMPTS]


def check_grouped_completions(engine: RolloutEngine) -> None:
    """n samples per prompt, grouped in prompt order, with one logprob per token."""
    assert isinstance(engine, RolloutEngine)
    spec = SamplingSpec(n=3, temperature=0.8, max_tokens=10, seed=7)
    groups = engine.generate(prompts(), spec)
    assert len(groups) == len(PROMPTS) and all(len(g) == 3 for g in groups)
    tokenizer = build_tokenizer()
    for prompt, group in zip(prompts(), groups):
        assert len({c.response_ids for c in group}) > 1  # distinct seeds per sample
        for c in group:
            assert list(c.prompt_ids) == prompt
            assert 1 <= len(c.response_ids) == len(c.logprobs) <= spec.max_tokens
            assert all(lp <= 0.0 for lp in c.logprobs)
            if c.finish_reason == "length":
                assert len(c.response_ids) == spec.max_tokens and EOS_ID not in c.response_ids
            else:
                assert c.finish_reason == "stop" and c.response_ids[-1] == EOS_ID
                assert EOS_ID not in c.response_ids[:-1]
            assert c.text == tokenizer.decode(list(c.response_ids), skip_special_tokens=True)


def check_logprobs_match_trainer(engine: RolloutEngine, model_dir: str) -> None:
    """Greedy (T=0, raw logits) and sampled (T=0.7) logprobs equal the trainer's forward."""
    for temperature in (0.0, 0.7):
        spec = SamplingSpec(n=2, temperature=temperature, max_tokens=12, seed=3)
        groups = engine.generate(prompts(), spec)
        batch = completions_batch(groups)
        trainer = make_trainer(model_dir, temperature=temperature or 1.0)
        gap = max_logprob_gap(groups, trainer.forward(batch)["logprobs"], batch)
        assert gap < TOL, (temperature, gap)
    # Greedy responses are the trainer's argmax continuations.
    greedy = engine.generate(prompts(), SamplingSpec(temperature=0.0, max_tokens=12))
    trainer = make_trainer(model_dir)
    for group in greedy:
        ids = torch.tensor([list(group[0].prompt_ids) + list(group[0].response_ids)])
        with torch.no_grad():
            logits = trainer.model(input_ids=ids).logits[0]
        p = len(group[0].prompt_ids)
        assert logits[p - 1 : -1].argmax(-1).tolist() == list(group[0].response_ids)


def check_top_k(engine: RolloutEngine, model_dir: str) -> None:
    """top_k=1 is greedy with logprob 0; top_k=5 logprobs renormalise over the 5 best tokens."""
    greedy = engine.generate(prompts(), SamplingSpec(temperature=0.0, max_tokens=8))
    top1 = engine.generate(prompts(), SamplingSpec(temperature=1.0, top_k=1, max_tokens=8, seed=1))
    for g, t in zip(greedy, top1):
        assert t[0].response_ids == g[0].response_ids
        assert max(abs(lp) for lp in t[0].logprobs) < 1e-6

    groups = engine.generate(prompts(), SamplingSpec(n=2, temperature=1.0, top_k=5, max_tokens=8, seed=2))
    trainer = make_trainer(model_dir)
    for group in groups:
        for c in group:
            ids = torch.tensor([list(c.prompt_ids) + list(c.response_ids)])
            with torch.no_grad():
                logits = trainer.model(input_ids=ids).logits[0].float()
            p = len(c.prompt_ids)
            for k, tok in enumerate(c.response_ids):
                row = logits[p - 1 + k]
                top = row.topk(5).values
                assert row[tok] >= top[-1]  # only the 5 best tokens can be sampled
                expected = float(row[tok] - torch.logsumexp(top, 0))
                assert abs(c.logprobs[k] - expected) < TOL


def _nucleus(row: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits of the top-p nucleus: drop the least likely tokens whose total mass is <= 1 - top_p."""
    ascending = row.sort().values
    mass_below = torch.softmax(ascending, 0).cumsum(0)
    return ascending[mass_below > 1 - top_p]


def check_top_p(engine: RolloutEngine, model_dir: str) -> None:
    """top_p=0.6 at T=0.8: tokens come from the nucleus, logprobs renormalise over it."""
    spec = SamplingSpec(n=2, temperature=0.8, top_p=0.6, max_tokens=8, seed=4)
    groups = engine.generate(prompts(), spec)
    trainer = make_trainer(model_dir)
    for group in groups:
        for c in group:
            ids = torch.tensor([list(c.prompt_ids) + list(c.response_ids)])
            with torch.no_grad():
                logits = trainer.model(input_ids=ids).logits[0].float() / spec.temperature
            p = len(c.prompt_ids)
            for k, tok in enumerate(c.response_ids):
                row = logits[p - 1 + k]
                kept = _nucleus(row, spec.top_p)
                assert row[tok] >= kept.min()
                assert abs(c.logprobs[k] - float(row[tok] - torch.logsumexp(kept, 0))) < TOL


def check_seeding(engine: RolloutEngine) -> None:
    """The same seed reproduces samples exactly; another seed changes them."""
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=10, seed=11)
    first = engine.generate(prompts(), spec)
    again = engine.generate(prompts(), spec)
    other = engine.generate(prompts(), SamplingSpec(n=2, temperature=1.0, max_tokens=10, seed=12))
    ids = lambda groups: [[c.response_ids for c in g] for g in groups]  # noqa: E731
    assert ids(first) == ids(again)
    assert [[c.logprobs for c in g] for g in first] == [[c.logprobs for c in g] for g in again]
    assert ids(first) != ids(other)


def check_stop_strings(engine: RolloutEngine) -> None:
    """A completion ends at the first stop string: its tokens are kept, the text drops it."""
    spec = SamplingSpec(n=4, temperature=1.0, max_tokens=12, seed=5, stop=("a", "e"))
    groups = engine.generate(prompts(), spec)
    tokenizer = build_tokenizer()
    stopped = 0
    for group in groups:
        for c in group:
            full = tokenizer.decode(list(c.response_ids), skip_special_tokens=True)
            before_last = tokenizer.decode(list(c.response_ids[:-1]), skip_special_tokens=True)
            assert "a" not in before_last and "e" not in before_last
            assert "a" not in c.text and "e" not in c.text
            if c.finish_reason == "stop" and c.response_ids[-1] != EOS_ID:
                stopped += 1
                assert full[-1] in "ae" and c.text == full[:-1]
    assert stopped >= 3  # 'a' and 'e' are common under this seed


def check_update_weights(engine: RolloutEngine, model_dir: str) -> None:
    """After update_weights with trained weights the engine samples from the trained model.

    The long prompt is sampled before the update, so a stale prefix cache would show.
    Restoring the original weights brings the original outputs back.
    """
    spec = SamplingSpec(temperature=0.0, max_tokens=10)
    rows = prompts() + [LONG_PROMPT]
    before = engine.generate(rows, spec)

    trainer = make_trainer(model_dir)
    train_a_few_steps(trainer, steps=3)
    engine.update_weights(trainer.named_weights())
    after = engine.generate(rows, spec)
    batch = completions_batch(after)
    assert max_logprob_gap(after, trainer.forward(batch)["logprobs"], batch) < TOL
    assert [g[0].response_ids for g in after] != [g[0].response_ids for g in before]
    old_batch = completions_batch(before)
    assert max_logprob_gap(before, trainer.forward(old_batch)["logprobs"], old_batch) > 1e-2

    engine.update_weights(make_trainer(model_dir).named_weights())
    restored = engine.generate(rows, spec)
    assert [g[0].response_ids for g in restored] == [g[0].response_ids for g in before]
    gaps = [abs(a - b) for r, o in zip(restored, before) for a, b in zip(r[0].logprobs, o[0].logprobs)]
    assert max(gaps) < 1e-5


def check_bad_requests(engine: RolloutEngine) -> None:
    """User mistakes raise EngineConfigError naming the bad value."""
    cases = [
        ([[]], SamplingSpec(), "prompt 0 is empty"),
        ([[1, 999]], SamplingSpec(), "token id 999"),
        ([[1, 5]], SamplingSpec(n=0), "SamplingSpec.n=0"),
        ([[1, 5]], SamplingSpec(top_p=0.0), "SamplingSpec.top_p=0.0"),
        ([[1, 5]], SamplingSpec(temperature=-1.0), "SamplingSpec.temperature=-1.0"),
    ]
    for rows, spec, message in cases:
        try:
            engine.generate(rows, spec)
        except EngineConfigError as err:
            assert message in str(err), (message, str(err))
        else:
            raise AssertionError(f"no error for {message}")
