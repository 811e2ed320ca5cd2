"""Collectives between ranks on GPUs through NCCL (CuPy's `cupy.cuda.nccl`, which the
`gpu` extra's `nvidia-nccl-cu12` wheel feeds), for `mpiexec -n N netdsl run --distributed
--backend cupy`.

Each rank holds the GPU numbered as its place among the ranks on its machine
(`runtime.options.gpu_of`). Rank 0 makes NCCL's unique id, MPI broadcasts it, and every
rank joins one communicator of all of them; once the ranks have built their steps, one
more for each group of some of them that a collective is over (NCCL's commSplit, in
`prepare`). A collective over every rank, or over such a group in rank order, runs on
NCCL, on a stream of its own: that stream waits for an event recorded on the compute
stream when the collective is reached, and the compute stream waits for the collective's
event only at the first node that reads its result (the executor calls
`Communicator.wait_for`), so the compute queued in between overlaps it. Every buffer the
collective reads or writes is allocated on the compute stream before that event and held
until the compute stream has waited, so CuPy's pool cannot hand one out while NCCL works
on it; distributed steps run without an arena, so no planned slot is reused under it.

What stays on host MPI (`MPIComm`, which this class extends): a collective whose group is
not in rank order (NCCL would concatenate its parts in another order), a dtype NCCL has no
code for, and `send`/`recv`. NCCL pairs point-to-point messages by their order between
two ranks, and a send holds its stream until the peer receives; the graph pairs them by
tag, and a pipeline's ranks may post them in another order, which MPI's tagged,
non-blocking sends tolerate.

Bytes: a collective counts what a ring moves for the buffers handed to NCCL (all-reduce
2(p-1)/p of the value, all-gather and reduce-scatter p-1 parts of the largest part's
size): `comm_bytes`'s figure, with the padding of unequal parts included.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

from netdsl.config import env_switch
from netdsl.errors import CommError, DeviceError, NetdslError
from netdsl.ir.ops.comm import COLLECTIVES
from netdsl.runtime.mpi import MPIComm, allgather

ENV = "NETDSL_NCCL"  # 0: collectives through host MPI even where NCCL loads
NOCOLOR = -1  # NCCL_SPLIT_NOCOLOR: commSplit's color for a rank outside the new group

# numpy dtype name -> the name of NCCL's code in cupy.cuda.nccl (nccl.h's ncclDataType_t)
_DTYPES = {"int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32",
           "uint32": "NCCL_UINT32", "int64": "NCCL_INT64", "uint64": "NCCL_UINT64",
           "float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
           "bfloat16": "NCCL_BFLOAT16"}


def nccl_of(backend):
    """(CuPy's nccl module, "") where this rank can use NCCL, else (None, why not)."""
    if not env_switch(ENV, True):
        return None, f"{ENV}=0"
    try:
        return backend.nccl(), ""
    except DeviceError as e:
        return None, e.message


def communicator(backend, gather=allgather) -> tuple[MPIComm, str | None]:
    """This rank's communicator and the line the run says about it (None: nothing to say).
    NCCL's set-up is collective, so it is used only where every rank can use it: each says
    why it cannot (`gather`: every rank's answer, on every rank), and all fall back if one
    does."""
    if backend.name != "cupy":  # (every rank runs the same backend)
        return MPIComm(backend), None
    nccl, why = nccl_of(backend)
    lacking = [(r, w) for r, w in enumerate(gather(why if nccl is None else "")) if w]
    if lacking:
        r, w = lacking[0]
        return MPIComm(backend), (f"collectives between GPUs go through host MPI (rank {r}: "
                                  f"{w})")
    return NcclComm(backend, nccl), None


@contextmanager
def _said(rank: int, what: str):
    """NCCL's own error (NcclError) as a CommError that says what failed and the way out."""
    try:
        yield
    except Exception as e:
        if isinstance(e, NetdslError):
            raise
        raise CommError(f"rank {rank}: NCCL failed {what} ({type(e).__name__}: {e}); "
                        f"{ENV}=0 runs the collectives through host MPI instead") from None


class NcclComm(MPIComm):
    """MPI for what NCCL does not run (see the module docstring), NCCL for the rest."""

    deferred = True  # results are waited for by their first reader (wait_for)

    def __init__(self, backend, nccl, timeout: float | None = None):
        super().__init__(backend, timeout)
        size = self.c.Get_size()
        uid = self.c.bcast(nccl.get_unique_id() if self.rank == 0 else None, root=0)
        with _said(self.rank, "joining the communicator of all ranks"):
            nc = nccl.NcclCommunicator(size, uid, self.rank)
        cuda = backend.xp.cuda
        self.nccl = NcclCollectives(nccl, nc, self.rank, size, backend.xp,
                                    lambda a: a.data.ptr, cuda.Stream(non_blocking=True),
                                    cuda.get_current_stream, self._count)

    def prepare(self, graph) -> None:
        """A communicator for each group of some of the ranks (in rank order) that any
        rank's step has a collective over; collective: every rank calls it once, after it
        built its step, before the first."""
        world = tuple(range(self.c.Get_size()))
        mine = sorted({tuple(n.attrs["group"]) for n in graph.nodes if n.op in COLLECTIVES})
        groups = sorted({g for part in self.c.allgather(mine) for g in part
                         if g != world and len(g) > 1 and list(g) == sorted(g)})
        with _said(self.rank, f"making the communicators of groups {groups}"):
            self.nccl.split(groups)

    def collective(self, node, inputs):
        if self.nccl.runs(node, inputs[0]):
            return self.nccl.run(node, inputs[0])
        return super().collective(node, inputs)

    def wait_for(self, names) -> None:
        self.nccl.wait_for(names)

    def finish_step(self) -> None:
        self.nccl.wait_all()
        super().finish_step()


class NcclCollectives:
    """The NCCL half of NcclComm, apart from MPI so that tests run it over a stand-in
    `nccl` module: `nc` the NcclCommunicator of all `size` ranks, `xp` the array module,
    `ptr` an array's device address, `stream` NCCL's stream, `current()` the compute
    stream, `count(rank, nbytes)` the byte counter."""

    def __init__(self, nccl, nc, rank: int, size: int, xp, ptr, stream, current, count):
        self.nc, self.rank, self.xp = nc, rank, xp
        self.ptr, self.stream, self.current, self._count = ptr, stream, current, count
        self.codes = {k: getattr(nccl, v) for k, v in _DTYPES.items() if hasattr(nccl, v)}
        self.sum = nccl.NCCL_SUM
        # group (ranks in rank order) -> its communicator: every rank's, and `split`'s
        self.comms: dict[tuple[int, ...], object] = {tuple(range(size)): nc}
        self._inflight: dict[str, tuple] = {}  # node -> (done event, buffers held)

    def split(self, groups) -> None:
        """A communicator for each of `groups` (of two ranks or more, in rank order): every
        rank calls this with the same groups in the same order (NCCL's commSplit is
        collective), and keeps those it is a member of."""
        for g in groups:
            sub = self.nc.commSplit(0 if self.rank in g else NOCOLOR, self.rank)
            if self.rank in g:
                self.comms[tuple(g)] = sub

    def runs(self, node, x) -> bool:
        """Whether NCCL runs this collective: a group with a communicator (every rank, or
        one `split` made) and a dtype NCCL has a code for."""
        return tuple(node.attrs["group"]) in self.comms and str(x.dtype) in self.codes

    def run(self, node, x):
        """Queue the collective on NCCL's stream after what the compute stream has queued;
        its result, which the compute stream must wait for (wait_for) before reading it."""
        x = self.xp.ascontiguousarray(x)
        nc, p = self.comms[tuple(node.attrs["group"])], len(node.attrs["group"])
        if node.op == "all_reduce":
            shape, buffers, queue = x.shape, (), lambda out: self._all_reduce(nc, p, x, out)
        else:
            shape, buffers, queue = self._parts(nc, node, x)
        out = self.xp.empty(shape, x.dtype)  # (on the compute stream, before its event)
        self.stream.wait_event(self.current().record())
        with self.stream:
            queue(out)
        self._inflight[node.name] = (self.stream.record(), [x, out, *buffers])
        return out

    def _all_reduce(self, nc, p: int, x, out) -> None:
        nc.allReduce(self.ptr(x), self.ptr(out), x.size, self.codes[str(x.dtype)], self.sum,
                     self.stream.ptr)
        self._count(self.rank, 2 * (p - 1) * x.nbytes // p)

    def _parts(self, nc, node, x):
        """(result shape, staging buffers, the calls that fill the result) for all_gather
        and reduce_scatter. NCCL takes equal parts laid end to end: parts along another
        axis than the first, or of unequal sizes, are staged at the front, each padded to
        the largest (the padding's sums are never read)."""
        xp, p, me = self.xp, len(node.attrs["group"]), node.attrs["index"]
        ax = node.attrs["axis"] % x.ndim
        gather = node.op == "all_gather"
        sizes = tuple(node.meta["part_sizes"] if gather else node.attrs["sizes"])
        m, rest = max(sizes), x.shape[:ax] + x.shape[ax + 1:]
        cuts = [sum(sizes[:k]) for k in range(p + 1)]
        shape = x.shape[:ax] + ((cuts[-1] if gather else sizes[me]),) + x.shape[ax + 1:]
        count = m * math.prod(rest)

        def call(send, recv):
            code, s = self.codes[str(x.dtype)], self.stream.ptr
            if gather:
                nc.allGather(self.ptr(send), self.ptr(recv), count, code, s)
            else:
                nc.reduceScatter(self.ptr(send), self.ptr(recv), count, code, self.sum, s)
            self._count(self.rank, (p - 1) * count * x.dtype.itemsize)
        if ax == 0 and min(sizes) == m:  # laid out as NCCL takes them: no staging
            return shape, (), lambda out: call(x, out)
        send = xp.empty(((1 if gather else p) * m,) + rest, x.dtype)
        recv = xp.empty(((p if gather else 1) * m,) + rest, x.dtype)

        def queue(out):
            front, into = xp.moveaxis(x, ax, 0), xp.moveaxis(out, ax, 0)
            for k in ((me,) if gather else range(p)):
                j = 0 if gather else k
                xp.copyto(send[j * m:j * m + sizes[k]],
                          front if gather else front[cuts[k]:cuts[k + 1]])
            call(send, recv)
            for k in (range(p) if gather else (me,)):
                j = k if gather else 0
                xp.copyto(into[cuts[k]:cuts[k + 1]] if gather else into,
                          recv[j * m:j * m + sizes[k]])
        return shape, (send, recv), queue

    def wait_for(self, names) -> None:
        """The compute stream waits for the collectives that computed `names` (those still
        in flight), and lets go of their buffers: what it queues next runs after them."""
        for name in names:
            got = self._inflight.pop(name, None)
            if got is not None:
                self.current().wait_event(got[0])

    def wait_all(self) -> None:
        self.wait_for(list(self._inflight))
