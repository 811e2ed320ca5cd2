"""Communicators: what the kernels of `send`, `recv` and the collectives call.

`InProcess` runs every logical device of a split graph in one process (the default, and
what `netdsl split --verify` uses): a send copies the value into a message buffer, a recv
copies it out onto the receiver's backend, and a collective runs the ring algorithm over
the members' buffers, moving each chunk the way the ring would. `netdsl.runtime.mpi`
implements the same interface over MPI, one rank per device. Both count the bytes each
device sent (`sent_bytes`), which is the figure `netdsl split` and `run --json` report
against the analytic lower bound.

The ring algorithms (Patarasuk and Yuan 2009; what NCCL and Horovod use): all-reduce is
a reduce-scatter (p-1 steps, each rank sends one chunk and adds the one it receives)
then an all-gather (p-1 steps, each rank passes on a finished chunk), so each rank sends
2(p-1)/p of the value: the bandwidth lower bound.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from netdsl.ir.placement import even_parts


class Communicator:
    """The interface the communication kernels use (see the module docstring)."""

    def __init__(self, xp=np) -> None:
        self.xp = xp
        self.sent_bytes: dict[int, int] = {}

    def _count(self, device: int, nbytes: int) -> None:
        self.sent_bytes[device] = self.sent_bytes.get(device, 0) + int(nbytes)

    def send(self, node, x) -> Any:
        raise NotImplementedError

    def recv(self, node, message, dtype: str) -> Any:
        raise NotImplementedError

    def collective(self, node, inputs: list) -> Any:
        raise NotImplementedError

    # whether a result may still be in flight when the kernel returns: the executor then
    # calls wait_for with a node's inputs before it runs a node that reads one
    deferred = False

    def wait_for(self, names) -> None:
        """Order what runs next after the communication that computed `names`."""

    def prepare(self, graph) -> None:
        """Set up for the collectives of `graph`, this process's step (every rank at once)."""

    def finish_step(self) -> None:
        """Wait for what is still in flight (sends); called at the end of every run."""


class InProcess(Communicator):
    """Every device in this process; `backends` maps a device to its backend (one shared
    backend by default: logical devices with separate byte accounting)."""

    def __init__(self, backend, backends: dict[int, Any] | None = None):
        super().__init__(backend.xp)
        self.backend = backend
        self.backends = backends or {}
        self._results: dict[str, Any] = {}  # member name -> its result, until it runs

    def _be(self, device):
        return self.backends.get(device, self.backend)

    def send(self, node, x):
        self._count(node.device or 0, x.nbytes)
        return x.copy()  # the message buffer: the sender may reuse x's storage at once

    def recv(self, node, message, dtype):
        return self._be(node.device).xp.array(message, copy=True)

    def collective(self, node, inputs):
        if node.name in self._results:
            return self._results.pop(node.name)
        members = node.meta["members"]
        devices = node.attrs["group"]
        outs = RING[node.op](self, inputs, node.attrs, devices)
        for name, out in zip(members, outs, strict=True):
            if name != node.name:
                self._results[name] = out
        return outs[node.attrs["index"]]


# -- the ring algorithms, over every member's buffer at once (in-process) ------------------
def _ring_all_reduce(comm: Communicator, inputs, attrs, devices):
    p = len(inputs)
    shape = inputs[0].shape
    bufs = [x.reshape(-1).copy() for x in inputs]
    if p == 1:
        return [bufs[0].reshape(shape)]
    bounds = even_parts(bufs[0].size, p)
    item = bufs[0].itemsize
    # reduce-scatter: at step s rank r sends chunk (r - s) mod p to rank r + 1, which adds
    # it to its own; after p - 1 steps rank r holds the full sum of chunk (r + 1) mod p
    for s in range(p - 1):
        moved = []
        for r in range(p):
            lo, hi = bounds[(r - s) % p]
            moved.append(bufs[r][lo:hi].copy())
            comm._count(devices[r], (hi - lo) * item)
        for r in range(p):
            lo, hi = bounds[(r - s) % p]
            bufs[(r + 1) % p][lo:hi] += moved[r]
    # all-gather: rank r passes on the finished chunk (r + 1 - s) mod p
    for s in range(p - 1):
        moved = []
        for r in range(p):
            lo, hi = bounds[(r + 1 - s) % p]
            moved.append((lo, hi, bufs[r][lo:hi].copy()))
            comm._count(devices[r], (hi - lo) * item)
        for r in range(p):
            lo, hi, v = moved[r]
            bufs[(r + 1) % p][lo:hi] = v
    return [b.reshape(shape) for b in bufs]


def _ring_all_gather(comm: Communicator, inputs, attrs, devices):
    p = len(inputs)
    ax = attrs["axis"] % inputs[0].ndim
    # rank r holds part r; at step s it passes part (r - s) mod p to rank r + 1
    have = [{r: inputs[r]} for r in range(p)]
    for s in range(p - 1):
        for r in range(p):
            part = (r - s) % p
            comm._count(devices[r], have[r][part].nbytes)
            have[(r + 1) % p][part] = have[r][part].copy()
    return [comm.xp.concatenate([have[r][k] for k in range(p)], axis=ax) for r in range(p)]


def _ring_reduce_scatter(comm: Communicator, inputs, attrs, devices):
    p = len(inputs)
    ax = attrs["axis"] % inputs[0].ndim
    cuts = np.cumsum((0,) + tuple(attrs["sizes"]))

    def part(x, k):
        idx = [slice(None)] * x.ndim
        idx[ax] = slice(int(cuts[k]), int(cuts[k + 1]))
        return x[tuple(idx)]
    # at step s rank r sends its running sum of part (r - s - 1) mod p to rank r + 1; after
    # p - 1 steps rank r holds the full sum of part r
    acc = [{k: part(inputs[r], k).copy() for k in range(p)} for r in range(p)]
    for s in range(p - 1):
        moved = []
        for r in range(p):
            k = (r - s - 1) % p
            moved.append((k, acc[r][k].copy()))
            comm._count(devices[r], acc[r][k].nbytes)
        for r in range(p):
            k, v = moved[r]
            acc[(r + 1) % p][k] += v
    return [acc[r][r] for r in range(p)]


RING = {"all_reduce": _ring_all_reduce, "all_gather": _ring_all_gather,
        "reduce_scatter": _ring_reduce_scatter}


