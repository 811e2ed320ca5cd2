"""NCCL between ranks (netdsl.runtime.nccl) without a GPU: the collectives queued on a
stand-in `nccl` module with the real signatures (tests/_fake_nccl.py), p ranks in one
process, against NumPy; the events that order NCCL's stream with the compute stream; the
bytes counted; which collectives NCCL runs and which stay on host MPI; and the executor's
wait before the first reader of a collective still in flight. The single-rank test on a
real GPU is test_gpu.py's."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import _fake_nccl as fake
import numpy as np
import pytest
from test_split import comm_graph

from netdsl.errors import DeviceError
from netdsl.ir.ops.comm import comm_bytes
from netdsl.runtime import nccl as nccl_mod
from netdsl.runtime.comm import InProcess
from netdsl.runtime.executor import Executor
from netdsl.runtime.mpi import MPIComm
from netdsl.runtime.nccl import NcclCollectives, communicator


class Stream:
    """A CUDA stream as the communicator uses it, logging what is queued on it."""

    def __init__(self, name, log):
        self.name, self.log, self.ptr = name, log, 0x1000 + len(name)
        self.events = 0

    def record(self):
        self.events += 1
        ev = f"{self.name}:{self.events}"
        self.log.append(("record", self.name, ev))
        return ev

    def wait_event(self, ev):
        self.log.append(("wait", self.name, ev))

    def __enter__(self):
        self.log.append(("enter", self.name))

    def __exit__(self, *exc):
        self.log.append(("exit", self.name))


XP = SimpleNamespace(ascontiguousarray=np.ascontiguousarray, empty=np.empty,
                     moveaxis=np.moveaxis, copyto=np.copyto)


def ranks(p: int):
    """p ranks' NcclCollectives on one fake communicator, their logs and byte counts."""
    uid = fake.get_unique_id()
    out = []
    for r in range(p):
        log, sent = [], {}
        compute = Stream("compute", log)
        col = NcclCollectives(fake, fake.NcclCommunicator(p, uid, r), r, p, XP,
                              lambda a: a.ctypes.data, Stream("nccl", log), lambda c=compute: c,
                              lambda d, n, s=sent: s.__setitem__(d, s.get(d, 0) + n))
        out.append((col, log, sent))
    return out


def member(op, p, r, **attrs):
    return SimpleNamespace(name=f"{op}{r}", op=op, attrs={"group": tuple(range(p)),
                           "index": r, **attrs}, meta=attrs.pop("meta", {}))


CASES = {  # (op, attrs, each rank's input shape)
    "all_reduce": ("all_reduce", {}, lambda r, p: (5, 3)),
    "gather rows": ("all_gather", {"axis": 0}, lambda r, p: (2, 3)),
    "gather uneven columns": ("all_gather", {"axis": 1}, lambda r, p: (4, r + 1)),
    "scatter rows": ("reduce_scatter", {"axis": 0}, lambda r, p: (2 * p, 3)),
    "scatter uneven columns": ("reduce_scatter", {"axis": -1}, lambda r, p: (2, 3, p + 2)),
}


