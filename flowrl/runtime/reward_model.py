"""``reward_model(m)``: rewards from a scalar-head model served on its own engine.

The compiler plans model ``m``'s ``train`` engine for it (the record's ``serves_model``); the
runtime starts that engine in the ``reward`` role (a one-label sequence classifier:
:class:`flowrl.engines.torch_train.RewardModel`), whose ``forward`` returns the score of every
prefix. A completion's reward is the score at its row's last token, which is what
``AutoModelForSequenceClassification`` returns for the row (``tests/runtime/test_reward_model.py``
checks it to 1e-5 after training a tiny reward model on preference pairs).

:class:`ModelReward` scores the rollouts' own token rows (prompt + completion, as the policy
sampled them: no decoding and re-encoding), batched in one forward of the reward engine, when the
reward model reads the policy's token ids: its tokenizer is the policy's, by content
(:func:`flowrl.model_files.same_tokenizer`: vocabulary, merges, added tokens). A reward model with
a tokenizer of its own (a real one, trained on another family's vocabulary) would score those ids
as garbage, so it reads the text instead, as veRL and OpenRLHF feed theirs: each prompt + completion
as the policy's tokenizer decoded it, tokenized with the reward model's own tokenizer (its BOS as it
adds one), and its EOS after a completion the policy ended with EOS (where the score is read).
:meth:`ModelReward.score` scores texts (the held-out evaluation) the same way.

:mod:`flowrl.models.reward` builds one locally (``tiny_rm(...)`` in a flow, or
``train_reward_model`` on pairs of texts): a Bradley-Terry fit of a sequence classifier on
preference pairs (``-log sigmoid(r(chosen) - r(rejected))``), saved with its tokenizer.
"""

from __future__ import annotations

from typing import Any


from flowrl.engines.types import TokenBatch
from flowrl.models.reward import last_token_scores


class ModelReward:
    """The scorer of one ``reward_model(m)`` resource (see the module docstring)."""

    def __init__(self, model: str, origin: str, policy: str | None = None):
        self.model = model
        self.origin = origin
        self.policy = policy
        """The model whose tokenizer made the token rows it is given (the flow's tokenizer's: the model that
        generates); None: unknown, the texts are re-tokenized."""
        self.engines: Any = None
        self.data: Any = None
        self.tokenizer: Any = None
        """The reward model's own tokenizer where it is not the policy's (texts are re-tokenized); else None."""
        self.correct: float | None = None
        """A score has no "right" value: held-out accuracy needs the dataset's ``eval_reward``."""

    def bind(self, engines: Any, data: Any, paths: Any = None) -> None:
        """The run's engine service (the reward engine lives there) and data service (the policy's tokenizer);
        ``paths`` (the prepared checkpoints) say whether the reward model's tokenizer is the policy's."""
        from flowrl.model_files import same_tokenizer

        self.engines, self.data = engines, data
        if paths is None or self.policy is None or not same_tokenizer(paths[self.model], paths[self.policy]):
            from flowrl.runtime.materialize import load_tokenizer

            self.tokenizer = load_tokenizer(paths[self.model], f"{self.origin}: `{self.model}`: ") \
                if paths is not None else None

    @property
    def retokenizes(self) -> bool:
        """Whether it reads texts tokenized with its own tokenizer (see the module docstring)."""
        return self.tokenizer is not None

    def score_job(self, job: Any):
        """Rewards of a batch of rollouts (:class:`~flowrl.runtime.rewards.ScoreJob`): its token rows as they
        are, or its texts re-tokenized (see the module docstring)."""
        if not self.retokenizes:
            return self.score_tokens(job.batch, job.step)
        prompts = job.prompts if job.prompts is not None else [""] * len(job.texts)
        return self._score_texts(prompts, job.texts, job.step, self._ended(job.batch))

    def score_tokens(self, batch: TokenBatch, step: int):
        """Rewards of token rows in the reward model's vocabulary (``batch``: prompt + completion,
        right-padded), one forward."""
        from flowrl.rewards.pool import RewardResult

        out = self.engines.forward(self.model, batch, step)
        return RewardResult(last_token_scores(out["scores"], batch.attention_mask).tolist())

    def score(self, completions: list[str], answers: list[str], prompts: list[str] | None = None,
              rows: list[dict] | None = None):
        """Rewards of texts: each prompt + completion, tokenized with the reward model's tokenizer."""
        prompts = prompts if prompts is not None else [""] * len(completions)
        return self._score_texts(prompts, completions, -1, [False] * len(completions))

    def _score_texts(self, prompts: list[str], completions: list[str], step: int, ended: list[bool]):
        """Each prompt + completion tokenized with the reward model's tokenizer (the flow's where it is the
        same), its EOS appended where ``ended``; one forward."""
        from flowrl.data.chat import encode, pad_id

        texts = [p + c for p, c in zip(prompts, completions)]
        if self.tokenizer is None:
            return self.score_tokens(TokenBatch.from_rows(self.data.tokenize(texts), self.data.pad_id), step)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        ids = [encode(self.tokenizer, t) + ([eos] if end and isinstance(eos, int) else []) for t, end in zip(texts, ended)]
        return self.score_tokens(TokenBatch.from_rows(ids, pad_id(self.tokenizer)), step)

    def _ended(self, batch: TokenBatch) -> list[bool]:
        """Per row: the policy's completion ended with the policy's EOS (its last real token)."""
        eos = getattr(getattr(self.data, "tokenizer", None), "eos_token_id", None)
        last = batch.attention_mask.long().sum(-1).clamp(min=1) - 1
        tokens = batch.input_ids[range(batch.size), last].tolist()
        return [isinstance(eos, int) and t == eos for t in tokens]

    def close(self) -> None:
        """Nothing of its own: the reward engine is the fleet's."""


__all__ = ["ModelReward"]
