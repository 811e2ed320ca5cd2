"""A stand-in for CuPy's `cupy.cuda.nccl` with the real module's signatures (CuPy 14's
cupy_backends/cuda/libs/nccl.pyx, as its compiled module's embedded signatures give them):

    get_unique_id() -> bytes (NCCL_UNIQUE_ID_BYTES = 128; a tuple of ints before CuPy 14)
    NcclCommunicator(int ndev, bytes commId, int rank, NcclConfig config=None)
    .allReduce(intptr_t sendbuf, intptr_t recvbuf, size_t count, int datatype, int op,
               intptr_t stream)
    .allGather(intptr_t sendbuf, intptr_t recvbuf, size_t count, int datatype,
               intptr_t stream)
    .reduceScatter(intptr_t sendbuf, intptr_t recvbuf, size_t recvcount, int datatype,
                   int op, intptr_t stream)
    .commSplit(int color, int key, NcclConfig config=None) -> NcclCommunicator, or None
               where color is -1 (collective over the parent's ranks; NCCL 2.18.1 and up)

Every argument is checked for its type as Cython's conversion would (an int, not a float
or an array; a bool is refused here although Cython takes it, since none is meant). The
ranks of one communicator (one per unique id) share a fabric; a collective runs on host
memory (the addresses are NumPy arrays') once every rank has queued it, as a GPU's would
after the last rank's launch (each rank's call returns then: the ranks run in threads),
and the fabric checks that the ranks queued the same call.
"""
from __future__ import annotations

import ctypes
import os
import threading

import numpy as np

# nccl.h: ncclDataType_t and ncclRedOp_t
NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = range(6)
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = range(4)
_NUMPY = {NCCL_INT8: np.int8, NCCL_UINT8: np.uint8, NCCL_INT32: np.int32,
          NCCL_UINT32: np.uint32, NCCL_INT64: np.int64, NCCL_UINT64: np.uint64,
          NCCL_FLOAT16: np.float16, NCCL_FLOAT32: np.float32, NCCL_FLOAT64: np.float64}
available = True
_FABRICS: dict[bytes, _Fabric] = {}


def get_unique_id() -> bytes:
    return os.urandom(128)


def get_version() -> int:
    return 22304


def _int(name, v, low=None):
    if type(v) is not int:
        raise TypeError(f"{name} must be an int (a C integer), not {type(v).__name__}")
    if low is not None and v < low:
        raise OverflowError(f"{name} {v} is below {low}")


def _view(ptr: int, count: int, datatype: int) -> np.ndarray:
    dt = np.dtype(_NUMPY[datatype])
    raw = (ctypes.c_byte * (count * dt.itemsize)).from_address(ptr)
    return np.ctypeslib.as_array(raw).view(dt)


class _Fabric:
    def __init__(self, ndev: int):
        self.ndev = ndev
        self.queued: list[list[tuple]] = [[] for _ in range(ndev)]
        self.done = 0  # collectives run so far
        self.splits: list[dict[int, tuple]] = []  # per commSplit: rank -> (color, key)
        self.turn = threading.Condition()

    def post(self, rank: int, call: tuple) -> None:
        """Queue `call`, and return once every rank has queued its own and it ran: what a
        rank's stream queues after a collective runs after it (ranks run in threads)."""
        with self.turn:
            self.queued[rank].append(call)
            k = len(self.queued[rank])
            while all(len(q) > self.done for q in self.queued):
                calls = [q[self.done] for q in self.queued]
                kinds = {(c[0], c[3], c[4]) for c in calls}  # (op, count, datatype) agree
                if len(kinds) != 1:
                    raise RuntimeError(f"ranks queued different collectives: {calls}")
                getattr(self, "_" + calls[0][0])(calls)
                self.done += 1
                self.turn.notify_all()
            if not self.turn.wait_for(lambda: self.done >= k, timeout=10):
                raise TimeoutError(f"rank {rank}: the other ranks never queued {call[0]}")

    def split(self, rank: int, color: int, key: int):
        """commSplit: once every rank has called its k-th, each color's ranks share a new
        fabric, ranked by key; (the new fabric, this rank's place) or None for color -1."""
        with self.turn:
            k = sum(rank in s for s in self.splits)
            if k == len(self.splits):
                self.splits.append({})
            self.splits[k][rank] = (color, key)
            self.turn.notify_all()
            if not self.turn.wait_for(lambda: len(self.splits[k]) == self.ndev, timeout=10):
                raise TimeoutError(f"rank {rank}: the other ranks never called commSplit")
            if color == -1:
                return None
            same = sorted((kk, r) for r, (c, kk) in self.splits[k].items() if c == color)
            subs = getattr(self, "_subs", {})
            self._subs = subs
            fabric = subs.setdefault((k, color), _Fabric(len(same)))
            return fabric, [r for _, r in same].index(rank)

    def _allReduce(self, calls):
        _, _, _, count, dt, *_ = calls[0]
        total = sum(_view(c[1], count, dt).astype(np.float64) for c in calls)
        for c in calls:
            _view(c[2], count, dt)[...] = total

    def _allGather(self, calls):
        _, _, _, count, dt, *_ = calls[0]
        whole = np.concatenate([_view(c[1], count, dt) for c in calls])
        for c in calls:
            _view(c[2], count * self.ndev, dt)[...] = whole

    def _reduceScatter(self, calls):
        _, _, _, count, dt, *_ = calls[0]
        total = sum(_view(c[1], count * self.ndev, dt).astype(np.float64) for c in calls)
        for r, c in enumerate(calls):
            _view(c[2], count, dt)[...] = total[r * count:(r + 1) * count]


class NcclCommunicator:
    def __init__(self, ndev, commId, rank, config=None):
        _int("ndev", ndev, 1)
        _int("rank", rank, 0)
        if not isinstance(commId, bytes) or len(commId) != 128:
            raise TypeError("commId must be the 128 bytes get_unique_id() returned")
        if rank >= ndev:
            raise ValueError(f"rank {rank} of a communicator of {ndev}")
        self.fabric = _FABRICS.setdefault(commId, _Fabric(ndev))
        self._rank, self.calls = rank, []

    def commSplit(self, color, key, config=None):
        _int("color", color, -1)
        _int("key", key)
        got = self.fabric.split(self._rank, color, key)
        if got is None:
            return None
        sub = object.__new__(NcclCommunicator)
        sub.fabric, (sub._rank, sub.calls) = got[0], (got[1], [])
        return sub

    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return self.fabric.ndev

    def _queue(self, op, sendbuf, recvbuf, count, datatype, red, stream):
        for name, v in (("sendbuf", sendbuf), ("recvbuf", recvbuf), ("stream", stream)):
            _int(name, v)
        _int("count", count, 0)
        _int("datatype", datatype)
        if datatype not in _NUMPY:
            raise ValueError(f"datatype {datatype} is no ncclDataType_t")
        if red is not None:
            _int("op", red)
        call = (op, sendbuf, recvbuf, count, datatype, red, stream)
        self.calls.append(call)
        self.fabric.post(self._rank, call)

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        self._queue("allReduce", sendbuf, recvbuf, count, datatype, op, stream)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        self._queue("allGather", sendbuf, recvbuf, count, datatype, None, stream)

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        self._queue("reduceScatter", sendbuf, recvbuf, recvcount, datatype, op, stream)
