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

:func:`train_reward_model` builds one locally: a Bradley-Terry fit of a sequence classifier on
preference pairs (``-log sigmoid(r(chosen) - r(rejected))``), saved with its tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from flowrl.engines.types import TokenBatch


def last_token_scores(scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-prefix scores ``[B, T]`` -> each row's score at its last real token ``[B]``.

    >>> last_token_scores(torch.tensor([[1., 2., 0.], [4., 5., 6.]]), torch.tensor([[1, 1, 0], [1, 1, 1]]))
    tensor([2., 6.])
    """
    last = attention_mask.long().sum(-1).clamp(min=1) - 1
    return scores[torch.arange(scores.shape[0]), last]


class ModelReward:
    """The scorer of one ``reward_model(m)`` resource (see the module docstring)."""

    def __init__(self, model: str, origin: str):
        self.model = model
        self.origin = origin
        self.engines: Any = None
        self.data: Any = None

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
        width = max(len(r) for r in ids)
        input_ids = torch.full((len(ids), width), int(self.data.pad_id), dtype=torch.long)
        attn = torch.zeros((len(ids), width), dtype=torch.long)
        for i, r in enumerate(ids):
            input_ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            attn[i, :len(r)] = 1
        return self.score_tokens(TokenBatch(input_ids, attn, attn.float(), {}), -1)

    def close(self) -> None:
        """Nothing of its own: the reward engine is the fleet's."""


def train_reward_model(base_dir: str | Path, out_dir: str | Path, pairs: list[tuple[str, str]], *,
                       steps: int = 30, lr: float = 1e-3, seed: int = 0) -> Path:
    """A one-label sequence classifier from the checkpoint ``base_dir``, fit to ``pairs`` of
    (chosen, rejected) texts by the Bradley-Terry loss, saved (with the tokenizer) to ``out_dir``."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base_dir))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(str(base_dir), num_labels=1,
                                                                   dtype=torch.float32)
        model.config.pad_token_id = tok.pad_token_id
        opt = torch.optim.AdamW(model.parameters(), lr=lr)

        def scores(texts: list[str]) -> torch.Tensor:
            enc = [tok(t).input_ids for t in texts]
            width = max(len(e) for e in enc)
            ids = torch.full((len(enc), width), tok.pad_token_id, dtype=torch.long)
            attn = torch.zeros((len(enc), width), dtype=torch.long)
            for i, e in enumerate(enc):
                ids[i, :len(e)] = torch.tensor(e)
                attn[i, :len(e)] = 1
            hidden = model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state
            return last_token_scores(model.score(hidden).squeeze(-1), attn)

        model.train()
        for _ in range(steps):
            chosen, rejected = scores([c for c, _ in pairs]), scores([r for _, r in pairs])
            loss = -torch.nn.functional.logsigmoid(chosen - rejected).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


__all__ = ["ModelReward", "last_token_scores", "train_reward_model"]
