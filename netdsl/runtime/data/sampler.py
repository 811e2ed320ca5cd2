"""Which samples make each batch: `Loader`, the epoch-based, seeded order of a split."""
from __future__ import annotations

import time

import numpy as np

from netdsl.errors import NetdslError


class Loader:
    """Shuffled mini-batches, reshuffled every epoch from (seed, epoch): the state is just
    (epoch, position), so a checkpoint can restore it exactly. The last partial batch of
    an epoch is dropped (the graph has a fixed batch size). A split with an order of its
    own (tar shards' stream, `epoch_order`) is read in that order."""

    def __init__(self, split, batch: int, seed: int, shuffle: bool = True):
        if len(split) < batch:
            raise NetdslError(f"the data has {len(split)} training samples, fewer than one "
                              f"batch of {batch}; lower --batch")
        self.split, self.batch, self.seed, self.shuffle = split, batch, seed, shuffle
        self.epoch, self.pos = 0, 0
        self._perm = self._permutation()
        self.wanted: list[bool] | None = None
        self.rows: tuple[int, int] | None = None
        self.wait_s = 0.0  # how long the last `next` took to give its batch
        self.skipped: dict[int, str] = {}  # samples replaced (--bad-images skip): why
        # the last batch's arrays already on the device (a GPU run's background loader),
        # else None: the host arrays `next` gave are fed
        self.device_batch: list | None = None

    def only(self, wanted: list[bool] | None, rows: tuple[int, int] | None) -> None:
        """Read only the inputs `wanted` and the rows [lo, hi) of the samples (an MPI
        rank's part of the step), from the next batch on."""
        self.wanted, self.rows = wanted, rows

    @property
    def batches_per_epoch(self) -> int:
        return len(self.split) // self.batch

    def _permutation(self):
        n = len(self.split)
        if not self.shuffle:
            return np.arange(n)
        own = getattr(self.split, "epoch_order", None)
        order = own(self.seed, self.epoch) if own is not None else None
        if order is not None:
            return order
        return np.random.default_rng((self.seed, self.epoch)).permutation(n)

    def advance(self) -> tuple[int, np.ndarray]:
        """The next batch's (epoch, positions in the split), and the position moved on."""
        if self.pos + self.batch > len(self.split):
            self.epoch, self.pos = self.epoch + 1, 0
            self._perm = self._permutation()
        idx = self._perm[self.pos:self.pos + self.batch]
        self.pos += self.batch
        return self.epoch, idx

    def next(self, wanted: list[bool] | None = None) -> list[np.ndarray | None]:
        t0 = time.perf_counter()
        wanted = self.wanted if wanted is None else wanted
        epoch, idx = self.advance()
        out = self.split.take(idx, wanted, epoch=epoch, rows=self.rows)
        self.skipped.update(getattr(self.split, "skipped", {}))
        self.wait_s = time.perf_counter() - t0
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def restore(self, state: dict) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._perm = self._permutation()

    def send_ahead(self, backend) -> None:
        """(A background loader starts the next batch's copy to a GPU here.)"""

    def close(self) -> None:
        """(Nothing runs in the background here; see `background.BackgroundLoader`.)"""
