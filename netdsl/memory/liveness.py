"""Liveness: which nodes a run needs, in which order, and when each value dies.

A run executes the nodes its requested outputs need, in graph order (a rewrite sets the
schedule by ordering the nodes); each value is released right after its last reader, the
requested outputs are held to the end (but for the run-only roles below), and a value
whose node names a later node in `meta["held_to"]` (or "end") is held to that node (an MPI
rank's sends: the message stays with the sender until the peer has it;
`parallel.project`). `memory.plan` turns this into bytes.
"""
from __future__ import annotations

from netdsl.ir.graph import Graph

# Output roles a run executes but does not keep: an MPI rank's sends and collectives
# (`comm`, netdsl.parallel.project) must run, since other ranks wait for them, but each of
# their values is freed after its last local reader like any other, and a run does not
# return them. (Held to the end, every all-gathered activation of a tensor split stayed
# alive for the whole step, and then in the trainer's hands into the next one.)
RUN_ONLY_ROLES = frozenset({"comm"})


def kept(g: Graph, roles: tuple[str, ...]) -> set[str]:
    """The values a run of `roles` holds to its end and returns."""
    return {name for r in roles if r not in RUN_ONLY_ROLES for name in g.outputs.get(r, [])}


def schedule(g: Graph, roles: tuple[str, ...]) -> tuple[list, list[list[str]], set[str]]:
    """The nodes the roles need, in graph order, and what to free after each of them."""
    wanted = kept(g, roles)
    needed = {name for r in roles for name in g.outputs.get(r, [])}  # run-only roles too
    for n in reversed(g.nodes):
        if n.name in needed:
            needed.update(n.inputs)
    order = [n for n in g.nodes if n.name in needed]
    last: dict[str, int] = {}
    for k, n in enumerate(order):
        for i in n.inputs:
            last[i] = k
    held = [(k, n) for k, n in enumerate(order) if "held_to" in n.meta]
    if held:
        pos = {n.name: k for k, n in enumerate(order)}
        for k, n in held:
            to = n.meta["held_to"]
            last[n.name] = max(last.get(n.name, k), len(order) - 1 if to == "end"
                               else pos.get(to, len(order) - 1))
    frees: list[list[str]] = [[] for _ in order]
    for name, k in last.items():
        if name not in wanted:
            frees[k].append(name)
    for k, n in enumerate(order):  # values nobody reads: dropped as soon as made
        if n.name not in last and n.name not in wanted:
            frees[k].append(n.name)
    return order, frees, wanted
