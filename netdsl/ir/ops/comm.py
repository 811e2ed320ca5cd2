"""Communication between devices: `send`, `recv` and the collectives `all_reduce`,
`all_gather` and `reduce_scatter`. Split passes emit them; autodiff differentiates
through them like any other op, so a split forward graph gets its backward
communication from the gradient rules.

- `send(x, peer, tag)` runs on the sender: its value is the message buffer (a copy of x,
  counted on the sender until the receiver has it). `recv(m, peer, tag)` runs on the
  receiver and reads the send node; its value lives on the receiver. `tag` pairs them
  when several messages go between the same two ranks.
- A collective over a group of devices is one node per member: member `index` runs on
  device `group[index]`, names every member's input (so each member comes after all of
  them in any order of the graph) and produces that member's result. Members carry
  `meta["members"]`, the names of all of them, and the split passes keep them adjacent
  in the node order, so every rank enters its collectives in the same order.
  `all_reduce` sums; `all_gather` concatenates along `axis`; `reduce_scatter` sums and
  keeps member `index`'s part along `axis` (parts of `sizes`).

The kernels hand the work to the run's communicator (`ctx.comm`): in one process it moves
the data between the devices' buffers, over MPI it sends it; both count the bytes each
rank sent, which is what `netdsl split` reports. Gradients: send and recv swap; the
transpose of all_reduce is all_reduce, of all_gather reduce_scatter, and back.
"""
from __future__ import annotations

from netdsl.errors import ShapeError
from netdsl.ir.opdef import ANY_DEVICE, Arg, OpDef, grad_rule, kernel, register
from netdsl.ir.ops._util import norm_axis
from netdsl.ir.types import TensorType

COMM_OPS = ("send", "recv", "all_reduce", "all_gather", "reduce_scatter")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
BACKWARD_TAG = 16384  # a gradient's message takes its forward message's tag plus this


def _same(ins, a):
    return ins[0]


def _no_flops(ins, out, a):
    return 0  # no arithmetic worth pricing: the cost model prices the bytes moved


_P2P = (Arg("x", "tensor"), Arg("peer", "int"), Arg("tag", "int", 0))
register(OpDef("send", _P2P, _same, "transfer", flops=_no_flops, reads_reduced=ANY_DEVICE,
               doc="send a value to device `peer` (the value is the message buffer)"))
register(OpDef("recv", _P2P, _same, "transfer", flops=_no_flops, reads_reduced=ANY_DEVICE,
               doc="receive the value a `send` on device `peer` sent"))


def _member(ins, a, op):
    k = a["index"]
    if not 0 <= k < len(ins) or len(ins) != len(a["group"]):
        raise ShapeError(f"{op}: member {k} of a group of {len(a['group'])} devices reads "
                         f"{len(ins)} inputs")
    return ins[k]


def _all_reduce_shape(ins, a):
    me = _member(ins, a, "all_reduce")
    for t in ins:
        if t != me:
            raise ShapeError(f"all_reduce: members hold {t} and {me}; they must agree")
    return me


def _all_gather_shape(ins, a):
    me = _member(ins, a, "all_gather")
    ax = norm_axis(a["axis"], me.rank, "all_gather")
    total = sum(t.shape[ax] for t in ins)
    return TensorType(me.shape[:ax] + (total,) + me.shape[ax + 1:], me.dtype)


def _reduce_scatter_shape(ins, a):
    me = _member(ins, a, "reduce_scatter")
    ax = norm_axis(a["axis"], me.rank, "reduce_scatter")
    sizes = tuple(a["sizes"])
    if len(sizes) != len(ins) or sum(sizes) != me.shape[ax]:
        raise ShapeError(f"reduce_scatter: parts {sizes} do not split axis {ax} of {me}")
    return TensorType(me.shape[:ax] + (sizes[a["index"]],) + me.shape[ax + 1:], me.dtype)


