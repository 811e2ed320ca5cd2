"""The rewrites every split is made of (the BigData 2019 paper's duplicate, split,
augment, assign and connect):

- `copy_forward` duplicates the forward graph once per *part* (a device and a micro-batch
  holding rows [lo, hi) of the batch), each copy bound to its rows and assigned to its
  device; state is replicated per device (or shared by the parts on one device), so the
  copies read the state their device holds;
- `connect` adds a `send`/`recv` pair wherever a value is read on another device than
  the one that made it;
- `combine` makes the single-device graph's results out of the parts': the loss as the
  batch-weighted sum of the parts' losses, batch-shaped outputs concatenated, each under
  its original name on one device, so a caller (the trainer, the equivalence gate) reads
  the split graph's results by the names it knows.

Copies are emitted node-major (every part's copy of a node before the next node), so a
collective's members can sit side by side and every device's order is the original one.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from netdsl.errors import SplitError
from netdsl.ir import registry
from netdsl.ir.graph import STATE_OPS, Graph, Node
from netdsl.ir.placement import copy_name, even_parts
from netdsl.ir.rewrite import make_node
from netdsl.ir.types import BATCH


@dataclass(frozen=True)
class Part:
    """Rows [lo, hi) of the batch, on `device`, as micro-batch `micro` (None: no
    micro-batches)."""

    device: int
    micro: int | None
    lo: int
    hi: int
    # a copy computing what another part computes (tensor parallelism: every device runs
    # the whole batch); its results are not combined
    mirror: bool = False

    @property
    def rows(self) -> int:
        return self.hi - self.lo


def batch_rows(batch: int, ways: int, what: str) -> list[tuple[int, int]]:
    """`ways` contiguous row ranges of a batch, sizes differing by at most one."""
    if ways > batch:
        raise SplitError(f"cannot split a batch of {batch} into {ways} {what}: each needs at "
                         f"least one sample; use --batch {ways} or more, or fewer {what}")
    return even_parts(batch, ways)


def batch_dependent(n: Node) -> bool:
    """Whether a node of the unbound forward graph has the batch as its leading dim."""
    return bool(n.type.shape) and isinstance(n.type.shape[0], str) and BATCH in n.type.shape[0]


# MPI guarantees tags up to 32767: forward messages use the lower half, their gradients
# (sent back by `recv`'s gradient rule) the upper half
FORWARD_TAGS = 16384

StateName = Callable[[Node, Part], str]


def copy_forward(fwd: Graph, parts: list[Part], batch: int, state_name: StateName,
                 device_of: Callable[[Node, Part], int] | None = None) -> tuple[Graph, dict]:
    """The parts' copies of unbound forward graph `fwd` (module docstring). `state_name`
    names the state node a part reads (parts on one device may share one). `device_of`
    places a node of a part (default: the part's device). Returns the graph (no outputs
    yet) and `copies[name][k]`, part k's copy of each node."""
    ops = registry.load_all()
    bound = {}
    for p in parts:
        if p.rows not in bound:
            bound[p.rows] = fwd.bind(p.rows)
    g = Graph(fwd.name, [], {}, batch, dict(fwd.parallel), dict(fwd.meta))
    copies: dict[str, list[str]] = {}
    for idx, n in enumerate(fwd.nodes):
        names = []
        for p in parts:
            m = bound[p.rows].nodes[idx]
            dev = p.device if device_of is None else device_of(n, p)
            if m.op in STATE_OPS:
                name = state_name(n, p)
                if name not in g:
                    c = m.copy(name=name, device=dev)
                    c.meta["origin"] = n.name
                    g.add(c)
                names.append(name)
                continue
            c = m.copy(name=copy_name(n.name, p.device, p.micro), device=dev,
                       inputs=tuple(copies[i][len(names)] for i in m.inputs))
            c.meta["origin"] = n.name
            if batch_dependent(n):
                c.meta["rows"] = (p.lo, p.hi)
            if n.op == "input":
                c.meta["feed_of"] = n.name
            if p.mirror:
                c.meta["mirror"] = True
            if ops[n.op].random:  # draw the part's rows of the whole batch's numbers
                c.meta.setdefault("rng_key", n.meta.get("rng_key", n.name))
                c.meta["rng_rows"] = (p.lo, p.hi, batch)
            g.add(c)
            names.append(c.name)
        copies[n.name] = names
    return g, copies


