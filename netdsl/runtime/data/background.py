"""Loading in the background: `BackgroundLoader` keeps `prefetch` batches ahead of the
step, each made by K worker processes (`workers.work`) into a shared-memory slot, its rows
shared out among them. Its order and state are `sampler.Loader`'s, so a checkpoint
restores it exactly, and a batch is the same whatever K is (every sample's augmentation
is a function of (seed, epoch, index)).

It never hangs: a worker that dies is found within a second and named with the samples it
was making; a batch that does not come within `timeout` seconds stops the run. `close()`
stops the workers and unlinks the slots (also at exit, and after Ctrl-C).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
import weakref
from collections import deque
from multiprocessing import shared_memory

import numpy as np

from netdsl.errors import NetdslError
from netdsl.runtime.data.sampler import Loader
from netdsl.runtime.data.samples import DataError
from netdsl.runtime.data.workers import Layout, work
from netdsl.sizes import format_bytes

# how long a batch may take before the run stops (NETDSL_DATA_TIMEOUT, seconds)
DEFAULT_TIMEOUT_S = 300.0
_POLL_S = 0.5


def default_workers(ranks_here: int = 1) -> int:
    """--workers' default: the cores this process may use, shared among the ranks on the
    machine, at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(8, cores // max(ranks_here, 1)))


class BackgroundLoader(Loader):
    """`Loader`'s batches, made ahead by `workers` processes. `rows` (lo, hi): only those
    rows of each batch's samples are read (an MPI rank's part of a data split; the
    labels are always whole)."""

    def __init__(self, split, batch: int, seed: int, workers: int, prefetch: int = 2,
                 timeout: float | None = None):
        super().__init__(split, batch, seed)
        self.workers, self.prefetch = workers, prefetch
        # the batches are asked for ahead by a cursor of their own: (epoch, pos) are those
        # of the batches handed out, what a checkpoint must restore
        self._cursor = Loader(split, batch, seed)
        self.timeout = timeout or float(os.environ.get("NETDSL_DATA_TIMEOUT",
                                                       DEFAULT_TIMEOUT_S))
        self._ahead: deque = deque()  # batches asked for: (job, slot, state after, positions)
        self._done: dict[int, int] = {}  # job -> workers that have answered
        self._jobs_of: dict[int, set] = {}  # worker -> jobs it holds
        self._next_job = 0
        self._in_use = None  # the slot of the batch last handed out
        self._procs: list = []
        self._blocks: list = []
        self._finalizer = None
        self._unpin: list = []  # (a GPU run) the slots' page locks, undone at close
        self._device: list = [None, None]  # two sets of device buffers, used in turn
        self._sent: tuple | None = None  # (job, device arrays) of the batch on its way
        self._backend = None  # (the GPU's, once a batch is sent to it)
        self._failed: DataError | None = None  # a failure found while sending, said next

    # -- start and stop ----------------------------------------------------------------
    def _start(self) -> None:
        self.layout = Layout.of(self.split.specs, self.batch, self.wanted)
        slots = self.prefetch + 1
        need = self.layout.nbytes * slots
        _check_shared_memory(need, slots)
        self._blocks = [shared_memory.SharedMemory(create=True, size=max(self.layout.nbytes, 1))
                        for _ in range(slots)]
        self._views = [self.layout.arrays(b.buf) for b in self._blocks]
        self._free = list(range(slots))
        # forked, as PyTorch's DataLoader on Linux: a worker starts at once with the
        # split it was given (spawn and forkserver pickle it and run the user's main
        # module again, which a script without `if __name__ == "__main__"` cannot take);
        # a worker runs NumPy and Pillow only, never the threads the step uses
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        self._results = ctx.Queue()
        self._queues = [ctx.Queue() for _ in range(self.workers)]
        names = [b.name for b in self._blocks]
        # the workers start with SIGINT ignored from their first instruction: a Ctrl-C
        # while they start is the main process's alone
        old = signal.signal(signal.SIGINT, signal.SIG_IGN) if _main_thread() else None
        try:
            for w in range(self.workers):
                p = ctx.Process(target=work, args=(w, self.split, names, self.layout,
                                                   self._queues[w], self._results,
                                                   os.getpid()),
                                daemon=True, name=f"netdsl-data-{w}")
                p.start()
                self._procs.append(p)
        finally:
            if old is not None:
                signal.signal(signal.SIGINT, old)
        self._jobs_of = {w: set() for w in range(self.workers)}
        self._finalizer = weakref.finalize(self, _shut, self._procs, self._queues,
                                           self._blocks)

    def close(self) -> None:
        if self._unpin:  # (a copy still in flight reads the slot it unlocks)
            self._backend.synchronize()
        for unpin in self._unpin:
            unpin()
        self._unpin = []
        if self._finalizer is not None:
            self._views = []
            self._finalizer()

    def send_ahead(self, backend) -> None:
        """On a GPU, once the step is queued: wait for the next batch and start its copy
        from the (page-locked) slot to the device, so that it runs while the step does.
        The device buffers are two sets used in turn: the step that read a set has
        finished (the trainer read its loss) before the set is written again."""
        if backend.name == "numpy" or not self._procs or not self._reads_samples():
            return
        if not self._unpin:
            self._backend = backend
            self._unpin = [backend.pin_host(np.frombuffer(b.buf, np.uint8))
                           for b in self._blocks]
        self._top_up()
        job, slot, _, pos = self._ahead[0]
        try:
            self._wait_for(job, pos)
        except DataError as e:  # (said by `next`: the step queued now is still counted)
            self._failed = e
            return
        k = job % 2
        if self._device[k] is None:
            self._device[k] = [None if a is None else backend.xp.empty(a.shape, a.dtype)
                               for a in self._views[slot]]
        for host, dev in zip(self._views[slot], self._device[k]):
            if host is not None:
                backend.upload(host, dev)
        self._sent = (job, self._device[k])

    def restore(self, state: dict) -> None:
        if self._ahead:
            raise NetdslError("internal: the loader was restored after it started")
        super().restore(state)
        self._cursor.restore(state)

    def only(self, wanted: list[bool] | None, rows: tuple[int, int] | None) -> None:
        if self._procs:
            raise NetdslError("internal: the loader's inputs were set after it started")
        super().only(wanted, rows)

    # -- batches -------------------------------------------------------------------------
    def _ask(self) -> None:
        """Send the next batch in order to the workers, its rows shared out among them."""
        slot = self._free.pop()
        epoch, pos = self._cursor.advance()
        job, self._next_job = self._next_job, self._next_job + 1
        lo, hi = self.rows or (0, self.batch)
        cuts = np.linspace(lo, hi, self.workers + 1).astype(int)
        self._done[job] = 0
        for w in range(self.workers):
            self._jobs_of[w].add(job)
            self._queues[w].put((job, slot, epoch, pos, int(cuts[w]), int(cuts[w + 1])))
        self._ahead.append((job, slot, self._cursor.state(), pos))

    def _reads_samples(self) -> bool:
        """Whether this process reads any sample (not only labels) of a batch: an MPI rank
        whose part of the step reads no input loads nothing in the background."""
        lo, hi = self.rows or (0, self.batch)
        return hi > lo and any(not s.labels and (self.wanted is None or self.wanted[k])
                               for k, s in enumerate(self.split.specs))

    def next(self, wanted: list[bool] | None = None) -> list[np.ndarray | None]:
        if self._failed is not None:
            raise self._failed
        if not self._reads_samples():
            return Loader.next(self, wanted)
        t0 = time.perf_counter()
        if not self._procs:
            self._start()
        if self._in_use is not None:  # (the step that read it has finished)
            self._free.append(self._in_use)
            self._in_use = None
        self._top_up()
        job, slot, after, pos = self._ahead.popleft()
        self._wait_for(job, pos)
        self.epoch, self.pos = after["epoch"], after["pos"]
        self._in_use = slot
        sent = self._sent if self._sent is not None and self._sent[0] == job else None
        self.device_batch = None if sent is None else [
            a if wanted is None or wanted[k] else None for k, a in enumerate(sent[1])]
        self.wait_s = time.perf_counter() - t0
        return [a if wanted is None or wanted[k] else None
                for k, a in enumerate(self._views[slot])]

    def _top_up(self) -> None:
        while len(self._ahead) < self.prefetch + 1 and self._free:
            self._ask()

    def _wait_for(self, job: int, pos: np.ndarray) -> None:
        """Until every worker has made its rows of `job` (at once if they have): a
        worker's error, its death or the timeout stop the run, naming the samples."""
        if job not in self._done:
            return
        start = time.monotonic()
        while self._done[job] < self.workers:
            try:
                jid, wid, skipped, error = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                self._check_alive(job, pos)
                if time.monotonic() - start > self.timeout:
                    self.close()
                    raise DataError(
                        f"the data workers made no batch in {self.timeout:.0f} s (batch "
                        f"of samples {_some(self.split, pos)}); a file may be on a disk "
                        "that stopped answering. NETDSL_DATA_TIMEOUT sets the limit") from None
                continue
            if error is not None:
                self.close()
                raise DataError(error)
            self._jobs_of[wid].discard(jid)
            self._done[jid] += 1
            self.skipped.update(skipped)
        del self._done[job]

    def _check_alive(self, job: int, pos: np.ndarray) -> None:
        for w, p in enumerate(self._procs):
            if p.exitcode is not None and self._jobs_of[w]:
                code = p.exitcode
                how = (f"was killed by {signal.Signals(-code).name}" if code < 0
                       else f"exited with code {code}")
                self.close()
                hint = (" (the kernel's OOM killer sends SIGKILL: fewer --workers or a "
                        "smaller batch need less memory)" if code == -signal.SIGKILL else "")
                raise DataError(f"data worker {w} (pid {p.pid}) {how} while making a batch "
                                f"of samples {_some(self.split, pos)}{hint}")


def _some(split, pos: np.ndarray) -> str:
    """A batch's first samples, by file where the source names them."""
    names = [split.source.where(int(split.indices[p])) for p in pos[:3]]
    more = f" and {len(pos) - 3} more" if len(pos) > 3 else ""
    return ", ".join(names) + more


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


def _check_shared_memory(need: int, slots: int) -> None:
    """Shared memory lives in /dev/shm, which a container may make small (Docker's 64 MB):
    a worker writing past it would die of SIGBUS."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise NetdslError(f"the background loader needs {format_bytes(need)} of shared memory "
                          f"({slots} batches) but /dev/shm has {format_bytes(free)} free; "
                          "lower --batch, give --workers 0 (load in this process), or "
                          "enlarge /dev/shm (docker run --shm-size)")


def _shut(procs, queues, blocks) -> None:
    """Stop the workers (asked, then terminated, then killed) and unlink the slots."""
    for q in queues:
        try:
            q.put(None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 1.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(1.0)
        if p.is_alive():
            p.kill()
            p.join()
    for b in blocks:
        try:
            b.close()
        except BufferError:  # an array still views it: mapped while it lives, unlinked now
            b.close = lambda: None  # (and its __del__ says nothing of it)
        try:
            b.unlink()
        except FileNotFoundError:
            pass
