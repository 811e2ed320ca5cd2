"""The storage plan of one run of a graph: what runs in which order, what is freed after
each node, where every value lives, and the bytes held at every step - the one place the
byte accounting is written down. The executor follows the plan and checks each value
against it, so what it counts is, by construction, what was predicted.

The accounting rule:
- persistent state (params, buffers, optimizer state) is held all the time, on the device,
  or in the host pool for optimizer state the planner streams from the host;
- one shared workspace region, the largest `OpDef.workspace` of the nodes run (im2col
  columns and other kernel scratch: Layup's "multi-type intermediates" reuse one region),
  is held for the whole run;
- every other value that takes storage of its own (`OpDef.adds_storage`: not an in-place
  update) is held from the moment its node runs until its last reader has run (the
  requested outputs until the end). Views are counted as copies, so a count never
  under-states. Values made by host-space ops (`to_host`) are held in the host pool, not
  on the device.

In an arena run a node also holds, outside the arena, its scratch and, while the executor
copies it into its slot, a result its kernel allocated itself (not every kernel writes
into its slot): `transient_bytes`, the largest workspace plus device result of any node,
replaces the workspace region in `arena_peak_bytes`.

Device values are packed into one arena per device: an offset for each value such that
values alive at the same time never overlap (first fit over the schedule, as tinygrad's
memory planner does), reported against the lower bound, the largest sum of bytes alive at
once. Host values get slots in a host pool the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from netdsl.ir import registry
from netdsl.ir.graph import STATE_OPS, Graph, Node
from netdsl.ir.placement import PER_PROCESS, Placement
from netdsl.ir.precision import conversion_bytes, conversion_device
from netdsl.ir.types import ITEMSIZE, RUN_FLOATS
from netdsl.memory.arena import pack
from netdsl.memory.liveness import schedule

HOST = "host"
DEVICE = "device"


def value_bytes(t, float_dtype: str = "f32") -> int:
    """Bytes of a value of type `t` when f32 and f64 values run at `float_dtype`; a bf16 or
    f16 value takes 2 bytes whatever that is."""
    size = ITEMSIZE[float_dtype] if t.dtype in RUN_FLOATS else ITEMSIZE[t.dtype]
    return t.numel() * size


# Where host and device are one memory (the NumPy backend, measured by tracemalloc), a run
# also holds what the plan places nowhere: the caller's batch (each fed input is copied
# into its slot while the caller keeps its own array) and the interpreter's objects, which
# tracemalloc counts with the arrays: each slot's view, the run's dictionaries, the
# kernels' short-lived objects. The allowance a node and the fixed part are fitted to
# measurements of ResNet-20 to ResNet-1001 and transformer-tiny, and hold what those ran
# (docs/memory.md, "What a run holds besides the plan").
OBJECT_BYTES_PER_NODE = 128
OBJECT_BYTES_FIXED = 160 << 10


def unplanned_bytes(g: Graph, float_dtype: str = "f32") -> int:
    """What a run of `g` holds in unified memory besides the plan (above): the fed arrays'
    bytes and an allowance for the interpreter's objects."""
    return _held_besides(g.nodes, g.batch, float_dtype)


def process_reserves(g: Graph, float_dtype: str = "f32") -> dict[int, int]:
    """Per device of a split step run one process per device (over MPI: `meta[PER_PROCESS]`),
    what that process holds besides its device's plan: `unplanned_bytes` of its own nodes
    and of the unplaced ones, which every rank has (`parallel.project`). Empty for a step
    run in one process, whose devices share one interpreter. (Checked against what
    ResNet-20's pipeline ranks hold above their plans: docs/parallel.md.)"""
    if not g.meta.get(PER_PROCESS):
        return {}
    own: dict[int, list[Node]] = {}
    shared: list[Node] = []
    for n in g.nodes:
        (shared if n.device is None else own.setdefault(n.device, [])).append(n)
    return {d: _held_besides(own.get(d, []) + shared, g.batch, float_dtype)
            for d in sorted(own) or [0]}


def _held_besides(nodes: list[Node], batch, float_dtype: str) -> int:
    """The fed arrays the caller keeps (each whole: a split step's copy of an input, the
    rows of a micro-batch or a data part, is fed from the whole batch's array, which every
    rank that reads it loads) and the objects' allowance."""
    fed: dict[str, int] = {}
    for n in nodes:
        if n.op == "input":
            b = value_bytes(n.type, float_dtype)
            rows = n.meta.get("rows")
            if rows is not None and isinstance(batch, int) and rows[1] > rows[0]:
                b = b * batch // (rows[1] - rows[0])
            key = n.meta.get("feed_of", n.name)
            fed[key] = max(fed.get(key, 0), b)
    return sum(fed.values()) + OBJECT_BYTES_FIXED + OBJECT_BYTES_PER_NODE * len(nodes)


