"""A split of a source (`sources`) through a pipeline (`transforms`): the network's inputs
for any samples, read and transformed when a batch asks for them.

`fill` is the one routine that makes batch rows, in the main process (`take`, evaluation,
`--workers 0`) and in the worker processes alike. A sample that cannot be read stops the
run with an error naming it (`bad="stop"`) or is replaced by the next one of the split
that reads, and reported (`bad="skip"`): the replacement is a fixed function of the
sample's index, so a resumed run or another rank replaces it the same way.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from netdsl.errors import NetdslError
from netdsl.runtime.data.sources import BadSample, Source
from netdsl.runtime.data.transforms import Pipeline, ShapeMismatch

# a replacement is looked for this far before the run stops: a folder of bad files is not
# a few corrupt images
MAX_SKIPPED_IN_A_ROW = 64


class DataError(NetdslError):
    """Data that cannot be read (a corrupt image, a worker that died): raised between
    steps, so the trainer can save what it trained before it stops."""


@dataclass
class InputSpec:
    """One network input a split feeds: its sample shape and dtype; `labels`: fed from
    the source's labels, not its samples."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    labels: bool


class SampleSplit:
    """Samples `indices` of `source` (all of them when None), each through `pipeline`."""

    def __init__(self, source: Source, indices: np.ndarray | None, pipeline: Pipeline,
                 specs: list[InputSpec], bad: str = "stop", order=None):
        self.source, self.pipeline, self.specs, self.bad = source, pipeline, specs, bad
        self.indices = (np.arange(len(source), dtype=np.int64) if indices is None
                        else np.asarray(indices, dtype=np.int64))
        self.order = order  # (seed, epoch) -> an epoch's order (tar shards' stream)
        self.skipped: dict[int, str] = {}  # sample -> why, in this process

    def __len__(self) -> int:
        return len(self.indices)

    def head(self, n: int) -> SampleSplit:
        part = SampleSplit(self.source, self.indices[:n], self.pipeline, self.specs, self.bad)
        part.skipped = self.skipped
        return part

    def epoch_order(self, seed: int, epoch: int) -> np.ndarray | None:
        return None if self.order is None else self.order(seed, epoch)

    def empty_batch(self, n: int, wanted: list[bool] | None) -> list[np.ndarray | None]:
        return [np.empty((n,) + s.shape, dtype=s.dtype)
                if wanted is None or wanted[k] else None for k, s in enumerate(self.specs)]

    def take(self, idx, wanted: list[bool] | None = None, epoch: int = 0,
             rows: tuple[int, int] | None = None) -> list[np.ndarray | None]:
        """The inputs of positions `idx` of the split (an index array or a slice), in
        this process; `rows`: only those rows of the samples are read (the labels are
        all given: they cost nothing to read)."""
        pos = np.arange(len(self))[idx] if isinstance(idx, slice) else np.asarray(idx)
        out = self.empty_batch(len(pos), wanted)
        lo, hi = rows or (0, len(pos))
        self.fill(out, pos, epoch, lo, hi)
        return out

    def fill(self, out: list, pos: np.ndarray, epoch: int, lo: int, hi: int) -> dict:
        """Rows [lo, hi) of batch `out` from split positions `pos` (every row's label);
        returns the samples skipped, {sample: why}."""
        samples = self.indices[pos]
        for k, spec in enumerate(self.specs):
            if out[k] is not None and spec.labels:
                out[k][...] = self.source.labels[samples].reshape(out[k].shape)
        images = [(k, a) for k, a in enumerate(out)
                  if a is not None and not self.specs[k].labels]
        skipped = {}
        if not images:
            return skipped
        for r in range(lo, hi):
            q, img = self._readable(int(pos[r]), skipped)
            if q != int(pos[r]):  # (a replacement: its own label too)
                for k, spec in enumerate(self.specs):
                    if out[k] is not None and spec.labels:
                        out[k][r] = self.source.labels[self.indices[q]]
            for k, a in images:
                self._write(img, a[r], epoch, int(self.indices[q]), self.specs[k])
        self.skipped.update(skipped)
        return skipped

    def _readable(self, p: int, skipped: dict) -> tuple[int, object]:
        """Position p's sample, read, or with bad="skip" the next that reads: (position,
        the sample)."""
        for step in range(MAX_SKIPPED_IN_A_ROW):
            q = (p + step) % len(self)
            i = int(self.indices[q])
            try:
                return q, self.source.read(i)
            except BadSample as e:
                if self.bad == "stop":
                    raise DataError(f"bad data: {e} (the run stops on a bad sample: "
                                    "--bad-images skip skips and counts them)") from None
                skipped[i] = str(e)
        raise DataError(f"bad data: {MAX_SKIPPED_IN_A_ROW} samples in a row cannot be read, "
                        f"from {self.source.where(int(self.indices[p]))}; the last: "
                        f"{skipped[i]}")

    def _write(self, img, row: np.ndarray, epoch: int, sample: int, spec: InputSpec) -> None:
        try:
            self.pipeline.into(img, row, epoch, sample)
        except ShapeMismatch as e:
            raise NetdslError(
                f"input `{spec.name}` takes samples shaped {list(e.want)}, but "
                f"{self.source.where(sample)} comes out of the transforms shaped "
                f"{list(e.got)}; declare transforms that make that shape (e.g. "
                f"train_transforms = [random_resized_crop({e.want[-1]}), flip()] and "
                f"eval_transforms = [resize({e.want[-1]}), center_crop({e.want[-1]})])"
            ) from None
