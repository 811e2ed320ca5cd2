"""Memory strategies as rewrites of a training-step graph: keep, recompute, offload, and
updates applied as soon as each gradient is complete.

`apply_decisions(g, decisions)` takes a bound training-step graph (forward, `autodiff`,
`add_optimizer`) and a decision per forward value ("keep" | "recompute" | "offload"; a
value not named is kept) and returns the rewritten graph, whose node order is its
schedule. The memory plan of the result (`memory.plan.make_plan`) is the truth about its
bytes; the planner's own simulator reproduces exactly these rules:

1. keep: a value lives from its producer to its last reader.
2. recompute v: the backward readers of v read a clone `v.recompute`, inserted right
   before the first of them, whose inputs are v's forward inputs resolved the same way
   (kept -> as is, offloaded -> its device copy, recomputed -> its clone, made first). So
   v itself dies after its last forward reader. A batchnorm clone is a replay (`replay`
   attribute): it normalises with the batch statistics as the original did, but neither
   reads nor updates the running statistics; a random node's clone draws what the
   original drew (its rng key is the original's). Results are bitwise identical.
3. offload v: `v.offload = to_host(v)` right after v is made (the copy overlaps the rest
   of the forward pass), so v dies after its last forward reader while its bytes wait in
   the host pool; `v.prefetch = to_device(v.offload)` is placed `prefetch` nodes before
   v's first backward use, so the copy back overlaps the backward work before it.
4. eager updates: each parameter's update runs right after the last node that reads the
   parameter or produces its gradient, and the gradient dies there - no step holds all
   gradients at once. (The optimizer's inputs and state move before the backward pass.)
5. offload of optimizer state (a `buffer` with role optimizer_state): the state lives in
   the host pool between steps; `s.prefetch = to_device(s)` is placed `prefetch` nodes
   before its update, the update reads and writes that device copy, and
   `to_host_into(s, s.prefetch, update)` right after the update writes it back.

Decisions on values no backward node reads (directly or through a clone) change nothing:
those values die after their forward use anyway.
"""
from __future__ import annotations

from collections import defaultdict

from netdsl.errors import NetdslError
from netdsl.ir import registry
from netdsl.ir.graph import Graph, Node
from netdsl.ir.ops.comm import COMM_OPS
from netdsl.ir.rewrite import clone, make_node, move_after, splice
from netdsl.passes.pipeline import register_pass

STRATEGIES = ("keep", "recompute", "offload")


def phase(n: Node) -> str:
    return n.meta.get("phase", "forward")


def replayable(n: Node) -> bool:
    """Whether running a copy of `n` gives the same value and changes nothing: pure ops,
    random ops (keyed draws), and ops with a replay mode for their writes (batchnorm).
    Communication is not: a copy of a `recv` or a collective would need its peers to send
    or reduce again."""
    op = registry.OPS[n.op]
    return not n.is_source and n.op not in COMM_OPS and (
        not op.written_inputs(n) or op.extra.get("replay", False))


def is_optimizer_state(n: Node) -> bool:
    return n.op == "buffer" and n.attrs.get("role") == "optimizer_state"


def check_decisions(g: Graph, decisions: dict[str, str]) -> None:
    for name, d in decisions.items():
        if d not in STRATEGIES:
            raise NetdslError(f"unknown memory strategy `{d}` for %{name}; choose one of "
                              f"{', '.join(STRATEGIES)}")
        if name not in g:
            raise NetdslError(f"a memory decision names %{name}, which is not in graph "
                              f"`{g.name}`")
        n = g[name]
        if d == "keep":
            continue
        if d == "offload" and is_optimizer_state(n):
            continue
        if n.is_source or phase(n) != "forward":
            raise NetdslError(f"%{name} ({n.op}) is not a forward value; only those can be "
                              f"recomputed or offloaded", loc=n.loc, stack=n.stack)
        if d == "recompute" and not replayable(n):
            why = ("is communication between devices" if n.op in COMM_OPS
                   else "writes its inputs in place")
            raise NetdslError(f"%{name} ({n.op}) {why}, so it cannot be recomputed",
                              loc=n.loc, stack=n.stack)


