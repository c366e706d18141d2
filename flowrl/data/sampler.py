"""A deterministic, resumable batch sampler over dataset rows.

Each epoch is a permutation of ``range(n_rows)`` that depends only on ``(seed, epoch)``;
a cursor marks how far into the current epoch's permutation the sampler is. Batches are
always full: a batch that runs past the end of an epoch continues with the start of the
next epoch's permutation, so every row is drawn exactly once per epoch.

``state_dict()`` is ``{epoch, cursor}`` plus the settings it is valid for; loading it into
a sampler built with the same settings continues with exactly the batches the original
would have produced.
"""

from __future__ import annotations

import random
from typing import Any, Sequence


class SamplerStateError(ValueError):
    """A sampler state that does not fit this sampler (other dataset size, batch or seed)."""


class BatchSampler:
    """Seeded per-epoch shuffling with a cursor; yields lists of row indices."""

    def __init__(self, n_rows: int, batch_size: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if n_rows < 1:
            raise ValueError(f"BatchSampler: n_rows={n_rows}; the dataset has no rows")
        if batch_size < 1:
            raise ValueError(f"BatchSampler: batch_size={batch_size}; must be >= 1")
        self.n_rows, self.batch_size, self.seed, self.shuffle = n_rows, batch_size, seed, shuffle
        self.epoch = 0
        self.cursor = 0
        self._perm_epoch = -1
        self._perm: list[int] = []

    def _permutation(self, epoch: int) -> list[int]:
        """The order of rows in ``epoch`` (cached for the current epoch)."""
        if epoch != self._perm_epoch:
            order = list(range(self.n_rows))
            if self.shuffle:
                # A str seed is hashed with SHA-512 by `random`, so (seed, epoch) pairs
                # give independent, platform-stable streams.
                random.Random(f"flowrl.sampler:{self.seed}:{epoch}").shuffle(order)
            self._perm, self._perm_epoch = order, epoch
        return self._perm

    def next_batch(self) -> list[int]:
        """The next ``batch_size`` row indices; advances the cursor (and the epoch when it wraps)."""
        out: list[int] = []
        while len(out) < self.batch_size:
            perm = self._permutation(self.epoch)
            take = min(self.batch_size - len(out), self.n_rows - self.cursor)
            out += perm[self.cursor : self.cursor + take]
            self.cursor += take
            if self.cursor == self.n_rows:
                self.epoch, self.cursor = self.epoch + 1, 0
        return out

    def next_rows(self, rows: Sequence[Any]) -> list[Any]:
        """``[rows[i] for i in next_batch()]``; ``rows`` must have ``n_rows`` items."""
        if len(rows) != self.n_rows:
            raise ValueError(f"BatchSampler was built for {self.n_rows} rows but got {len(rows)}")
        return [rows[i] for i in self.next_batch()]

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int | bool]:
        """Plain ints/bools (JSON-safe): where the sampler is, and the settings that define the stream."""
        return {
            "epoch": self.epoch, "cursor": self.cursor,
            "n_rows": self.n_rows, "batch_size": self.batch_size, "seed": self.seed, "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; refuses a state saved with other settings (its stream would differ)."""
        for key in ("n_rows", "batch_size", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise SamplerStateError(
                    f"sampler state has {key}={state[key]!r} but this sampler has {key}={getattr(self, key)!r}; "
                    "resume with the dataset and settings of the saved run"
                )
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        if epoch < 0 or not 0 <= cursor < self.n_rows:
            raise SamplerStateError(f"sampler state epoch={epoch}, cursor={cursor} is out of range for {self.n_rows} rows")
        self.epoch, self.cursor = epoch, cursor
