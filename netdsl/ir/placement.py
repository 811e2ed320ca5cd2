"""Placement: which device holds a node, and how the pieces of a split graph map back to
the single-device graph they came from.

A node's `device` is a logical device (an MPI rank, a GPU, or a slot of one process's
memory accounting); None means "wherever the run starts" and, for `input` nodes, "fed on
every device" (the learning rate). A split pass copies the single-device graph's nodes
onto devices; the copies follow one naming rule, `name@dK`, so every piece names its
original:

- a *replica* of state (a parameter, a buffer, optimizer state made from one) holds the
  same values on every device; device 0's copy keeps the original name;
- a *shard* holds a slice of the original along one axis (`meta["shard"]`), or, for
  optimizer state sharded over data replicas (`parallel.zero`), a range of the original's
  elements in order (axis `FLAT`);
- every other copy (one per device and micro-batch) is an activation of one part of the
  batch (`meta["rows"]`), or, in a spatial split, of one strip of the image height
  (`name@sK@dD`, `meta["hrows"]`).

`canonical(name)` undoes the naming rule (`w@d1.momentum_buffer` -> `w.momentum_buffer`),
which is how the executor initialises a replica with the same values as the original and
how checkpoints are written in the single-device layout, so a run saved on 4 devices
resumes on 1.

A split step that will run one process per device (over MPI) says so in its
`meta[PER_PROCESS]` (`parallel.project.mark_over_mpi`): each device is then a process of
its own, which holds, besides its plan, its own inputs and interpreter objects
(`memory.plan.process_reserves`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from netdsl.ir import registry
from netdsl.ir.graph import Graph, Node
from netdsl.ir.meta import PER_PROCESS

__all__ = ["PER_PROCESS"]  # re-exported: the splitter and the memory planner read it here

_SUFFIX = re.compile(r"@(?:d\d+|m\d+|s\d+)+")


def copy_name(name: str, device: int | None = None, micro: int | None = None,
              strip: int | None = None) -> str:
    """The name of a copy of `name` on `device` for micro-batch `micro` (or, in a
    spatial split, for strip `strip` of the image height)."""
    out = name
    if micro is not None:
        out += f"@m{micro}"
    if strip is not None:
        out += f"@s{strip}"
    if device is not None:
        out += f"@d{device}"
    return out


def canonical(name: str) -> str:
    """The single-device name a copy stands for (names without copies are their own)."""
    return _SUFFIX.sub("", name)


@dataclass(frozen=True)
class Placement:
    """Where a value lives: a logical device (an MPI rank; None: wherever the run starts,
    or, for an `input`, fed on every device) and a memory space ("device", or "host" for
    the host pool of offloaded values and host-streamed optimizer state)."""

    device: int | None
    space: str = "device"

    @staticmethod
    def of(n: Node) -> Placement:
        if n.op in ("param", "buffer"):
            space = n.meta.get("space", "device")
        else:
            space = registry.get(n.op).extra.get("space", "device")
        return Placement(n.device, space)


@dataclass(frozen=True)
class ShardSpec:
    """A `@shard(dim, ways)` annotation, read once: split along `dim` in `ways` parts."""

    dim: str
    ways: int

    @staticmethod
    def of(n: Node) -> ShardSpec | None:
        s = n.annotations.get("shard")
        return None if s is None else ShardSpec(str(s[0]), int(s[1]))


FLAT = -1  # a Shard's axis for a range of the flattened original (ZeRO's state pieces)


@dataclass(frozen=True)
class Shard:
    """A slice [lo, hi) of a state tensor of shape `full` along `axis`, or (axis FLAT)
    elements [lo, hi) of it flattened."""

    axis: int
    lo: int
    hi: int
    full: tuple[int, ...]

    def take(self, whole):
        """This shard's part of the whole value (a NumPy array): a copy."""
        if self.axis == FLAT:
            return np.asarray(whole).reshape(-1)[self.lo:self.hi].copy()
        return np.ascontiguousarray(np.take(whole, range(self.lo, self.hi), axis=self.axis))

    def to_json(self) -> list:
        return [self.axis, self.lo, self.hi, list(self.full)]

    @staticmethod
    def of(n: Node) -> Shard | None:
        s = n.meta.get("shard")
        if s is None:
            return None
        axis, lo, hi, full = s
        return Shard(int(axis), int(lo), int(hi), tuple(full))


def flat_piece_shard(p: Node, a: int, z: int) -> tuple:
    """`meta["shard"]` of elements [a, z) of state node `p` flattened, in the single-device
    entry's coordinates: a range of the entry flattened. A shard of the entry's rows (a
    tensor split's output channels, axis 0) is a contiguous range of it, so its piece is
    one too; a shard along another axis is not, and is refused."""
    sh = Shard.of(p)
    if sh is None:
        return (FLAT, a, z, tuple(p.type.shape))
    if sh.axis != 0:
        raise ValueError(f"%{p.name} is a shard along axis {sh.axis}: its elements are not "
                         "a contiguous range of the whole")
    inner = int(np.prod(sh.full[1:], dtype=np.int64))
    return (FLAT, sh.lo * inner + a, sh.lo * inner + z, sh.full)


def replica_key(n: Node) -> str:
    """What the copies of one piece of state share: the single-device name, and for a
    shard its range (the same shard in several data-parallel replicas is one piece)."""
    sh = Shard.of(n)
    name = canonical(n.name)
    return name if sh is None else f"{name}.shard{sh.lo}_{sh.hi}"


def even_parts(n: int, p: int) -> list[tuple[int, int]]:
    """`p` contiguous ranges [lo, hi) covering 0..n, sizes differing by at most one (the
    first n % p one larger): batch rows per part, channels per shard, ring chunks."""
    q, r = divmod(n, p)
    out, lo = [], 0
    for k in range(p):
        hi = lo + q + (1 if k < r else 0)
        out.append((lo, hi))
        lo = hi
    return out


def position_of(split: dict, device: int) -> dict[str, int]:
    """Where device `device` of a split (its graph's `meta["split"]`) sits: its data
    replica, pipeline stage and tensor rank, in Megatron-LM's order (tensor ranks
    fastest, then stages, then replicas: device (replica * P + stage) * T + rank)."""
    t, p = split.get("tensor", 1), split.get("pipeline", 1)
    return {"replica": device // (p * t), "stage": device // t % p, "tensor_rank": device % t}


def devices_of(g: Graph) -> list[int]:
    """The devices a graph uses, in order (a graph with no placement uses device 0)."""
    devs = sorted({n.device for n in g.nodes if n.device is not None})
    return devs or [0]


def state_layout(g: Graph) -> dict[str, list[str]]:
    """For every state value of the single-device graph, the nodes of `g` that hold it:
    one node (not split), its replicas (device 0's first), or its shards (in order)."""
    out: dict[str, list[str]] = {}
    for n in g.nodes:
        if n.op in ("param", "buffer"):
            out.setdefault(canonical(n.name), []).append(n.name)
    for names in out.values():
        names.sort(key=lambda x: (Shard.of(g[x]).lo if Shard.of(g[x]) else 0,
                                  g[x].device or 0))
    return out
