"""One rank's part of a split graph, for runs over MPI (one process per device).

`project(g, rank)` keeps the nodes placed on `rank` and the unplaced ones (`input` nodes
fed everywhere, such as the learning rate), which it places on `rank`: the rank's one
device holds them, so its byte count is one device's, as its plan's is. What crosses
ranks is cut at the communication ops, whose kernels then talk to the other ranks: a
`recv` of a message sent elsewhere reads nothing locally, a collective member reads only
its own input. Every local communication node is listed in the output role `comm`, so a
rank runs its sends and collectives even when nothing on it reads their results, and the
output roles keep only local values (the loss lives on rank 0).

A send's message stays with the sender until the peer has received it (MPI's Isend),
though no local node reads it: `meta["held_to"]` names the first local receive that
cannot complete before then (of the peer's next send to this rank after its receive), or
"end" (the step's end waits for every send), and the storage plan keeps the message to
there.
"""
from __future__ import annotations

import bisect

from netdsl.errors import SplitError
from netdsl.ir.graph import Graph
from netdsl.ir.ops.comm import COLLECTIVES, COMM_OPS
from netdsl.ir.placement import PER_PROCESS


def project(g: Graph, rank: int) -> Graph:
    held_to = ({} if any("held_to" in n.meta for n in g.nodes if n.op == "send")
               else sends_held_to(g))  # (marked before the step was planned: kept)
    mine = [n.copy() for n in g.nodes if n.device == rank or n.device is None]
    if not any(n.device == rank for n in mine):
        raise SplitError(f"rank {rank} has no part of graph `{g.name}`: it is split over "
                         f"fewer devices than there are ranks")
    names = {n.name for n in mine}
    for n in mine:
        if n.device is None:  # (the inputs, the learning rate): this rank's, counted there
            n.device = rank
        if n.op == "send" and n.name in held_to:
            n.meta["held_to"] = held_to[n.name]
        if n.op == "recv" and n.inputs[0] not in names:
            n.inputs = ()
        elif n.op in COLLECTIVES:
            if n.op == "all_gather":  # the other members' part sizes, which it receives
                ax = n.attrs["axis"]
                n.meta["part_sizes"] = tuple(g[i].type.shape[ax] for i in n.inputs)
            n.inputs = (n.inputs[n.attrs["index"]],)
        elif any(i not in names for i in n.inputs):
            missing = next(i for i in n.inputs if i not in names)
            raise SplitError(f"internal error: %{n.name} on rank {rank} reads %{missing} "
                             f"from rank {g[missing].device} without communication")
    out = Graph(g.name, mine, {}, g.batch, dict(g.parallel), dict(g.meta))
    for role, values in g.outputs.items():
        local = [v for v in values if v in names]
        if local:
            out.outputs[role] = local
    out.outputs["comm"] = [n.name for n in mine if n.op in COMM_OPS]
    out.meta["rank"] = rank
    return out


def sends_held_to(g: Graph) -> dict[str, str]:
    """For each send to another device: the first receive on the sender's device that
    waits for a message the peer sends after it has received this one (so the send has
    completed by the time that receive has), else "end". Ranks run their nodes in graph
    order. The names are kept in each send's `meta["held_to"]` (`mark_over_mpi`)."""
    recv_of = {n.inputs[0]: n for n in g.nodes if n.op == "recv"}
    pos = {n.name: k for k, n in enumerate(g.nodes)}
    # the sends from one device to another, in order, with the receive they feed
    lanes: dict[tuple[int, int], list[tuple[int, str]]] = {}
    for k, n in enumerate(g.nodes):
        r = recv_of.get(n.name)
        if n.op == "send" and r is not None and r.device != n.device:
            lanes.setdefault((n.device, r.device), []).append((k, r.name))
    out = {}
    for n in g.nodes:
        r = recv_of.get(n.name)
        if n.op != "send" or r is None or r.device == n.device:
            continue
        lane = lanes.get((r.device, n.device), ())
        i = bisect.bisect_right(lane, (pos[r.name], "\uffff"))  # sent after it received
        out[n.name] = lane[i][1] if i < len(lane) else "end"
    return out


def mark_over_mpi(g: Graph) -> Graph:
    """Mark split step `g` as run over MPI, one process per device: each send's
    `meta["held_to"]` (`sends_held_to`), so that storage plans and the memory planner
    count its message as MPI holds it, and `meta[PER_PROCESS]`, so that a budget leaves
    each process room for what it holds besides its plan (`plan.process_reserves`)."""
    for name, to in sends_held_to(g).items():
        g[name].meta["held_to"] = to
    g.meta[PER_PROCESS] = True
    return g