def apply_decisions(g: Graph, decisions: dict[str, str], *, eager_updates: bool = True,
                    prefetch: int = 1) -> Graph:
    """The rewritten copy of training-step graph `g`; see the module docstring."""
    check_decisions(g, decisions)
    g = g.copy()
    g.meta["memory_decisions"] = {k: v for k, v in decisions.items() if v != "keep"}
    _recompute_and_offload(g, {k: v for k, v in decisions.items()
                               if not is_optimizer_state(g[k])}, prefetch)
    if eager_updates and g.outputs.get("updates"):
        _eager_updates(g)
    state = [k for k, v in decisions.items() if v == "offload" and is_optimizer_state(g[k])]
    if state:
        _stream_state(g, state, prefetch)
    # the order and the effects: the shapes are the verified step's (clones copy its
    # nodes' types, the copies' come from their shape rules as they are made)
    g.verify(recheck_shapes=False)
    return g


def _stream_state(g: Graph, names: list[str], prefetch: int) -> None:
    """Optimizer state in the host pool, streamed through its update (rule 5)."""
    readers: dict[str, list[str]] = defaultdict(list)
    for n in g.nodes:
        for i in n.inputs:
            readers[i].append(n.name)
    order = [n.name for n in g.nodes]
    pos = {name: k for k, name in enumerate(order)}
    before: dict[str, list[Node]] = defaultdict(list)
    after: dict[str, list[Node]] = defaultdict(list)
    for s in names:
        users = readers[s]
        if not users:
            continue
        if len(users) != 1:
            raise NetdslError(f"optimizer state %{s} is read by {len(users)} nodes; only state "
                              "read by its one update can be streamed from the host")
        u = g[users[0]]
        g[s].meta["space"] = "host"
        pf = make_node(g, g.fresh_name(f"{s}.prefetch"), "to_device", [s], like=g[s],
                       meta={"phase": "optimizer", "state_of": s})
        g.add(pf)  # typed against the graph; re-placed below
        wb = make_node(g, g.fresh_name(f"{s}.writeback"), "to_host_into",
                       [s, pf.name, u.name], like=g[s],
                       meta={"phase": "optimizer", "state_of": s})
        u.inputs = tuple(pf.name if i == s else i for i in u.inputs)
        before[order[max(pos[u.name] - prefetch, pos[s] + 1)]].append(pf)
        after[u.name].append(wb)
        g.outputs["updates"].append(wb.name)  # a write the step must run, like the update
    moved = {n.name for ns in before.values() for n in ns}
    g.nodes = [n for n in g.nodes if n.name not in moved]
    splice(g, before=before, after=after)


