"""``reward_model(m)``: rewards from a scalar-head model served on its own engine.

The compiler plans model ``m``'s ``train`` engine for it (the record's ``serves_model``); the
runtime starts that engine in the ``reward`` role (a one-label sequence classifier:
:class:`flowrl.engines.torch_train.RewardModel`), whose ``forward`` returns the score of every
prefix. A completion's reward is the score at its row's last token, which is what
``AutoModelForSequenceClassification`` returns for the row (``tests/runtime/test_reward_model.py``
checks it to 1e-5 after training a tiny reward model on preference pairs).

:class:`ModelReward` scores the rollouts' own token rows (prompt + completion, as the policy
sampled them: no decoding and re-encoding), batched in one forward of the reward engine;
:meth:`ModelReward.score` scores texts (prompt + completion, tokenized with the flow's tokenizer)
for callers that have no token rows.

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

    def __init__(self, model: str, origin: str):
        self.model = model
        self.origin = origin
        self.engines: Any = None
        self.data: Any = None
        self.correct: float | None = None
        """A score has no "right" value: held-out accuracy needs the dataset's ``eval_reward``."""

    def bind(self, engines: Any, data: Any, paths: Any = None) -> None:
        """The run's engine service (the reward engine lives there) and data service (its tokenizer);
        ``paths`` (the prepared checkpoints) are not needed: the policy's tokenizer is the reward model's."""
        self.engines, self.data = engines, data

    def score_tokens(self, batch: TokenBatch, step: int):
        """Rewards of token rows (``batch``: prompt + completion, right-padded), one forward."""
        from flowrl.rewards.pool import RewardResult

        out = self.engines.forward(self.model, batch, step)
        return RewardResult(last_token_scores(out["scores"], batch.attention_mask).tolist())

    def score(self, completions: list[str], answers: list[str], prompts: list[str] | None = None,
              rows: list[dict] | None = None):
        """Rewards of texts: each prompt + completion, tokenized with the flow's tokenizer."""
        prompts = prompts if prompts is not None else [""] * len(completions)
        ids = self.data.tokenize([p + c for p, c in zip(prompts, completions)])
        return self.score_tokens(TokenBatch.from_rows(ids, self.data.pad_id), -1)

    def close(self) -> None:
        """Nothing of its own: the reward engine is the fleet's."""


__all__ = ["ModelReward"]