def space_of(n: Node) -> str:
    """Where a value lives: state the planner streams from the host says so in its meta;
    otherwise the op decides (`to_host` values are in the host pool). See
    `ir.placement.Placement`, which pairs it with the device."""
    return Placement.of(n).space


def takes_storage(n: Node) -> bool:
    """Whether running `n` creates a buffer of its own (sources are state or fed)."""
    if n.op in STATE_OPS:
        return False
    return n.op == "input" or registry.OPS[n.op].adds_storage(n)


def _op_facts(o: str) -> tuple[bool, bool | None, str]:
    """For `make_plan`'s loop, per op: whether it has a workspace rule (`workspace_bytes`
    is 0 without one), whether its nodes take storage (True, False, or None: ask
    `takes_storage` per node, for ops that write in place) and the space of a non-state
    value (`space_of`)."""
    op = registry.OPS[o]
    if o in STATE_OPS:
        return False, False, DEVICE  # (state: counted apart, its space per node)
    storage = True if o == "input" or not op.writes else None
    return (op.workspace is not registry.OpDef.workspace and o != "input", storage,
            op.extra.get("space", DEVICE))


def workspace_bytes(g: Graph, n: Node, float_dtype: str = "f32",
                    device: str | None = None) -> int:
    """The scratch `n`'s kernel holds while it runs: its op's workspace rule (which counts
    f32: scaled to the run's float dtype), plus, under mixed precision, the f32 copies of
    its 2-byte values the executor converts around the kernel on `device`
    (`netdsl.ir.precision.conversion_device(g)`, which the caller asks once)."""
    op = registry.OPS[n.op]
    if n.is_source or op.workspace is registry.OpDef.workspace:  # (no rule: none)
        return 0
    ins = tuple(g[i].type for i in n.inputs[:op.n_tensor_inputs(len(n.inputs))])
    # a deep network asks the same rule of the same types and attributes many times
    key = (n.op, ins, n.type, _attrs_key(n.attrs))
    w = _WORKSPACES.get(key)
    if w is None:
        if len(_WORKSPACES) >= _MAX_WORKSPACES:  # (a long-lived process: the LSP server)
            _WORKSPACES.clear()
        w = _WORKSPACES[key] = int(op.workspace(list(ins), n.type, n.attrs))
    w = w * ITEMSIZE[float_dtype] // 4 if float_dtype != "f32" else w  # rules count f32
    if device is not None:
        w += conversion_bytes(g, n, device, ITEMSIZE[float_dtype])
    return w


_WORKSPACES: dict[tuple, int] = {}
_MAX_WORKSPACES = 1 << 16


def _attrs_key(attrs: dict) -> tuple:
    """A hashable key of `attrs` that tells values apart by type too (True and 1)."""
    try:
        key = tuple((k, type(v), v) for k, v in attrs.items())
        hash(key)
        return key
    except TypeError:  # (an unhashable attribute: a key no other node has)
        return (object(),)


@dataclass
class MemoryPlan:
    order: list[str]  # the nodes run, in order
    frees: list[list[str]]  # values released after each node
    sizes: dict[str, int]  # bytes of every value that takes storage of its own
    space: dict[str, str]  # "device" or "host", for the values in `sizes`
    state_bytes: int
    workspace_bytes: int
    peak_bytes: int  # device: state + workspace + the most value bytes alive at once
    peak_at: str | None  # the node after which the peak is reached
    timeline: list[int]  # device bytes held after each node ran (before its frees)
    host_peak_bytes: int  # the most host-pool bytes alive at once
    offsets: dict[str, int] = field(default_factory=dict)  # device arena offsets
    arena_bytes: int = 0
    host_offsets: dict[str, int] = field(default_factory=dict)  # host pool slots
    host_bytes: int = 0  # the host pool's size
    float_dtype: str = "f32"
    # the most one node holds outside the arena in an arena run: scratch + its own result
    transient_bytes: int = 0
    # each node's workspace, where it has one (device_workspaces reads them here)
    workspaces: dict[str, int] = field(default_factory=dict)

    @property
    def lower_bound_bytes(self) -> int:
        """The largest sum of device value bytes alive at once: no arena is smaller."""
        return self.peak_bytes - self.state_bytes - self.workspace_bytes

    @property
    def arena_peak_bytes(self) -> int:
        """Device bytes when values live in the packed arena: state + the largest
        transient (scratch and a result not yet in its slot) + arena."""
        return self.state_bytes + max(self.workspace_bytes, self.transient_bytes) \
            + self.arena_bytes

    def to_json(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "state_bytes": self.state_bytes,
                "workspace_bytes": self.workspace_bytes, "arena_bytes": self.arena_bytes,
                "arena_lower_bound_bytes": self.lower_bound_bytes,
                "transient_bytes": self.transient_bytes, "host_bytes": self.host_bytes,
                "host_peak_bytes": self.host_peak_bytes,
                "peak_at": self.peak_at, "nodes": len(self.order)}


