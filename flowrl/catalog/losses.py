"""The catalogue of losses (``update(..., loss = ppo_clip(0.2))``), KL estimators and aggregations.

A loss is a configuration value, not a graph node: the update's ``loss`` option. Its record
says what it needs (the field of the update's ``targets`` and ``old`` arguments, the role of
the model it trains) and names the runtime function that computes it (``fn``, a key of the
runtime's loss table: a test pairs the two). The compiler checks flows against these
records; the runtime builds the loss from them; an unknown name is an error everywhere.

>>> LOSSES["ppo_clip"].fn, LOSSES["value_clip"].model_role
('ppo_clip', 'critic')
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flowrl.catalog.platforms import PLATFORMS
from flowrl.catalog.spec import RUNS, KwSpec, Support

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
"""How per-token losses become one number (veRL's ``loss_agg_mode``): the mean over every
response token of the batch; the mean over sequences of each sequence's token sum; the mean
over sequences of each sequence's token mean."""

KL_ESTIMATORS = ("k1", "k2", "k3", "abs")
"""Estimators of KL(policy || reference) from per-token log-probs (Schulman's k1, k2, k3, and
veRL's ``abs`` = |log p - log q|); k3 is clamped as veRL clamps it. Both the KL in the reward
(``kl_penalty(kind = ...)``) and the KL in the loss (``update(kl_kind = ...)``) take every one."""


@dataclass(frozen=True)
class LossSpec:
    name: str
    params: tuple[tuple[str, KwSpec], ...]
    """In positional order: ``ppo_clip(0.2)`` is ``ppo_clip(clip = 0.2)``."""
    needs_targets: str
    """The field the update's ``targets`` argument must carry."""
    needs_old: str | None
    """The field the update's ``old`` argument must carry (None: not used)."""
    model_role: str
    """The model role this loss trains."""
    doc: str = ""
    fn: str = ""
    """The runtime's loss function for it, by name (the runtime's ``LOSS_FUNCTIONS``)."""
    platforms: dict = field(default_factory=lambda: dict.fromkeys(PLATFORMS, RUNS))
    """Platform (:data:`~flowrl.catalog.platforms.PLATFORMS`) -> :class:`Support`: every platform
    unless the record says otherwise (a loss is torch code run by the train engine). ``flowrl check``
    refuses a loss on a platform it does not run on (E444)."""

    def support(self, platform: str) -> Support:
        return self.platforms.get(platform, Support(False, {}, f"`{self.name}` does not run on {platform}"))


ConfigSpec = LossSpec
"""The name the compiler's kwargs checks use for configuration values."""

_AGG = KwSpec("str", "token-mean", choices=AGGREGATIONS)

LOSSES: dict[str, LossSpec] = {
    c.name: c for c in (
        LossSpec("ppo_clip", (("clip", KwSpec("float", 0.2, min=0.0)),
                              ("clip_high", KwSpec("float", None, min=0.0)),
                              ("dual_clip", KwSpec("float", None, min=1.0)),
                              ("agg", _AGG)),
                 "advantages", "logprobs", "trainable", "PPO clipped surrogate at token level.", fn="ppo_clip"),
        LossSpec("pg", (("agg", _AGG),),
                 "advantages", None, "trainable", "Vanilla policy gradient (REINFORCE).", fn="pg"),
        LossSpec("gspo", (("clip", KwSpec("float", 3e-4, min=0.0, max=0.999)),
                          ("clip_high", KwSpec("float", 4e-4, min=0.0)),
                          ("agg", KwSpec("str", "seq-mean-token-mean", choices=AGGREGATIONS))),
                 "advantages", "logprobs", "trainable",
                 "GSPO: PPO clip on the sequence-level, length-normalised importance ratio.", fn="gspo"),
        LossSpec("cispo", (("clip_high", KwSpec("float", 4.0, min=0.0)),
                           ("clip", KwSpec("float", None, min=0.0, max=0.999,
                                           doc="lower clip of the weight (none: no lower bound)")),
                           ("agg", _AGG)),
                 "advantages", "logprobs", "trainable",
                 "CISPO: REINFORCE weighted by clipped, stop-gradient importance ratios.", fn="cispo"),
        LossSpec("value_clip", (("clip", KwSpec("float", 0.2, min=0.0)),
                                ("agg", KwSpec("str", "token-mean", choices=("token-mean", "seq-mean-token-mean")))),
                 "returns", "values", "critic", "Clipped value loss for a critic.", fn="value_clip"),
    )
}

__all__ = ["LossSpec", "ConfigSpec", "LOSSES", "AGGREGATIONS", "KL_ESTIMATORS"]
