"""A generative judge, ``llm_judge(m, template = ..., max_tokens = ..., on_error = ...)``.

The compiler plans model ``m``'s rollout engine for it (the record's ``serves_engine``), placed
and laid out by the schedule like any engine, and never resynced (nothing trains ``m``). At run
time :class:`LLMJudge` fills the template for each completion (``{prompt}``, ``{completion}``,
``{answer}``), tokenizes it with the judge's own tokenizer, and has the judge's engine write
greedily (temperature 0, ``max_tokens``); the first number in what it wrote is the reward
(:func:`parse_score`). A judgement without a number, or an input too long for the judge's
context, gives that sample the ``on_error`` reward and is reported (``reward/errors``), never
a silent 0.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

SCORE = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
"""A decimal number, as a judge writes one."""


def parse_score(text: str) -> float | None:
    """The first number in ``text``, else None.

    >>> parse_score("Score: 7/10"), parse_score(" -0.5 because"), parse_score("1e2"), parse_score("none")
    (7.0, -0.5, 100.0, None)
    """
    m = SCORE.search(text)
    return float(m.group()) if m else None


def fill(template: str, prompt: str, completion: str, answer: str) -> str:
    """``template`` with its fields replaced (plain replacement: braces in a completion are text).

    >>> fill("Q: {prompt} A: {completion} ({answer})", "1+1=", "2 {x}", "2")
    'Q: 1+1= A: 2 {x} (2)'
    """
    out = []
    for piece in re.split(r"(\{prompt\}|\{completion\}|\{answer\})", template):
        out.append({"{prompt}": prompt, "{completion}": completion, "{answer}": answer}.get(piece, piece))
    return "".join(out)


class LLMJudge:
    """The scorer of one ``llm_judge(m)`` resource (see the module docstring)."""

    def __init__(self, model: str, template: str, max_tokens: int, on_error: float, origin: str):
        self.model, self.template, self.max_tokens, self.on_error, self.origin = \
            model, template, max_tokens, on_error, origin
        self.engines: Any = None
        self.tokenizer: Any = None
        self.context: int | None = None
        self.correct: float | None = None
        """A judge's number has no "right" value: held-out accuracy needs the dataset's ``eval_reward``."""

    def bind(self, engines: Any, data: Any, paths: dict[str, Path]) -> None:
        """The run's engine service (the judge's rollout engine lives there), and the judge's own
        tokenizer and context, read from its prepared checkpoint."""
        from transformers import AutoTokenizer

        from flowrl.catalog.models import checkpoint_context

        self.engines = engines
        self.tokenizer = AutoTokenizer.from_pretrained(str(paths[self.model]))
        self.context = checkpoint_context(paths[self.model])

    def score_job(self, job: Any):
        """Rewards of a batch of rollouts (:class:`~flowrl.runtime.rewards.ScoreJob`) at its step."""
        return self._judge(job.texts, job.answers, job.prompts, job.step)

    def score(self, completions: list[str], answers: list[str], prompts: list[str] | None = None,
              rows: list[dict] | None = None):
        """Rewards of texts (the held-out evaluation)."""
        return self._judge(completions, answers, prompts, -1)

    def _judge(self, completions: list[str], answers: list[str], prompts: list[str] | None, step: int):
        from flowrl.engines.types import SamplingSpec
        from flowrl.rewards.pool import RewardError, RewardResult

        prompts = prompts if prompts is not None else [""] * len(completions)
        inputs = [fill(self.template, p, c, a) for p, c, a in zip(prompts, completions, answers)]
        ids = [list(self.tokenizer(t).input_ids) for t in inputs]
        rewards = [self.on_error] * len(ids)
        errors: dict[int, str] = {}
        fits = [i for i, row in enumerate(ids) if self.context is None or len(row) + self.max_tokens <= self.context]
        for i in sorted(set(range(len(ids))) - set(fits)):
            errors[i] = (f"the judge's input is {len(ids[i])} tokens, and with max_tokens = {self.max_tokens} it "
                         f"exceeds `{self.model}`'s context of {self.context} tokens: shorten the template")
        if fits:
            spec = SamplingSpec(n=1, temperature=0.0, max_tokens=self.max_tokens, stop=(), seed=0)
            groups, _ = self.engines.generate(self.model, [ids[i] for i in fits], spec, step)
            for i, group in zip(fits, groups):
                value = parse_score(group[0].text)
                if value is None:
                    errors[i] = f"the judgement {group[0].text!r} holds no number"
                else:
                    rewards[i] = value
        return RewardResult(rewards, [RewardError.of(i, prompts[i], completions[i], errors[i]) for i in sorted(errors)])

    def close(self) -> None:
        """Nothing of its own: the judge's engine is the fleet's."""


__all__ = ["LLMJudge", "fill", "parse_score"]