def make_plan(g: Graph, roles: tuple[str, ...], float_dtype: str = "f32", *,
              pack_arena: bool = True) -> MemoryPlan:
    """The plan for `executor.run(roles=roles)` on bound graph `g` (see module doc)."""
    registry.load_all()
    order, frees, _ = schedule(g, roles)
    state = sum(value_bytes(n.type, float_dtype) for n in g.nodes
                if n.op in STATE_OPS and space_of(n) == DEVICE)
    host_state = sum(value_bytes(n.type, float_dtype) for n in g.nodes
                     if n.op in STATE_OPS and space_of(n) == HOST)
    workspace = transient = 0
    sizes: dict[str, int] = {}
    space: dict[str, str] = {}
    workspaces: dict[str, int] = {}
    facts: dict[str, tuple] = {}  # per op, what the rules below ask of it (700k nodes)
    # under mixed precision every node may convert 2-byte values around its kernel
    device = conversion_device(g)
    for n in order:
        name, o = n.name, n.op
        f = facts.get(o)
        if f is None:
            f = facts[o] = _op_facts(o)
        has_workspace, storage, where = f
        w = workspace_bytes(g, n, float_dtype, device) if has_workspace or device else 0
        if w:
            workspaces[name] = w
            workspace = max(workspace, w)
        if storage is True or (storage is not False and takes_storage(n)):
            b = sizes[name] = value_bytes(n.type, float_dtype)
            space[name] = where
            if where == DEVICE:
                w += b
        if w > transient:
            transient = w
    base = state + workspace
    cur, peak, peak_at = base, base, None
    host_cur = host_peak = host_state  # optimizer state streamed from the host lives there
    timeline = []
    for k, n in enumerate(order):
        nb = sizes.get(n.name, 0)
        if space.get(n.name) == HOST:
            host_cur += nb
            host_peak = max(host_peak, host_cur)
        else:
            cur += nb
        timeline.append(cur)
        if cur > peak:
            peak, peak_at = cur, n.name
        for name in frees[k]:
            if space.get(name) == HOST:
                host_cur -= sizes.get(name, 0)
            else:
                cur -= sizes.get(name, 0)
    plan = MemoryPlan([n.name for n in order], frees, sizes, space, state, workspace, peak,
                      peak_at, timeline, host_peak, float_dtype=float_dtype,
                      transient_bytes=transient, workspaces=workspaces)
    if pack_arena:
        for where in (DEVICE, HOST):
            offsets, size = pack(plan.order, plan.frees,
                                 {k: v for k, v in sizes.items() if space[k] == where})
            if where == DEVICE:
                plan.offsets, plan.arena_bytes = offsets, size
            else:
                plan.host_offsets, plan.host_bytes = offsets, size
    return plan


def device_peaks(g: Graph, plan: MemoryPlan) -> dict[int, int]:
    """The plan's device bytes split by device (a split graph's nodes name theirs; None is
    device 0), by the same rule as `make_plan`: each device holds its state and the
    largest workspace of its own nodes all the time, and its values while they live."""
    dev = {n.name: n.device or 0 for n in g.nodes}
    base: dict[int, int] = {}
    for n in g.nodes:
        if n.op in STATE_OPS and space_of(n) == DEVICE:
            d = dev[n.name]
            base[d] = base.get(d, 0) + value_bytes(n.type, plan.float_dtype)
    for d, w in device_workspaces(g, plan, dev).items():
        base[d] = base.get(d, 0) + w
    cur, peak = dict(base), dict(base)
    sizes, frees = plan.sizes, plan.frees
    # only device values count: the host pool's, and values with no storage, are skipped
    on_device = {name for name, where in plan.space.items() if where == DEVICE}
    for k, name in enumerate(plan.order):
        if name in on_device:
            d = dev[name]
            c = cur[d] = cur.get(d, 0) + sizes[name]
            if c > peak.get(d, 0):
                peak[d] = c
        for x in frees[k]:
            if x in on_device:
                cur[dev[x]] -= sizes[x]
    return dict(sorted(peak.items()))


def device_workspaces(g: Graph, plan: MemoryPlan,
                      dev: dict[str, int] | None = None) -> dict[int, int]:
    """The shared workspace region of each device: the largest of its nodes' workspaces
    (`dev`: each node's device, 0 for None, where the caller has it)."""
    if dev is None:
        dev = {n.name: n.device or 0 for n in g.nodes}
    out = dict.fromkeys({dev[name] for name in plan.order}, 0)
    for name, w in plan.workspaces.items():
        d = dev[name]
        if w > out[d]:
            out[d] = w
    return out
