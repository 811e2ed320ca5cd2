"""What a split step will cost, per device, before anything runs: nodes, parameters,
FLOPs, planned peak memory (the storage plan's one accounting rule, split by device),
bytes each device sends, and the predicted step time from a simulation of every device's
schedule under a device profile and an interconnect profile.

The simulation: each device runs its nodes in graph order, one at a time; a node starts
when its device is free and its inputs are ready. Compute takes the roofline time of
`memory.cost` (max of FLOPs / rate and bytes / bandwidth, plus a per-node overhead).
A `recv` is ready a transfer time (latency + bytes / link bandwidth) after its `send`
ran; a collective's members start together once every member's device reaches it and
take the ring's time (2(p-1) latencies + bytes sent / bandwidth for an all-reduce). A
memory plan's host copies (`to_host`, `to_device`) run on the device's copy stream of
their direction, as in `memory.cost`: issued when compute reaches them, taking bytes /
host-link bandwidth, without holding compute up; a reader waits for the copy. The
bubble of a pipeline is the share of device time spent idle: 1 - busy / (devices x step);
the ideal is its schedule's formula (`schedules.formula_bubble`: GPipe's and 1F1B's
(p-1)/(m+p-1), interleaved 1F1B's (p-1)/(vm+p-1), ZB-H1's (p-1)/(3m+p-1)).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from netdsl.errors import NetdslError
from netdsl.ir import registry
from netdsl.ir.graph import STATE_OPS, Graph
from netdsl.ir.ops.comm import COLLECTIVES, comm_bytes
from netdsl.ir.placement import devices_of, position_of
from netdsl.memory.plan import device_peaks, make_plan, process_reserves, value_bytes
from netdsl.memory.profiles import Profile
from netdsl.parallel.schedules import formula_bubble


@dataclass(frozen=True)
class Interconnect:
    name: str
    bandwidth: float  # bytes/s, each direction, per link
    latency_s: float
    source: str = ""

    def to_json(self) -> dict:
        return {"name": self.name, "bandwidth": self.bandwidth, "latency_s": self.latency_s,
                "source": self.source}


INTERCONNECTS = {
    # shared memory between processes of one machine (MPI's vader/CMA: a memcpy)
    "shm": Interconnect("shm", 8e9, 2e-6, "one machine: a memory copy between processes"),
    "pcie3": Interconnect("pcie3", 12e9, 10e-6, "PCIe 3.0 x16, ~12 GB/s achieved"),
    "nvlink4": Interconnect("nvlink4", 300e9, 3e-6, "NVLink 4 (H100/H200), ~300 GB/s each way"),
    "ib-hdr": Interconnect("ib-hdr", 23e9, 2e-6, "InfiniBand HDR 200 Gb/s, ~23 GB/s achieved"),
    "10gbe": Interconnect("10gbe", 1.1e9, 30e-6, "10 Gb Ethernet, ~1.1 GB/s achieved"),
}


def get_interconnect(name: str) -> Interconnect:
    if name not in INTERCONNECTS:
        raise NetdslError(f"unknown interconnect `{name}`; choose one of "
                          f"{', '.join(INTERCONNECTS)}")
    return INTERCONNECTS[name]


@dataclass
class DeviceReport:
    device: int
    nodes: int
    params: int
    flops: int
    peak_bytes: int
    comm_bytes: int  # sent per step (what the communicator counts)
    sends: int
    collectives: int
    busy_s: float = 0.0
    # run as a process of its own (over MPI), what it holds besides its plan in unified
    # memory: its inputs, its interpreter objects (`plan.process_reserves`)
    outside_plan_bytes: int = 0
    # what it holds from step to step: parameters, buffers and optimizer state, and of
    # that the optimizer state (a sharded data split: 1/N of the replicas')
    state_bytes: int = 0
    optimizer_state_bytes: int = 0
    # its data replica, pipeline stage and tensor rank (`placement.position_of`)
    position: dict | None = None

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class SplitReport:
    strategy: str
    devices: int
    per_device: list[DeviceReport]
    predicted_step_s: float
    single_step_s: float
    bubble: float
    ideal_bubble: float | None
    comm_bytes_lower_bound: int
    profile: str
    interconnect: str
    detail: dict

    @property
    def comm_bytes_total(self) -> int:
        return sum(d.comm_bytes for d in self.per_device)

    @property
    def predicted_speedup(self) -> float:
        return self.single_step_s / self.predicted_step_s if self.predicted_step_s else 0.0

    def to_json(self) -> dict:
        return {"strategy": self.strategy, "devices": self.devices,
                "per_device": [d.to_json() for d in self.per_device],
                "comm_bytes_total": self.comm_bytes_total,
                "comm_bytes_lower_bound": self.comm_bytes_lower_bound,
                "predicted_step_s": self.predicted_step_s,
                "single_device_step_s": self.single_step_s,
                "predicted_speedup": self.predicted_speedup, "bubble": self.bubble,
                "ideal_bubble": self.ideal_bubble, "profile": self.profile,
                "interconnect": self.interconnect, **self.detail}


ROLES = ("loss", "output", "updates", "state_updates", "logits")
HOST_COPIES = ("to_host", "to_device", "to_host_into")  # a memory plan's offloads


def node_time(g: Graph, n, profile: Profile, float_dtype: str = "f32") -> tuple[float, int]:
    """(seconds, FLOPs) of one compute node by the roofline of memory.cost."""
    op = registry.OPS[n.op]
    ins = [g[i].type for i in n.inputs[:op.n_tensor_inputs(len(n.inputs))]]
    f = int(op.flops(ins, n.type, n.attrs))
    moved = op.moved_bytes(value_bytes(n.type, float_dtype),
                           (value_bytes(t, float_dtype) for t in ins))
    return max(f / profile.flops_per_s, moved / profile.mem_bw) + profile.op_overhead_s, f


class Simulated(NamedTuple):
    step_s: float  # the predicted step
    busy: dict[int, float]  # seconds each device computes
    timeline: list[tuple]  # (device, start, end, kind, node)
    flops: dict[int, int]  # FLOPs each device computes


def simulate(g: Graph, profile: Profile, link: Interconnect, float_dtype: str = "f32",
             order: list[str] | None = None) -> Simulated:
    """The nodes of `g` run in `order` (default: the storage plan's) by the roofline of
    `node_time`, communication by `link`'s latency and bandwidth."""
    registry.load_all()
    if order is None:
        order = make_plan(g, _roles(g), float_dtype, pack_arena=False).order
    free: dict[int, float] = {}
    ready: dict[str, float] = {}
    busy: dict[int, float] = {}
    flops: dict[int, int] = {}
    timeline: list[tuple] = []
    members_done: dict[tuple, tuple[float, float]] = {}
    copy_free: dict[tuple[int, bool], float] = {}  # (device, to the device) -> free at
    for name in order:
        n = g[name]
        d = 0 if n.device is None else n.device
        if n.op in STATE_OPS or n.op == "input":
            ready[name] = 0.0
            continue
        start = max([free.get(d, 0.0)] + [ready.get(i, 0.0) for i in n.inputs
                                           if g[i].op != "send"])
        if n.op == "recv":
            start = max(start, ready.get(n.inputs[0], 0.0))
            t = link.latency_s + value_bytes(n.type, float_dtype) / link.bandwidth
            s0 = ready[n.inputs[0]]
            end = max(start, s0 + t)
            timeline.append((d, s0, s0 + t, "recv", name))
        elif n.op == "send":
            end = start  # the copy out runs on the link; the sender goes on
        elif n.op in HOST_COPIES:  # on a copy stream: compute goes on
            lane = (d, n.op == "to_device")
            start = max(start, copy_free.get(lane, 0.0))
            end = start + value_bytes(n.type, float_dtype) / profile.link_bw \
                + profile.op_overhead_s
            copy_free[lane] = end
            ready[name] = end
            timeline.append((d, start, end, "copy", name))
            continue
        elif n.op in COLLECTIVES:
            key = n.meta["members"]
            if key not in members_done:
                devs = n.attrs["group"]
                begin = max([free.get(x, 0.0) for x in devs]
                            + [ready.get(i, 0.0) for i in n.inputs])
                p = len(devs)
                sent = comm_bytes(n, value_bytes(g[n.inputs[n.attrs["index"]]].type,
                                                 float_dtype))
                steps = 2 * (p - 1) if n.op == "all_reduce" else p - 1
                members_done[key] = (begin, begin + steps * link.latency_s
                                     + sent / link.bandwidth)
            start, end = members_done[key]
            timeline.append((d, start, end, "collective", name))
        else:
            t, f = node_time(g, n, profile, float_dtype)
            end = start + t
            busy[d] = busy.get(d, 0.0) + t
            flops[d] = flops.get(d, 0) + f
            timeline.append((d, start, end, n.meta.get("phase", "forward"), name))
        free[d] = end
        ready[name] = end
    return Simulated(max(free.values(), default=0.0), busy, timeline, flops)


def step_time(g: Graph, profile: Profile, link: Interconnect, float_dtype: str = "f32") -> float:
    """The predicted time of one step of `g` (the single-device step, for a speed-up)."""
    return simulate(g, profile, link, float_dtype).step_s


def _roles(g: Graph) -> tuple[str, ...]:
    return tuple(r for r in ROLES if r in g.outputs)


def report(g: Graph, single_step: float, profile: Profile, link: Interconnect,
           float_dtype: str = "f32") -> tuple[SplitReport, list[tuple]]:
    """The per-device table and predictions for split training graph `g`; `single_step`
    is the predicted step of the single-device graph it came from (`step_time`)."""
    plan = make_plan(g, _roles(g), float_dtype, pack_arena=False)
    peaks = device_peaks(g, plan)
    reserves = process_reserves(g, float_dtype) if profile.unified else {}
    step, busy, timeline, flops = simulate(g, profile, link, float_dtype, plan.order)
    # per device: nodes, parameters, bytes sent, sends, collectives, state bytes, optimizer
    # state bytes (one pass: 700k nodes)
    count = {d: [0, 0, 0, 0, 0, 0, 0] for d in devices_of(g)}
    for n in g.nodes:
        c = count.get(n.device or 0)
        if c is None:  # (unplaced nodes count on device 0 where it is used)
            continue
        c[0] += 1
        o = n.op
        if o == "param":
            c[1] += n.type.numel()
        if o in STATE_OPS:
            nbytes = value_bytes(n.type, float_dtype)
            c[5] += nbytes
            if n.attrs.get("role") == "optimizer_state":
                c[6] += nbytes
        elif o == "send" or o in COLLECTIVES:
            mine = g[n.inputs[0] if o == "send" else n.inputs[n.attrs["index"]]]
            c[2] += comm_bytes(n, value_bytes(mine.type, float_dtype))
            c[3 if o == "send" else 4] += 1
    per = [DeviceReport(d, nodes, params, flops.get(d, 0), peaks.get(d, 0), sent, sends,
                        colls, busy.get(d, 0.0), reserves.get(d, 0), state, opt_state)
           for d, (nodes, params, sent, sends, colls, state, opt_state) in count.items()]
    lower = sum(d.comm_bytes for d in per)
    split = g.meta.get("split", {})
    if split.get("spatial", 1) == 1:
        for d in per:
            d.position = position_of(split, d.device)
    k, m = split.get("pipeline", 1), split.get("microbatches", 1)
    total_busy = sum(busy.values())
    bubble = 1.0 - total_busy / (len(per) * step) if step else 0.0
    ideal = formula_bubble(split.get("schedule", "gpipe"), k, m,
                           split.get("virtual_stages", 1)) if k > 1 else None
    rep = SplitReport(split.get("strategy", "none"), len(per), per, step, single_step, bubble,
                      ideal, lower, profile.name, link.name,
                      {k_: v for k_, v in split.items() if k_ in ("data", "pipeline",
                                                                   "microbatches", "bn",
                                                                   "stages", "shard",
                                                                   "schedule",
                                                                   "virtual_stages",
                                                                   "tensor")})
    return rep, timeline
