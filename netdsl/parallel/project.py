"""One rank's part of a split graph, for runs over MPI (one process per device).

`project(g, rank)` keeps the nodes placed on `rank` and the unplaced ones (`input` nodes
fed everywhere, such as the learning rate), which it places on `rank`: the rank's one
device holds them, so its byte count is one device's, as its plan's is. What crosses
ranks is cut at the communication ops, whose kernels then talk to the other ranks: a
`recv` of a message sent elsewhere reads nothing locally, a collective member reads only
its own input. Every local communication node is listed in the output role `comm`, so a
rank runs its sends and collectives even when nothing on it reads their results, and the
output roles keep only local values (the loss lives on rank 0).
"""
from __future__ import annotations

from netdsl.errors import SplitError
from netdsl.ir.graph import Graph
from netdsl.ir.ops.comm import COLLECTIVES, COMM_OPS


def project(g: Graph, rank: int) -> Graph:
    mine = [n.copy() for n in g.nodes if n.device == rank or n.device is None]
    if not any(n.device == rank for n in mine):
        raise SplitError(f"rank {rank} has no part of graph `{g.name}`: it is split over "
                         f"fewer devices than there are ranks")
    names = {n.name for n in mine}
    for n in mine:
        if n.device is None:  # (the inputs, the learning rate): this rank's, counted there
            n.device = rank
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
