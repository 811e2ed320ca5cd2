"""The MPI communicator: one process per device, launched by `mpiexec -n N netdsl run
FILE --distributed` (mpi4py, imported here only; the `mpi` extra brings mpi4py and the
`mpich` wheel, whose `mpiexec` needs no system packages).

Each rank runs its projection of the split graph (`parallel.project`). Sends are
non-blocking from a copy of the value (so the sender goes on, and a pipeline whose stages
send both ways cannot deadlock); they are completed at the end of the step. A receive and
the ring all-reduce wait at most `timeout` seconds (NETDSL_COMM_TIMEOUT, default 60) for
a peer, then raise a CommError that names the rank it waited for: a rank that died or
hangs stops the others with a message instead of a hang. Values travel through host
memory (CuPy arrays are copied to the host first; no CUDA-aware MPI is assumed).

The ring algorithms are the in-process ones (`comm.RING`) seen from one rank: the same
chunks added in the same order, so replicas stay identical bit for bit and the bytes
counted are those sent.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator

import numpy as np

from netdsl.errors import CommError
from netdsl.ir.placement import even_parts
from netdsl.runtime.comm import Communicator
from netdsl.runtime.state_parts import StateParts, gather_order

COLLECTIVE_TAG = 32766  # ring traffic; ordered per pair, collectives run in one order
STATE_TAG = 32765  # the state's pieces on their way to rank 0 (between steps)


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError:
        raise CommError("--distributed needs mpi4py and an MPI library: pip install "
                        "'netdsl[mpi]' (mpi4py and the mpich wheel, which brings mpiexec)"
                        ) from None
    return MPI


def world() -> tuple[int, int]:
    """(rank, size) of this process in MPI_COMM_WORLD."""
    c = _mpi().COMM_WORLD
    return c.Get_rank(), c.Get_size()


def world_on_this_machine() -> tuple[int, int]:
    """(rank, size) among the ranks on this machine (MPI's shared-memory split)."""
    host = _mpi().COMM_WORLD.Split_type(_mpi().COMM_TYPE_SHARED)
    try:
        return host.Get_rank(), host.Get_size()
    finally:
        host.Free()


def abort(code: int) -> None:
    """Stop every rank (after this one has said why)."""
    _mpi().COMM_WORLD.Abort(code)


class MPIComm(Communicator):
    def __init__(self, backend, timeout: float | None = None):
        super().__init__(np)
        self.mpi = _mpi()
        self.c = self.mpi.COMM_WORLD
        self.rank = self.c.Get_rank()
        self.backend = backend
        self.timeout = float(timeout if timeout is not None
                             else os.environ.get("NETDSL_COMM_TIMEOUT", 60))
        self._pending: list = []

    # -- waiting with a deadline ------------------------------------------------------
    def _wait(self, req, peer: int, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        pause = 1e-5
        while not req.Test():
            if time.monotonic() > deadline:
                req.Cancel()
                req.Wait()  # a cancelled request completes at once; this frees it
                raise CommError(f"rank {self.rank}: no answer from rank {peer} in "
                                f"{self.timeout:g} s while {what}; rank {peer} failed, was "
                                "killed or hangs (NETDSL_COMM_TIMEOUT sets the wait)")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def memory_totals(self, color: int, need: int, state: int, read_free):
        """(need, state, free, ranks) over the ranks that share this rank's memory: those
        on this machine (MPI's shared-memory split) with the same `color` (the GPU's number;
        0 for the host). `need` and `state` summed, and the least of what each read with
        `read_free()` once every one of them had allocated its state (a barrier first), so
        that all of them come to the same answer."""
        host = self.c.Split_type(self.mpi.COMM_TYPE_SHARED)
        peers = host.Split(color)
        try:
            peers.Barrier()
            rows = peers.allgather((need, state, read_free()))
        finally:
            peers.Free()
            host.Free()
        frees = [f for _, _, f in rows if f is not None]
        return (sum(r[0] for r in rows), sum(r[1] for r in rows),
                min(frees) if frees else None, len(rows))

    def _host(self, x) -> np.ndarray:
        return np.ascontiguousarray(self.backend.to_host(x))

    def _value(self, a: np.ndarray):
        """Host array `a`, which this rank made, as the node's value: itself on NumPy (a
        copy would hold a pipeline's message twice until MPI lets go of it, above the
        rank's plan), a device copy otherwise."""
        return a if self.backend.xp is np else self.backend.asarray(a)

    # -- point to point -----------------------------------------------------------------
    def send(self, node, x):
        # the message buffer: x's storage may be reused at once, and to_host is a copy
        buf = self._host(x)
        req = self.c.Isend(buf, dest=node.attrs["peer"], tag=node.attrs["tag"])
        self._reap()
        self._pending.append((req, buf, node))
        self._count(self.rank, buf.nbytes)
        return self._value(buf)  # (what MPI reads: no local node writes a send's value)

    def recv(self, node, message, dtype):
        out = np.empty(tuple(node.type.shape), dtype)
        peer = node.attrs["peer"]
        req = self.c.Irecv(out, source=peer, tag=node.attrs["tag"])
        self._wait(req, peer, f"receiving %{node.name}")
        self._reap(node.name)
        return self._value(out)

    def _reap(self, received: str | None = None) -> None:
        """Let go of the buffers of sends that have completed (a pipeline's activations and
        gradients, held to the end of the step, would be above its ranks' plans). The
        sends held to receive `received` (`project.sends_held_to`: the peer had them
        before it sent this) are waited for, which returns at once: the plan lets go of
        them here, and a Test alone may leave MPI's bookkeeping of one for later."""
        keep = []
        for req, buf, n in self._pending:
            if received is not None and n.meta.get("held_to") == received:
                self._wait(req, n.attrs["peer"], f"sending %{n.name}")
            elif not req.Test():
                keep.append((req, buf, n))
        self._pending = keep

    def finish_step(self) -> None:
        for req, _, node in self._pending:
            self._wait(req, node.attrs["peer"], f"sending %{node.name}")
        self._pending.clear()

    # -- collectives --------------------------------------------------------------------
    def collective(self, node, inputs):
        if node.op == "all_gather":
            return self._all_gather(node, self._host(inputs[0]))
        if node.op == "reduce_scatter":
            return self._reduce_scatter(node, self._host(inputs[0]))
        group = list(node.attrs["group"])
        me = node.attrs["index"]
        x = self._host(inputs[0])
        flat = x.reshape(-1).copy()
        p = len(group)
        if p > 1:
            right, left = group[(me + 1) % p], group[(me - 1) % p]
            bounds = even_parts(flat.size, p)
            what = f"all-reducing %{node.name}"
            for s in range(p - 1):  # reduce-scatter, as comm._ring_all_reduce
                lo, hi = bounds[(me - s) % p]
                rlo, rhi = bounds[(me - s - 1) % p]
                got = self._exchange(flat[lo:hi].copy(), right, left, rhi - rlo, flat.dtype,
                                     what)
                flat[rlo:rhi] += got
            for s in range(p - 1):  # all-gather
                lo, hi = bounds[(me + 1 - s) % p]
                rlo, rhi = bounds[(me - s) % p]
                flat[rlo:rhi] = self._exchange(flat[lo:hi].copy(), right, left, rhi - rlo,
                                               flat.dtype, what)
        return self._value(flat.reshape(x.shape))

    def _ring(self, node):
        group = list(node.attrs["group"])
        me, p = node.attrs["index"], len(group)
        return me, p, group[(me + 1) % p], group[(me - 1) % p]

    @staticmethod
    def _part_shape(x, ax: int, size: int) -> tuple[int, ...]:
        return x.shape[:ax] + (size,) + x.shape[ax + 1:]

    def _all_gather(self, node, x):
        """Each rank passes on the part it got last step (comm._ring_all_gather), each
        received into its place in the result (no part held twice)."""
        me, p, right, left = self._ring(node)
        ax = node.attrs["axis"] % x.ndim
        sizes = node.meta["part_sizes"]
        cuts = np.cumsum((0,) + tuple(sizes))
        out = np.empty(self._part_shape(x, ax, int(cuts[-1])), x.dtype)

        def part(k):
            at = [slice(None)] * x.ndim
            at[ax] = slice(int(cuts[k]), int(cuts[k + 1]))
            return out[tuple(at)]
        part(me)[...] = x
        for s in range(p - 1):
            k, want = (me - s) % p, (me - s - 1) % p
            into = part(want)
            got = self._exchange(np.ascontiguousarray(part(k)), right, left, into.shape,
                                 x.dtype, f"gathering %{node.name}",
                                 into if into.flags.c_contiguous else None)
            if got is not into:
                into[...] = got
        return self._value(out)

    def _reduce_scatter(self, node, x):
        """Running sums passed round the ring (comm._ring_reduce_scatter): at step s this
        rank sends its running sum of part (me - s - 1) and adds its own rows of part
        (me - s - 2) to the sum it receives, so it holds two parts at a time."""
        me, p, right, left = self._ring(node)
        ax = node.attrs["axis"] % x.ndim
        cuts = np.cumsum((0,) + tuple(node.attrs["sizes"]))

        def mine(k):  # (a view: np.take would build an index array of 8 bytes an element)
            at = [slice(None)] * x.ndim
            at[ax] = slice(int(cuts[k]), int(cuts[k + 1]))
            return x[tuple(at)]
        acc = np.ascontiguousarray(mine((me - 1) % p))
        for s in range(p - 1):
            want = (me - s - 2) % p
            got = self._exchange(acc, right, left, self._part_shape(
                x, ax, int(cuts[want + 1] - cuts[want])), x.dtype,
                f"reduce-scattering %{node.name}")
            got += mine(want)
            acc = got
        return self._value(acc)

    # -- the state, on rank 0 ------------------------------------------------------------
    def gather_state(self, held: dict[str, StateParts],
                     host: Callable[[str], np.ndarray]) -> Iterator[tuple] | None:
        """Every rank's state (`held`: this rank's StateParts; `host(node)` a state node's
        host array) on rank 0, in the single-device layout, one entry at a time: rank 0
        gets an iterator of (key, array) that it must run to its end; the others send
        their pieces as rank 0 asks for them and get None. A piece travels as raw bytes
        (any dtype) and nothing waits for more than one: rank 0 holds one entry and one
        piece more than its state, a sender one piece."""
        order = gather_order(self.c.allgather({k: sp.describe() for k, sp in held.items()}))
        if self.rank == 0:
            return self._receive_state(order, held, host)
        for key, sp, pieces in order:
            for rank, r in pieces:
                if rank == self.rank and math.prod(sp.piece_shape(r)):
                    buf = np.ascontiguousarray(host(held[key].parts[r]))
                    # no deadline: rank 0 may be writing a large checkpoint before it
                    # asks for this piece (a rank that dies stops them all through mpiexec)
                    self.c.Isend(_raw(buf), dest=0, tag=STATE_TAG).Wait()
        return None

    def _receive_state(self, order, held, host):
        for key, sp, pieces in order:
            got = []
            for rank, r in pieces:
                if rank == 0:
                    got.append((r, host(held[key].parts[r])))
                    continue
                a = np.empty(sp.piece_shape(r), sp.dtype)
                if a.size:
                    self._wait(self.c.Irecv(_raw(a), source=rank, tag=STATE_TAG), rank,
                               f"receiving its part of `{key}`")
                got.append((r, a))
            yield key, (got[0][1] if sp.axis is None else sp.join(got))

    def _exchange(self, out: np.ndarray, right: int, left: int, shape, dtype, what: str,
                  into: np.ndarray | None = None):
        got = np.empty(shape, dtype) if into is None else into
        rreq = self.c.Irecv(got, source=left, tag=COLLECTIVE_TAG)
        sreq = self.c.Isend(out, dest=right, tag=COLLECTIVE_TAG)
        self._count(self.rank, out.nbytes)
        self._wait(rreq, left, what)
        self._wait(sreq, right, what)
        return got


def _raw(a: np.ndarray) -> np.ndarray:
    """A contiguous array's bytes, as MPI sends them whatever the dtype (float16 too)."""
    return a.reshape(-1).view(np.uint8)


def merge_all(d: dict) -> dict:
    """Every rank's dict merged (rank order: a key held by several ranks, such as a
    replica, keeps rank 0's value), on every rank."""
    out: dict = {}
    for part in allgather(d):
        for k, v in part.items():
            out.setdefault(k, v)
    return out


def allgather(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    return _mpi().COMM_WORLD.allgather(obj)


def first_on_any_rank(value):
    """The first rank's non-None `value` (None if every rank's is None), on every rank."""
    return next((v for v in allgather(value) if v is not None), None)


def bcast(obj, root: int = 0):
    return _mpi().COMM_WORLD.bcast(obj, root=root)
