"""The cost model: predicted time of each node, of host copies, and of a whole step.

A node's time is a roofline: max(FLOPs / rate, bytes moved / memory bandwidth) plus a
fixed per-node overhead, with FLOPs from the registry (`OpDef.flops`, 2 x MACs) and
bytes = its tensor inputs + its output (`OpDef.moved_bytes`: a slice reads only the part
it outputs). Sources cost nothing. A host copy takes
bytes / link bandwidth plus the overhead.

The step is simulated on three streams: compute runs the schedule's nodes (and clones)
in order; one copy stream per direction runs `to_host` and `to_device` copies in the
order they are issued, each starting when the compute stream reaches it and its stream
is free (a `to_device` also waits for its `to_host`). A node that reads a device copy
waits for that copy, so a prefetch that is not done in time delays compute, and one that
is costs nothing. The step ends when compute and both copy streams are done.
"""
from __future__ import annotations

from netdsl.ir import registry
from netdsl.memory.profiles import Profile
from netdsl.memory.simulate import CLONE, D2H, H2D, NODE, STATE, Prepared, Sim


class Costs:
    """Per-position times and FLOPs of a prepared graph under a profile."""

    def __init__(self, prep: Prepared, profile: Profile, float_dtype: str = "f32"):
        ops = registry.load_all()
        g = prep.g
        self.profile = profile
        self.time: list[float] = []
        self.flops: list[int] = []
        full = self.full_bytes = prep.full_bytes
        for k, (name, ph) in enumerate(zip(prep.names, prep.phase)):
            n = g[name]
            if n.is_source or ph == STATE:
                self.time.append(0.0)
                self.flops.append(0)
                continue
            op = ops[n.op]
            ins = [g[i].type for i in n.inputs[:op.n_tensor_inputs(len(n.inputs))]]
            f = int(op.flops(ins, n.type, n.attrs))
            moved = op.moved_bytes(full[k], (full[i] for i in prep.inputs[k]))
            self.flops.append(f)
            self.time.append(max(f / profile.flops_per_s, moved / profile.mem_bw)
                             + profile.op_overhead_s)
        self.nbytes = prep.bytes

    def copy_time(self, nbytes: int) -> float:
        return nbytes / self.profile.link_bw + self.profile.op_overhead_s

    def base_time(self) -> float:
        """The unconstrained step: every node once, no copies."""
        return sum(self.time)

    def step_time(self, sim: Sim) -> float:
        """Predicted time of the simulated schedule (module doc)."""
        t = d2h_free = h2d_free = 0.0
        host_done: dict[int, float] = {}
        ready: dict[int, float] = {}
        times, waits, nbytes = self.time, sim.waits, self.full_bytes
        for i, (kind, p) in enumerate(sim.entries):
            if kind == NODE or kind == CLONE:
                us = waits.get(i)
                if us:
                    for u in us:
                        r = ready[u]
                        if r > t:
                            t = r
                t += times[p]
            elif kind == D2H:
                s = d2h_free if d2h_free > t else t
                d2h_free = s + self.copy_time(nbytes[p])
                host_done[p] = d2h_free
            elif kind == H2D:
                s = max(t, h2d_free, host_done.get(p, 0.0))
                h2d_free = s + self.copy_time(nbytes[p])
                ready[p] = h2d_free
        return max(t, d2h_free, h2d_free)

    def recompute_flops(self, sim: Sim) -> int:
        return sum(self.flops[p] for p in sim.recomputed)


def costs_of(prep: Prepared, profile: Profile, float_dtype: str = "f32") -> Costs:
    """The cost model's times of `prep`'s graph on `profile`, made once for each profile
    and kept with it (a step's searches and checks share them)."""
    key = (profile, float_dtype)
    if key not in prep.costs:
        prep.costs[key] = Costs(prep, profile, float_dtype)
    return prep.costs[key]
