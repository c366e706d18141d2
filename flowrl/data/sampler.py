"""Deterministic, resumable samplers of dataset rows: a split held whole, a streamed one, a mixture.

:class:`BatchSampler` draws indices of rows held in memory; :class:`StreamSampler` reads a
:class:`~flowrl.data.sources.RowSource` block by block; :class:`MixSampler` draws from other
samplers with weights. Each has ``take(n)`` and a JSON-safe ``state_dict`` (a checkpoint's).

The batch sampler over rows held whole:

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
from array import array
from typing import Any, Callable, Iterator, Sequence


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
        return self.take(self.batch_size)

    def take(self, n: int) -> list[int]:
        """The next ``n`` row indices (a mixture takes a varying number from each of its parts)."""
        out: list[int] = []
        while len(out) < n:
            perm = self._permutation(self.epoch)
            take = min(n - len(out), self.n_rows - self.cursor)
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
        if "cursor" not in state:
            raise SamplerStateError("sampler state has no 'cursor': it was saved by a streamed sampler (`stream`); "
                                    "resume with the dataset settings of the saved run")
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        if epoch < 0 or not 0 <= cursor < self.n_rows:
            raise SamplerStateError(f"sampler state epoch={epoch}, cursor={cursor} is out of range for {self.n_rows} rows")
        self.epoch, self.cursor = epoch, cursor


class RowsSampler:
    """Rows held whole, drawn by a :class:`BatchSampler` (whose state is this sampler's)."""

    def __init__(self, rows: Sequence[Any], batch_size: int, *, seed: int = 0) -> None:
        self.rows = rows
        self.sampler = BatchSampler(len(rows), batch_size, seed=seed)

    def take(self, n: int) -> list[Any]:
        return [self.rows[i] for i in self.sampler.take(n)]

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


class ListWindow:
    """A window of rows as a source's ``read`` gives them: ``(where, row)`` pairs in a list."""

    def __init__(self, source: Any, blocks: list) -> None:
        self.rows = [pair for b in blocks for pair in source.read(b)]

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, i: int) -> tuple[str, Any]:
        return self.rows[i]