class Links:
    """The send/recv pairs of a split graph: one pair per value and receiving device, with
    a tag per (sender, receiver) pair so messages between two ranks never mix."""

    def __init__(self, g: Graph):
        self.g = g
        self.made: dict[tuple[str, int], str] = {}
        # tags count per (sender, receiver) over the whole graph, whichever pass adds pairs
        self.tags: dict[str, int] = g.meta.setdefault("p2p_tags", {})

    def fetch(self, value: str, device: int, like: Node | None = None) -> tuple[list[Node], str]:
        """Nodes that bring `value` to `device` (added at the end of the graph: a caller
        that needs them elsewhere reorders), and the name to read there."""
        src = self.g[value].device
        if src is None or src == device:
            return [], value
        if (value, device) in self.made:
            return [], self.made[(value, device)]
        tag = self.tags.get(f"{src}>{device}", 0)
        self.tags[f"{src}>{device}"] = tag + 1
        v = self.g[value]
        like = like or v
        send = make_node(self.g, self.g.fresh_name(f"{value}.send{device}"), "send", [value],
                         {"peer": device, "tag": tag % FORWARD_TAGS}, like=like, device=src,
                         meta={"origin": v.meta.get("origin", value)})
        self.g.add(send)
        recv = make_node(self.g, self.g.fresh_name(f"{value}.recv{device}"), "recv",
                         [send.name], {"peer": src, "tag": tag % FORWARD_TAGS}, like=like,
                         device=device, meta={"origin": v.meta.get("origin", value)})
        self.g.add(recv)
        self.made[(value, device)] = recv.name
        return [send, recv], recv.name


def connect(g: Graph) -> Graph:
    """Insert a send/recv pair before every read of a value made on another device
    (state and `input` nodes without a device are everywhere and need none)."""
    links = Links(g)
    out: list[Node] = []
    for n in list(g.nodes):
        if n.device is not None and n.op not in ("send", "recv") and n.meta.get("members") is None:
            ins = []
            for i in n.inputs:
                new, name = links.fetch(i, n.device, like=n)
                out.extend(new)
                ins.append(name)
            n.inputs = tuple(ins)
        out.append(n)
    g.nodes = out
    return g


def combine(g: Graph, fwd: Graph, parts: list[Part], copies: dict[str, list[str]],
            batch: int, root: int, gather: tuple[str, ...] = ()) -> Graph:
    """Give `g` the single-device graph's output roles, under the original names, on
    device `root` (module docstring). `gather` names more values to make whole (the
    trainer's logits)."""
    links = Links(g)

    def fetched(names: list[str]) -> list[str]:
        out = []
        for x in names:  # the pairs go at the end
            new, name = links.fetch(x, root)
            for m in new:
                m.meta["combined"] = True
            out.append(name)
        return out

    def add(name: str, op: str, inputs: list[str], attrs: dict, like: Node) -> str:
        n = make_node(g, name, op, inputs, attrs, like=like, device=root,
                      meta={"origin": like.name, "combined": True})
        g.add(n)
        return name

    own = [k for k, p in enumerate(parts) if not p.mirror]
    mine = [parts[k] for k in own]

    def of(x: str) -> list[str]:
        return [copies[x][k] for k in own]

    outputs: dict[str, list[str]] = {}
    for role, names in fwd.outputs.items():
        outputs[role] = [_whole(g, fwd[x], of(x), mine, batch, role == "loss", fetched, add)
                         for x in names]
    for x in gather:
        if x not in g:
            _whole(g, fwd[x], of(x), mine, batch, False, fetched, add)
    g.outputs = {**g.outputs, **outputs}  # roles a rewrite added (state_updates) stay
    return g


def _whole(g, orig: Node, names: list[str], parts: list[Part], batch: int, is_loss: bool,
           fetched, add) -> str:
    """Node `orig`'s whole value out of its parts' copies (see `combine`)."""
    if is_loss:
        # the single-device loss over the batch: a mean-reduced loss is the rows-weighted
        # sum of the parts' means; a sum-reduced one the plain sum
        total_sum = orig.attrs.get("reduction") == "sum"
        terms = []
        for name, p, x in zip(names, parts, fetched(names), strict=True):
            w = 1.0 if total_sum else p.rows / batch
            terms.append(x if w == 1.0 else add(g.fresh_name(f"{name}.weighted"), "scale",
                                                [x], {"factor": w}, orig))
        acc = terms[0]
        for k, t in enumerate(terms[1:]):
            last = k == len(terms) - 2
            acc = add(orig.name if last else g.fresh_name(f"{orig.name}.partial"), "add",
                      [acc, t], {}, orig)
        if len(terms) == 1:
            acc = add(orig.name, "scale", [acc], {"factor": 1.0}, orig)
        return acc
    if batch_dependent(orig) and len(set(names)) > 1:
        return add(orig.name, "concat", fetched(names), {"axis": 0}, orig)
    return add(orig.name, "scale", fetched(names[:1]), {"factor": 1.0}, orig)