_GROUP = (Arg("xs", "tensors"), Arg("group", "ints"), Arg("index", "int"))
register(OpDef("all_reduce", _GROUP, _all_reduce_shape, "transfer", flops=_no_flops,
               doc="sum over a group of devices; every member gets the sum"))
register(OpDef("all_gather", _GROUP + (Arg("axis", "axis", 0),), _all_gather_shape,
               "transfer", flops=_no_flops, reads_reduced=ANY_DEVICE,
               doc="concatenate the members' values along `axis`; every member gets it"))
register(OpDef("reduce_scatter", _GROUP + (Arg("axis", "axis", 0), Arg("sizes", "ints")),
               _reduce_scatter_shape, "transfer", flops=_no_flops,
               doc="sum over a group; member k keeps part k along `axis`"))


def comm_bytes(n, nbytes: int) -> int:
    """Bytes node `n`'s device sends, with `nbytes` the bytes of the member's input: the
    lower bound of a ring (what the communicators' ring algorithms send): all_reduce
    2(p-1)/p x S, all_gather and reduce_scatter (p-1)/p x the full value."""
    if n.op == "send":
        return nbytes
    if n.op in COLLECTIVES:
        p = len(n.attrs["group"])
        if n.op == "all_reduce":
            return 2 * (p - 1) * nbytes // p
        if n.op == "all_gather":
            return (p - 1) * nbytes
        return (p - 1) * nbytes // p
    return 0


# -- kernels: the communicator does the work -------------------------------------------
@kernel("send")
def _send(xp, ins, a, ctx):
    return ctx.comm.send(ctx.node, ins[0])


@kernel("recv")
def _recv(xp, ins, a, ctx):
    # over MPI the message comes from another rank: the graph of this rank has no input
    return ctx.comm.recv(ctx.node, ins[0] if ins else None,
                         ctx.dtype_of(ctx.node.type.dtype))


for _op in COLLECTIVES:
    @kernel(_op)
    def _collective(xp, ins, a, ctx):
        return ctx.comm.collective(ctx.node, ins)


# -- gradients ---------------------------------------------------------------------------
@grad_rule("send")
def _send_rule(n, b, gy):
    return [gy]  # recv's rule brought the gradient back to the sender already


@grad_rule("recv")
def _recv_rule(n, b, gy):
    src = b.g[n.inputs[0]].device
    tag = BACKWARD_TAG + n.attrs["tag"]  # the upper half of the tags: backward messages
    back = b.emit("send", [gy], {"peer": src, "tag": tag}, tag="send", device=n.device)
    return [b.emit("recv", [back], {"peer": n.device, "tag": tag}, tag="recv", device=src)]


def _collective_rule(transpose: str):
    def rule(n, b, gy):
        members = n.meta["members"]
        key = ("collective", members)
        if key not in b.memo:  # the first member visited emits the whole backward group
            gys = []
            for m in members:
                gm = b.grad_total(m)
                if gm is None:
                    t = b.g[m].type
                    gm = b.emit("fill", [], {"shape": t.shape, "value": 0.0, "dtype": t.dtype},
                                tag="zero", device=b.g[m].device)
                gys.append(gm)
            attrs = {"group": n.attrs["group"]}
            if transpose != "all_reduce":
                attrs["axis"] = n.attrs["axis"]
            if transpose == "reduce_scatter":
                ax = n.attrs["axis"]
                attrs["sizes"] = tuple(b.g[i].type.shape[ax] for i in n.inputs)
            names = [b.g.fresh_name(f"{m}.grad.{transpose}") for m in members]
            b.emit_group(transpose, gys, attrs, names, [b.g[m].device for m in members])
            b.memo[key] = names
            # input j's whole gradient is backward member j: given once, by the first
            # member whose rule runs (a member no reader differentiates is skipped)
            return list(names)
        return [None] * len(n.inputs)
    return rule


grad_rule("all_reduce")(_collective_rule("all_reduce"))
grad_rule("all_gather")(_collective_rule("reduce_scatter"))
grad_rule("reduce_scatter")(_collective_rule("all_gather"))