def _recompute_and_offload(g: Graph, decisions: dict[str, str], prefetch: int) -> None:
    pos = {n.name: k for k, n in enumerate(g.nodes)}
    backward = [k for k, n in enumerate(g.nodes) if phase(n) != "forward" and not n.is_source]
    if not backward:
        return
    first_bwd = backward[0]
    wanted = {x for names in g.outputs.values() for x in names}
    late_readers: dict[str, list[str]] = defaultdict(list)  # backward readers of each value
    for n in g.nodes:
        if phase(n) != "forward" and not n.is_source:
            for i in set(n.inputs):
                late_readers[i].append(n.name)
    moved = {v: d for v, d in decisions.items() if d != "keep" and v not in wanted}

    # where each moved value is first needed in the backward pass: at its first backward
    # reader, or earlier if a recompute clone that reads it is needed earlier
    need: dict[str, int] = {v: min(pos[r] for r in late_readers[v])
                            for v in moved if late_readers[v]}
    for v in sorted(moved, key=pos.__getitem__, reverse=True):
        if v in need and moved[v] == "recompute":
            for i in g[v].inputs:
                if i in moved:
                    need[i] = min(need.get(i, len(pos)), need[v])

    before: dict[str, list[Node]] = defaultdict(list)
    after: dict[str, list[Node]] = defaultdict(list)
    rename: dict[str, str] = {}
    for v in sorted(need, key=pos.__getitem__):  # forward order: inputs are resolved first
        n = g[v]
        if moved[v] == "recompute":
            ins, attrs = [rename.get(i, i) for i in n.inputs], {}
            # a replay: no running statistics read or written (a split may have made the
            # original one already)
            if registry.OPS[n.op].extra.get("replay") and not n.attrs.get("replay"):
                ins, attrs = ins[:len(ins) - 2], {"replay": True}
            c = clone(n, g.fresh_name(f"{v}.recompute"), ins, attrs=attrs,
                      meta={"phase": "recompute", "forward": v})
            before[g.nodes[need[v]].name].append(c)
            rename[v] = c.name
        else:
            h = make_node(g, g.fresh_name(f"{v}.offload"), "to_host", [v], like=n,
                          meta={"phase": "forward", "offload_of": v})
            after[v].append(h)
            g.add(h)  # so the prefetch node can be typed against it; re-placed by splice
            at = max(first_bwd, need[v] - prefetch, pos[v] + 1)  # after its copy out
            d = make_node(g, g.fresh_name(f"{v}.prefetch"), "to_device", [h.name], like=n,
                          meta={"phase": "recompute", "forward": v})
            before[g.nodes[at].name].append(d)
            rename[v] = d.name
    # the to_host nodes were appended only to type the prefetches: splice places them
    offloads = {h.name for hs in after.values() for h in hs}
    g.nodes = [n for n in g.nodes if n.name not in offloads]
    for n in g.nodes:
        if phase(n) != "forward" and not n.is_source and any(i in rename for i in n.inputs):
            n.inputs = tuple(rename.get(i, i) for i in n.inputs)
    splice(g, before=before, after=after)


def _eager_updates(g: Graph) -> None:
    """Move the optimizer's sources before the backward pass and each update right after
    the last node its parameter or gradient needs."""
    ops = registry.OPS
    first_bwd = next((n.name for n in g.nodes if phase(n) not in ("forward", "optimizer")
                      and not n.is_source), None)
    if first_bwd is None:
        return
    updates = set(g.outputs["updates"])
    # optimizer inputs/state and the step counter's increment (which reads nothing else)
    early = [n for n in g.nodes if phase(n) == "optimizer"
             and (n.is_source or (n.name in updates and all(g[i].is_source for i in n.inputs)
                                  and n.op == "step_increment"))]
    early_names = {n.name for n in early}
    g.nodes = [n for n in g.nodes if n.name not in early_names]
    splice(g, before={first_bwd: early})

    pos = {n.name: k for k, n in enumerate(g.nodes)}
    root: dict[str, str] = {}  # value -> the storage it aliases (views of parameters)
    readers: dict[str, list[int]] = defaultdict(list)
    for n in g.nodes:
        op = ops[n.op]
        if op.view_of is not None and op.view_of < len(n.inputs) \
                and not op.written_inputs(n):
            src = n.inputs[op.view_of]
            root[n.name] = root.get(src, src)
        for i in n.inputs:
            readers[root.get(i, i)].append(pos[n.name])
    moves = {}
    for u in g.outputs["updates"]:
        n = g[u]
        if u in early_names:
            continue
        last = max(pos[i] for i in n.inputs)  # after everything it reads is made ...
        for j in ops[n.op].written_inputs(n):  # ... and every other read of what it writes
            last = max([last] + [p for p in readers[root.get(n.inputs[j], n.inputs[j])]
                                 if p != pos[u]])
        if last < pos[u]:
            moves[u] = g.nodes[last].name
    move_after(g, moves)


@register_pass("memory")
def memory_pass(g: Graph, decisions: dict[str, str] | None = None,
                eager_updates: bool = True, prefetch: int = 1) -> Graph:
    """Apply keep/recompute/offload decisions and eager updates to a training step."""
    return apply_decisions(g, decisions or {}, eager_updates=eager_updates,
                           prefetch=prefetch)