def _expected(op, attrs, xs, p, sizes):
    if op == "all_reduce":
        return [sum(xs)] * p
    ax = attrs["axis"] % xs[0].ndim
    if op == "all_gather":
        return [np.concatenate(xs, axis=ax)] * p
    return np.split(sum(xs), np.cumsum(sizes)[:-1], axis=ax)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_collectives_match_numpy_and_count_the_ring_bytes(case, p, dtype):
    op, attrs, shape = CASES[case]
    rng = np.random.default_rng(p)
    xs = [rng.standard_normal(shape(r, p)).astype(dtype) for r in range(p)]
    ax = attrs.get("axis", 0) % xs[0].ndim
    if op == "all_gather":
        sizes = [x.shape[ax] for x in xs]
        attrs = {**attrs, "meta": {"part_sizes": tuple(sizes)}}
    elif op == "reduce_scatter":
        n = xs[0].shape[ax]
        sizes = [n // p + (k < n % p) for k in range(p)]
        attrs = {**attrs, "sizes": tuple(sizes)}
    else:
        sizes = None
    world = ranks(p)
    with ThreadPoolExecutor(p) as pool:  # (one thread a rank: a collective waits for all)
        outs = list(pool.map(lambda r: world[r][0].run(member(op, p, r, **dict(attrs)),
                                                       xs[r]), range(p)))
    for got, want in zip(outs, _expected(op, attrs, xs, p, sizes), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    for r, (_, _, sent) in enumerate(world):
        node = member(op, p, r, **dict(attrs))
        if op == "all_reduce" or min(sizes) == max(sizes):  # the ring's lower bound
            assert sent.get(r, 0) == comm_bytes(node, xs[r].nbytes)
        else:  # p - 1 parts of the largest part's size
            row = xs[r].nbytes // xs[r].shape[ax]
            assert sent[r] == (p - 1) * max(sizes) * row


def test_the_collective_runs_after_the_compute_and_before_its_reader():
    (col, log, _), = ranks(1)
    x = np.ones((4, 2), np.float32)
    out = col.run(member("all_reduce", 1, 0), x)
    call = col.nc.calls[-1]
    assert call[0] == "allReduce" and call[1] == x.ctypes.data and call[2] == out.ctypes.data
    assert call[3] == 8 and call[4] == fake.NCCL_FLOAT32 and call[6] == col.stream.ptr
    assert log == [("record", "compute", "compute:1"), ("wait", "nccl", "compute:1"),
                   ("enter", "nccl"), ("exit", "nccl"), ("record", "nccl", "nccl:1")]
    col.wait_for(["all_reduce0", "unrelated"])
    col.wait_for(["all_reduce0"])  # (once: the buffers were let go of)
    assert log[5:] == [("wait", "compute", "nccl:1")] and not col._inflight


def test_parts_are_staged_only_where_nccl_cannot_take_them_as_they_are():
    (col, _, _), = ranks(1)
    x = np.arange(6.0).reshape(2, 3)
    col.run(member("all_gather", 1, 0, axis=0, meta={"part_sizes": (2,)}), x)
    assert col.nc.calls[-1][1] == x.ctypes.data  # sent from x itself
    got = col.run(member("all_gather", 1, 0, axis=1, meta={"part_sizes": (3,)}), x)
    assert col.nc.calls[-1][1] != x.ctypes.data  # the columns, staged as rows
    np.testing.assert_array_equal(got, x)


def test_nccl_runs_whole_world_groups_of_its_dtypes_and_mpi_the_rest():
    (col, _, _), _ = ranks(2)
    f32 = np.zeros(2, np.float32)
    assert col.runs(member("all_reduce", 2, 0), f32)
    assert not col.runs(member("all_reduce", 2, 0), f32.astype(bool))  # no NCCL code
    part = SimpleNamespace(op="all_reduce", attrs={"group": (1, 0), "index": 1})
    assert not col.runs(part, f32)  # not in rank order: MPI's ring
    sub = ranks(3)[0][0]
    assert not sub.runs(member("all_reduce", 2, 0), f32)  # two ranks of three


def test_groups_of_some_ranks_get_communicators_of_their_own():
    """Four ranks, two pairs (a tensor split inside a data split): each pair all-reduces
    on its own communicator, made by commSplit on every rank."""
    world = ranks(4)
    pairs = [(0, 1), (2, 3)]
    xs = [np.full((3,), 10.0 ** r) for r in range(4)]

    def rank(r):
        col = world[r][0]
        col.split(pairs)
        g = pairs[r // 2]
        node = SimpleNamespace(name="ar", op="all_reduce", meta={},
                               attrs={"group": g, "index": g.index(r)})
        assert col.runs(node, xs[r])
        return col.run(node, xs[r])
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(rank, range(4)))
    for r, out in enumerate(outs):
        np.testing.assert_array_equal(out, xs[r - r % 2] + xs[r - r % 2 + 1])
        assert world[r][2][r] == xs[r].nbytes  # 2(p-1)/p of the value, p = 2
    assert set(world[0][0].comms) == {(0, 1, 2, 3), (0, 1)}


def test_prepare_splits_the_groups_every_rank_has_in_rank_order(monkeypatch):
    pytest.importorskip("mpi4py")
    from netdsl.runtime.nccl import NcclComm
    comm = object.__new__(NcclComm)
    comm.rank = 0
    mine = comm_graph()  # (two devices: its groups are (0, 1), this rank's view)
    others = [[(0, 1, 2, 3)], [(2, 3)], [(3, 2)], [(1,)]]
    comm.c = SimpleNamespace(Get_size=lambda: 4, allgather=lambda g: [g] + others)
    split = []
    comm.nccl = SimpleNamespace(split=split.append)
    comm.prepare(mine)
    assert split == [[(0, 1), (2, 3)]]  # not the world, one rank, or out of rank order


def test_the_stand_in_checks_the_real_signatures():
    nc = fake.NcclCommunicator(1, fake.get_unique_id(), 0)
    a = np.zeros(4, np.float32)
    with pytest.raises(TypeError):  # a float count
        nc.allReduce(a.ctypes.data, a.ctypes.data, 4.0, fake.NCCL_FLOAT32, fake.NCCL_SUM, 0)
    with pytest.raises(TypeError):  # an array for a pointer
        nc.allGather(a, a.ctypes.data, 4, fake.NCCL_FLOAT32, 0)
    with pytest.raises(TypeError):  # reduceScatter takes the op before the stream
        nc.reduceScatter(a.ctypes.data, a.ctypes.data, 4, fake.NCCL_FLOAT32, 0)
    with pytest.raises(TypeError):  # the id as CuPy 14 gives it: 128 bytes
        fake.NcclCommunicator(1, tuple(range(128)), 0)
    with pytest.raises(TypeError):  # commSplit(color, key): ints
        nc.commSplit(0, 0.5)
    assert nc.commSplit(-1, 0) is None  # (one rank: its split is done at once)


class Backend:
    name, xp = "cupy", np

    def __init__(self, why=None):
        self.why = why

    def nccl(self):
        if self.why:
            raise DeviceError(self.why)
        return fake


def test_every_rank_falls_back_to_host_mpi_if_one_lacks_nccl(monkeypatch):
    pytest.importorskip("mpi4py")
    comm, note = communicator(Backend("no libnccl.so.2"),
                              gather=lambda why: ["", why, "also none"])
    assert type(comm) is MPIComm
    assert note == "collectives between GPUs go through host MPI (rank 1: no libnccl.so.2)"
    monkeypatch.setenv(nccl_mod.ENV, "0")
    assert "NETDSL_NCCL=0" in communicator(Backend(), gather=lambda why: [why])[1]
    numpy_backend = SimpleNamespace(name="numpy", xp=np)
    comm, note = communicator(numpy_backend, gather=pytest.fail)  # (asks no rank)
    assert type(comm) is MPIComm and note is None


def test_every_rank_with_nccl_joins_one_communicator(monkeypatch):
    pytest.importorskip("mpi4py")
    made = []
    monkeypatch.setattr(fake, "NcclCommunicator",
                        lambda *a: made.append(a) or SimpleNamespace(args=a))
    backend = Backend()
    backend.xp = SimpleNamespace(cuda=SimpleNamespace(
        Stream=lambda non_blocking: Stream("nccl", []), get_current_stream=lambda: None))
    comm, note = communicator(backend, gather=lambda why: [why])
    assert note is None and comm.deferred and len(made) == 1
    size, uid, rank = made[0]
    assert (size, rank) == (1, 0) and isinstance(uid, bytes) and len(uid) == 128


def test_a_failed_nccl_set_up_is_an_error_that_names_the_rank_and_the_way_out(monkeypatch):
    pytest.importorskip("mpi4py")
    from netdsl.errors import CommError

    def refuse(*a):
        raise RuntimeError("NCCL_ERROR_SYSTEM_ERROR: unhandled system error")
    monkeypatch.setattr(fake, "NcclCommunicator", refuse)
    with pytest.raises(CommError) as e:
        communicator(Backend(), gather=lambda why: [why])
    assert e.value.message == (
        "rank 0: NCCL failed joining the communicator of all ranks (RuntimeError: "
        "NCCL_ERROR_SYSTEM_ERROR: unhandled system error); NETDSL_NCCL=0 runs the "
        "collectives through host MPI instead")


class Deferred(InProcess):
    """In-process collectives whose results are 'in flight' until waited for: every read
    of one before its wait is an error."""

    deferred = True

    def __init__(self, backend):
        super().__init__(backend)
        self.flying, self.log = set(), []

    def collective(self, node, inputs):
        self.flying.add(node.name)
        self.log.append(("run", node.name))
        return super().collective(node, inputs)

    def wait_for(self, names):
        self.log.append(("wait", tuple(names)))
        self.flying -= set(names)

    def finish_step(self):
        self.flying.clear()


def test_the_executor_waits_before_the_first_reader_of_a_collective():
    g = comm_graph()
    feeds = {"r": np.linspace(0, 1, 8).reshape(2, 4)}
    want = Executor(g, "numpy", "f64", seed=3).run(feeds)
    ex = Executor(g, "numpy", "f64", seed=3)
    comm = ex.comm = Deferred(ex.backend)
    seen = []
    call = ex._call

    def checked(n, ins, ctx):
        late = [i for i in n.inputs if i in comm.flying]
        assert not late, f"{n.name} read {late} before waiting for it"
        seen.append(n.name)
        return call(n, ins, ctx)
    ex._call = checked
    got = ex.run(feeds)
    for role in want:
        for a, b in zip(want[role], got[role], strict=True):
            np.testing.assert_array_equal(a, b)
    waits = [names for kind, names in comm.log if kind == "wait"]
    readers = [n for n in g.nodes if any(g[i].op in ("all_reduce", "all_gather",
                                                     "reduce_scatter") for i in n.inputs)]
    assert readers and len(waits) == len(readers)  # one wait per reader, no more


@pytest.mark.gpu
@pytest.mark.parametrize("op,attrs", [("all_reduce", {}),
                                      ("all_gather", {"axis": 1, "meta": {"part_sizes": (3,)}}),
                                      ("reduce_scatter", {"axis": 0, "sizes": (4,)})])
def test_a_single_rank_nccl_communicator_on_a_gpu(op, attrs):
    """NCCL's own communicator of one rank on GPU 0: each collective returns its input
    (a group of one) through NCCL's stream, and moves no bytes."""
    pytest.importorskip("mpi4py")
    try:
        from netdsl.backends import get_backend
        gpu = get_backend("cupy", 0)
        gpu.nccl()
    except DeviceError as e:
        pytest.skip(f"no GPU with NCCL: {e.message}")
    comm, note = communicator(gpu, gather=lambda why: [why])
    assert note is None and comm.nccl.nc.size() == 1
    x = gpu.asarray(np.arange(12.0, dtype=np.float32).reshape(4, 3))
    node = member(op, 1, 0, **attrs)
    assert comm.nccl.runs(node, x)
    got = comm.collective(node, [x])
    comm.finish_step()
    np.testing.assert_array_equal(gpu.to_host(got), gpu.to_host(x))
    assert comm.sent_bytes.get(0, 0) == 0
