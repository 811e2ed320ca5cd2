"""The data worker processes: each reads and transforms its rows of a batch straight into
a shared-memory slot (`SampleSplit.fill`; no array is pickled), then says so on the
results queue.

A slot is one `multiprocessing.shared_memory` block holding a batch's arrays one after
the other (`Layout`); the main process makes and unlinks the blocks, workers only attach.
Workers ignore Ctrl-C (the main process stops them, after its step) and report every
failure as a message, never as a traceback.
"""
from __future__ import annotations

import os
import queue
import signal
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from netdsl.errors import NetdslError


@dataclass(frozen=True)
class Layout:
    """Where each array of a batch lies in a slot: (offset, shape, dtype) per input, None
    for an input not loaded."""

    parts: tuple

    @staticmethod
    def of(specs, batch: int, wanted: list[bool] | None) -> Layout:
        parts, at = [], 0
        for k, s in enumerate(specs):
            if wanted is not None and not wanted[k]:
                parts.append(None)
                continue
            parts.append((at, (batch,) + tuple(s.shape), s.dtype.str))
            nbytes = batch * int(np.prod(s.shape, dtype=np.int64)) * s.dtype.itemsize
            at += -(-nbytes // 64) * 64  # (each array 64-byte aligned)
        return Layout(tuple(parts))

    @property
    def nbytes(self) -> int:
        ends = [off + int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
                for off, shape, dt in (p for p in self.parts if p is not None)]
        return max(ends, default=0)

    def arrays(self, buf) -> list[np.ndarray | None]:
        return [None if p is None else np.ndarray(p[1], dtype=np.dtype(p[2]), buffer=buf,
                                                   offset=p[0])
                for p in self.parts]


def attach(name: str) -> shared_memory.SharedMemory:
    """A block the main process made, attached without registering it with the resource
    tracker: the main process owns it and unlinks it (Python before 3.13 registers every
    attach, and the tracker then unlinks or warns about blocks still in use, bpo-39959)."""
    try:
        return shared_memory.SharedMemory(name=name, track=False)  # (3.13)
    except TypeError:
        from multiprocessing import resource_tracker
        register = resource_tracker.register
        resource_tracker.register = lambda *a, **k: None
        try:
            return shared_memory.SharedMemory(name=name)
        finally:
            resource_tracker.register = register


def work(wid: int, split, slots: list[str], layout: Layout, jobs, results,
         parent: int) -> None:
    """A worker's life: take (job, slot, epoch, positions, lo, hi) jobs until None, fill
    rows [lo, hi) of that slot, and answer (job, worker, skipped or an error message).
    A worker whose main process is gone (killed: nothing told it to stop) ends itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the main process stops the run)
    blocks = [attach(n) for n in slots]
    views = [layout.arrays(b.buf) for b in blocks]
    try:
        while True:
            try:
                job = jobs.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:
                    return
                continue
            if job is None:
                return
            jid, slot, epoch, pos, lo, hi = job
            try:
                skipped = split.fill(views[slot], pos, epoch, lo, hi)
                results.put((jid, wid, skipped, None))
            except NetdslError as e:
                results.put((jid, wid, None, e.message))
            except Exception as e:  # (a bug, said in one line: never a worker traceback)
                results.put((jid, wid, None, f"data worker {wid} failed: "
                             f"{type(e).__name__}: {e}"))
    finally:
        del views
        for b in blocks:
            try:
                b.close()
            except BufferError:  # (a view still held: the process ends all the same)
                b.close = lambda: None