class StreamSampler:
    """Rows read from a source block by block, shuffled within a window, never held whole.

    Epoch ``e`` visits the source's blocks in a permutation seeded by ``(seed, e)``; consecutive
    ``window`` blocks of it are read together and their rows shuffled (seeded by ``(seed, e, window
    index)``). Only the current window is held: as the source keeps it (a JSON-lines source, its
    bytes and an offset per row: :meth:`flowrl.data.sources.JsonlFiles.window`; others, a list); a
    row is parsed and checked (``prepare``) when it is drawn. Every row is drawn once per epoch, as
    with :class:`BatchSampler`; a batch running past an epoch's end goes on into the next. The state
    is ``(epoch, window, taken)`` (``taken``: rows of the window passed, bad ones included): a resumed
    sampler re-reads its window and skips those, so it continues with the rows the original would
    have drawn.

    ``prepare(where, row)``: the training row, None for a row left out (``bad_rows = "skip"``), or it
    raises (a bad row under ``bad_rows = "error"``).
    """

    def __init__(self, source: Any, prepare: Callable[[str, Any], Any], *, seed: int = 0, window: int = 64,
                 shuffle: bool = True) -> None:
        self.source, self.prepare, self.seed, self.window_blocks, self.shuffle = source, prepare, seed, window, shuffle
        self.blocks = source.blocks()
        if not self.blocks:
            raise ValueError(f"{source.name}: the dataset is empty; hint: a training run needs at least one row")
        self.epoch = self.window = self.taken = 0
        self._rows: Any = None
        self._perm: Any = None
        self._order_epoch, self._order = -1, []
        self.rows_read = 0
        """Rows read from the source so far (re-reads on resume included)."""

    @property
    def held(self) -> int:
        """Rows held now (the current window's)."""
        return len(self._rows) if self._rows is not None else 0

    @property
    def windows(self) -> int:
        return -(-len(self.blocks) // self.window_blocks)

    def _block_order(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            order = list(range(len(self.blocks)))
            if self.shuffle:
                random.Random(f"flowrl.stream:{self.seed}:{epoch}").shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def _load(self) -> None:
        order = self._block_order(self.epoch)
        blocks = [self.blocks[b] for b in order[self.window * self.window_blocks:(self.window + 1) * self.window_blocks]]
        make = getattr(self.source, "window", None)
        self._rows = make(blocks) if make is not None else ListWindow(self.source, blocks)
        self.rows_read += len(self._rows)
        self._perm = array("L", range(len(self._rows)))  # 8 bytes a row, not a list of ints
        if self.shuffle:
            random.Random(f"flowrl.stream:{self.seed}:{self.epoch}:{self.window}").shuffle(self._perm)

    def _advance(self) -> None:
        self._rows, self._perm, self.taken = None, None, 0
        self.window += 1
        if self.window == self.windows:
            self.epoch, self.window = self.epoch + 1, 0

    def take(self, n: int) -> list[Any]:
        out: list[Any] = []
        barren = 0  # windows in a row without a good row: a whole epoch of them is a dataset with none
        while len(out) < n:
            if self._rows is None:
                self._load()
            found = False
            while self.taken < len(self._rows) and len(out) < n:
                where, raw = self._rows.get(self._perm[self.taken])
                self.taken += 1
                row = self.prepare(where, raw)
                if row is not None:
                    out.append(row)
                    found = True
            if self.taken >= len(self._rows):
                barren = 0 if found else barren + 1
                if barren > self.windows:
                    raise ValueError(f"{self.source.name}: no good row in the whole dataset; hint: a training "
                                     "run needs at least one row")
                self._advance()
        return out

    def __iter__(self) -> Iterator[Any]:
        while True:
            yield from self.take(1)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "window": self.window, "taken": self.taken, "blocks": len(self.blocks),
                "window_blocks": self.window_blocks, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("blocks", len(self.blocks)), ("window_blocks", self.window_blocks), ("seed", self.seed),
                          ("shuffle", self.shuffle)):
            if key not in state:
                raise SamplerStateError(f"sampler state has no {key!r}: it was saved by a sampler of rows held "
                                        "whole; resume with the dataset settings of the saved run")
            if state[key] != mine:
                raise SamplerStateError(f"streamed sampler state has {key}={state[key]!r} but this one has {key}="
                                        f"{mine!r} (the file changed, or `window`, or the seed); resume with the data "
                                        "and settings of the saved run")
        epoch, window, taken = int(state["epoch"]), int(state["window"]), int(state["taken"])
        if epoch < 0 or not 0 <= window < self.windows or taken < 0:
            raise SamplerStateError(f"streamed sampler state epoch={epoch}, window={window}, taken={taken} is out "
                                    f"of range for {self.windows} windows")
        self.epoch, self.window = epoch, window
        self._load()
        self.taken = min(taken, len(self._rows))
        if self.taken >= len(self._rows):
            self._advance()


class MixSampler:
    """Rows drawn from several samplers: each row's source is picked with probability weight / sum.

    Draw ``k`` (the k-th call of :meth:`take`) picks its sources with a generator seeded by
    ``(seed, k)``, then takes that many rows from each part in one call and interleaves them in
    the picked order; so the rows depend only on the seed and the parts' states, and the state is
    ``k`` plus the parts' states.
    """

    def __init__(self, parts: list[Any], weights: Sequence[float], *, seed: int = 0) -> None:
        if len(parts) != len(weights) or not parts:
            raise ValueError(f"MixSampler: {len(parts)} parts and {len(weights)} weights; one weight per part")
        if any(w < 0 for w in weights) or not any(w > 0 for w in weights):
            raise ValueError(f"MixSampler: weights {list(weights)}; each >= 0, one at least > 0")
        self.parts, self.weights, self.seed = parts, [float(w) for w in weights], seed
        self.draws = 0

    def take(self, n: int) -> list[Any]:
        picks = random.Random(f"flowrl.mix:{self.seed}:{self.draws}").choices(range(len(self.parts)),
                                                                            weights=self.weights, k=n)
        self.draws += 1
        got = {i: iter(self.parts[i].take(picks.count(i))) for i in sorted(set(picks))}
        return [next(got[i]) for i in picks]

    def state_dict(self) -> dict:
        return {"draws": self.draws, "weights": self.weights, "seed": self.seed,
                "parts": [p.state_dict() for p in self.parts]}

    def load_state_dict(self, state: dict) -> None:
        if [float(w) for w in state.get("weights", ())] != self.weights or state.get("seed") != self.seed \
                or len(state.get("parts", ())) != len(self.parts):
            raise SamplerStateError(f"mixture sampler state has weights {state.get('weights')} and seed "
                                    f"{state.get('seed')}; this mixture has {self.weights} and {self.seed}; resume "
                                    "with the settings of the saved run")
        for part, saved in zip(self.parts, state["parts"]):
            part.load_state_dict(saved)
        self.draws = int(state["draws"])
