"""Optimizer update operators (emitted by netdsl.passes.optimizer).

Every update node is in place: its kernel writes into the storage of the inputs listed in
`OpDef.writes` (the parameter and its optimizer state, all persistent) and its
value is the updated parameter itself, so it costs no memory of its own. Semantics follow
PyTorch's torch.optim.SGD / Adam / AdamW (dampening 0, amsgrad off, maximize off).

`sgd_update_group` and `adam_update_group` are many parameters' updates as one node
(netdsl.passes.optimizer.group_updates): the inputs the updates share (the learning rate,
Adam's step counter) once, then each parameter's own inputs, `arity` of them, in the
single update's order. Each parameter is updated exactly as its own node would update it;
the group saves the per-node work of the executor and, on a GPU, runs as one launch (the
CUDA kernels take tables of pointers) instead of one a parameter, which on a deep network
is a noticeable part of a host-bound step.
"""

import functools

import numpy as np

from netdsl.errors import ShapeError
from netdsl.ir.opdef import OPS, Arg, OpDef, kernel, register
from netdsl.ir.ops._util import fused_kernels
from netdsl.ir.types import TensorType


def _like_param(op):
    def shape(ins, a):
        p, g = ins[0], ins[1]
        if p.shape != g.shape:
            raise ShapeError(f"{op}: gradient {g} does not match parameter {p}")
        return p
    return shape


register(OpDef(
    "sgd_update",
    (Arg("param", "tensor"), Arg("grad", "tensor"), Arg("lr", "tensor"),
     Arg("momentum_buffer", "tensor", None), Arg("momentum", "float", 0.0),
     Arg("nesterov", "bool", False), Arg("weight_decay", "float", 0.0)),
    _like_param("sgd_update"), "optimizer", flops=lambda ins, out, a: 4 * out.numel(),
    differentiable=False, writes=(0, 3), view_of=0, extra={"fused_kernels": ("optimizer",)},
    doc="p -= lr * g (with L2 weight decay, momentum and Nesterov as in torch.optim.SGD)"))

register(OpDef(
    "adam_update",
    (Arg("param", "tensor"), Arg("grad", "tensor"), Arg("lr", "tensor"), Arg("exp_avg", "tensor"),
     Arg("exp_avg_sq", "tensor"), Arg("step", "tensor"), Arg("beta1", "float", 0.9),
     Arg("beta2", "float", 0.999), Arg("eps", "float", 1e-8), Arg("weight_decay", "float", 0.0),
     Arg("decoupled", "bool", False)),
    _like_param("adam_update"), "optimizer", flops=lambda ins, out, a: 12 * out.numel(),
    differentiable=False, writes=(0, 3, 4), view_of=0, extra={"fused_kernels": ("optimizer",)},
    doc="Adam (decoupled=false: L2 decay in the gradient) or AdamW (decoupled=true)"))


# a group's shared inputs: the single update's tensor arguments taken once (by position)
GROUP_SHARED = {"sgd_update": (2,), "adam_update": (2, 5)}


def group_op(base: str) -> str:
    return f"{base}_group"


def _member_positions(base: str) -> tuple[int, ...]:
    """The single update's tensor argument positions a group member supplies, in order."""
    n = len(OPS[base].tensor_args)
    return tuple(i for i in range(n) if i not in GROUP_SHARED[base])


def member_inputs(base: str, inputs) -> list:
    """A single update node's own inputs (those a group member supplies), in order."""
    return [inputs[i] for i in _member_positions(base) if i < len(inputs)]


def group_members(base: str, ins, arity: int, rows=()) -> tuple[list, list[list]]:
    """(the shared inputs, each member's inputs) of a group node's inputs (arrays or
    types). `rows`: the group's `grad_rows`; a member's gradient given as a row of a
    matrix (batchnorm's weight and bias gradients, rows of its backward statistics) is
    taken out here: the row of an array, the row's type of a type."""
    k = len(GROUP_SHARED[base])
    ms = [list(ins[i:i + arity]) for i in range(k, len(ins), arity)]
    for m, r in zip(ms, rows, strict=False):
        if r >= 0:
            g = m[1]
            m[1] = TensorType(tuple(g.shape[1:]), g.dtype) if isinstance(g, TensorType) \
                else g[r]
    return list(ins[:k]), ms


def base_inputs(base: str, shared, member) -> list:
    """A member's inputs in the single update's order (optional trailing ones absent)."""
    out: dict[int, object] = dict(zip(GROUP_SHARED[base], shared, strict=True))
    out.update(zip(_member_positions(base), member, strict=False))
    return [out[i] for i in range(len(out))]


def _register_group(base: str) -> None:
    single = OPS[base]
    name = group_op(base)
    where = _member_positions(base)
    own_writes = [where.index(w) for w in single.writes if w in where]  # member positions

    def members(ins, a):
        arity, k, rows = a["arity"], len(GROUP_SHARED[base]), a["grad_rows"]
        if not 2 <= arity <= len(where) or len(ins) <= k or (len(ins) - k) % arity:
            raise ShapeError(f"{name}: {len(ins)} inputs are not {k} shared ones and "
                             f"members of {arity}")
        if rows and len(rows) != (len(ins) - k) // arity:
            raise ShapeError(f"{name}: {len(rows)} grad_rows for "
                             f"{(len(ins) - k) // arity} members")
        for j, r in enumerate(rows):
            g = ins[k + j * arity + 1]
            if r >= 0 and (g.rank != 2 or r >= g.shape[0]):
                raise ShapeError(f"{name}: member {j + 1}'s gradient {g} has no row {r}")
        return group_members(base, ins, arity, rows)

    def shape(ins, a):
        shared, ms = members(ins, a)
        for m in ms:
            single.shape(base_inputs(base, shared, m), a)
        return ms[0][0]

    def writes(node):
        arity, k = node.attrs["arity"], len(GROUP_SHARED[base])
        return tuple(k + j * arity + w for j in range((len(node.inputs) - k) // arity)
                     for w in own_writes if w < arity)

    def flops(ins, out, a):
        shared, ms = members(ins, a)
        return sum(single.flops(base_inputs(base, shared, m), m[0], a) for m in ms)

    register(OpDef(
        name, (Arg("inputs", "tensors"), *single.attr_args, Arg("arity", "int"),
               Arg("grad_rows", "ints", ())), shape,
        "optimizer", flops=flops, differentiable=False, writes=writes,
        view_of=len(GROUP_SHARED[base]), extra={"fused_kernels": ("optimizer",)},
        doc=f"{base} on many parameters at once: the shared inputs once, then each "
            f"parameter's own `arity` inputs (a gradient given as row grad_rows[k] of a "
            f"matrix where that is >= 0)"))


_register_group("sgd_update")
_register_group("adam_update")


def _step_shape(ins, a):
    (s,) = ins
    if s.shape != ():
        raise ShapeError(f"step_increment expects a scalar step counter, got {s}")
    return s


def _sumsq_shape(ins, a):
    if not ins:
        raise ShapeError("grad_sumsq: no gradients")
    dtypes = {t.dtype for t in ins}
    if len(dtypes) > 1:
        raise ShapeError(f"grad_sumsq: the gradients' dtypes differ ({sorted(dtypes)})")
    return TensorType((), ins[0].dtype)


def _clip_factor_shape(ins, a):
    (s,) = ins
    if s.shape != ():
        raise ShapeError(f"clip_factor expects a scalar sum of squares, got {s}")
    return s


# gradient clipping by the global norm (netdsl.passes.optimizer): the squares summed per
# device, over the devices (an all_reduce), then the factor torch.nn.utils.clip_grad_norm_
# scales the gradients by
register(OpDef(
    "grad_sumsq", (Arg("grads", "tensors"),), _sumsq_shape, "optimizer",
    flops=lambda ins, out, a: 2 * sum(t.numel() for t in ins), differentiable=False,
    doc="the sum of the squares of every element of the gradients (a scalar)"))
register(OpDef(
    "clip_factor", (Arg("sumsq", "tensor"), Arg("max_norm", "float")), _clip_factor_shape,
    "optimizer", flops=lambda ins, out, a: 4, differentiable=False,
    doc="min(1, max_norm / (sqrt(sumsq) + 1e-6)): the global-norm clipping factor"))


register(OpDef("step_increment", (Arg("step", "tensor"),), _step_shape, "optimizer",
               differentiable=False, writes=(0,), view_of=0,
               doc="add one to the optimizer's step counter (in place)"))


@kernel("sgd_update")
def _sgd(xp, ins, a, ctx):
    p, g, lr = ins[0], ins[1], ins[2]
    lr = lr.astype(p.dtype, copy=False)
    buf = ins[3] if a["momentum"] else p  # (not read without momentum)
    f = fused_kernels(ctx, p, g, buf, cuda=True)
    if f is not None and p.dtype == g.dtype == buf.dtype:  # one pass, bit for bit this code
        t = p.dtype.type
        f.sgd_update(p.reshape(-1), g.reshape(-1), buf.reshape(-1),
                     lr if getattr(f, "scalars_on_device", False) else t(lr),
                     t(a["momentum"]), t(a["weight_decay"]), bool(a["nesterov"]))
        return p
    if a["weight_decay"]:
        g = g + a["weight_decay"] * p
    if a["momentum"]:
        buf = ins[3]
        buf *= a["momentum"]  # the zero-initialised buffer makes step 1 give buf = g
        buf += g
        g = g + a["momentum"] * buf if a["nesterov"] else buf
    p -= lr * g
    return p


@functools.lru_cache(maxsize=64)
def _adam_scalars(dtype, lr, step, b1, b2, eps, wd, decoupled):
    """The fused Adam loop's scalars in the parameter's dtype, rounded as the NumPy code
    below rounds them (0-d arrays of that dtype; lr and step hold their values exactly as
    Python numbers). One step's parameters share them: cached, not rebuilt per tensor,
    since building them costs about as much as a small tensor's update."""
    t = np.dtype(dtype).type
    lr, n = np.asarray(lr).astype(dtype), np.asarray(step).astype(dtype)
    decoupled = bool(wd) and decoupled
    return (t(1.0 - lr * wd) if decoupled else t(1), t(0 if decoupled else wd), t(b1),
            t(1.0 - b1), t(b2), t(1.0 - b2), t(lr / (1.0 - b1 ** n)),
            t(np.sqrt(1.0 - b2 ** n)), t(eps))


@kernel("adam_update")
def _adam(xp, ins, a, ctx):
    p, g, lr, m, v, step = ins
    b1, b2 = a["beta1"], a["beta2"]
    f = fused_kernels(ctx, p, g, m, v, cuda=True)
    if f is not None and getattr(f, "scalars_on_device", False):
        if p.dtype == g.dtype == m.dtype == v.dtype and step.dtype == np.int64:
            # CUDA: one launch, lr and the step counter read on the device
            f.adam_update_device(p.reshape(-1), g.reshape(-1), m.reshape(-1), v.reshape(-1),
                                 lr.astype(p.dtype, copy=False), step, b1, b2, a["eps"],
                                 a["weight_decay"], bool(a["decoupled"]))
            return p
        f = None
    if f is not None and p.dtype == g.dtype == m.dtype == v.dtype:
        # one pass, bit for bit the code below (its scalars as NumPy rounds them)
        f.adam_update(p.reshape(-1), g.reshape(-1), m.reshape(-1), v.reshape(-1),
                      *_adam_scalars(p.dtype.str, float(lr), int(step), b1, b2, a["eps"],
                                     a["weight_decay"], bool(a["decoupled"])))
        return p
    lr = lr.astype(p.dtype)
    if a["weight_decay"]:
        if a["decoupled"]:
            p *= 1.0 - lr * a["weight_decay"]
        else:
            g = g + a["weight_decay"] * p
    m *= b1
    m += (1.0 - b1) * g
    v *= b2
    v += (1.0 - b2) * (g * g)
    t = step.astype(p.dtype)
    bc1 = 1.0 - b1 ** t
    bc2_sqrt = xp.sqrt(1.0 - b2 ** t)
    p -= (lr / bc1) * (m / (xp.sqrt(v) / bc2_sqrt + a["eps"]))
    return p


def _group_fused(ctx, arrays: list):
    """(the fused kernels, the arrays flattened) where the kernels take them all, or
    (None, None). The fused kernels' own check (written for a few arrays: its `dtype in`
    two types is the slow part) asked once; then each array's type, dtype and layout
    against the first's: a group can hold a thousand arrays."""
    f = fused_kernels(ctx, arrays[0], cuda=True)
    if f is None:
        return None, None
    t, d = type(arrays[0]), arrays[0].dtype
    for x in arrays:
        if type(x) is not t or x.dtype != d or not x.flags.c_contiguous or not x.size:
            return None, None
    return f, [x.ravel() for x in arrays]


@kernel("sgd_update_group")
def _sgd_group(xp, ins, a, ctx):
    (lr,), ms = group_members("sgd_update", ins, a["arity"], a["grad_rows"])
    f, flat = _group_fused(ctx, [x for m in ms for x in m])
    if f is not None:  # as _sgd's fused call, a member at a time
        t = ms[0][0].dtype.type
        lr = lr.astype(ms[0][0].dtype, copy=False)
        arity = a["arity"]
        ps, gs = flat[0::arity], flat[1::arity]
        f.sgd_update_many(ps, gs, flat[2::arity] if a["momentum"] else ps,
                          lr if getattr(f, "scalars_on_device", False) else t(lr),
                          t(a["momentum"]), t(a["weight_decay"]), bool(a["nesterov"]))
    else:
        for m in ms:
            _sgd(xp, base_inputs("sgd_update", [lr], m), a, ctx)
    return ms[0][0]


@kernel("adam_update_group")
def _adam_group(xp, ins, a, ctx):
    (lr, step), ms = group_members("adam_update", ins, a["arity"], a["grad_rows"])
    f, flat = _group_fused(ctx, [x for m in ms for x in m])
    if f is not None:  # as _adam's fused calls, a member at a time
        each = (flat[0::4], flat[1::4], flat[2::4], flat[3::4])
        if not getattr(f, "scalars_on_device", False):
            f.adam_update_many(*each, *_adam_scalars(
                ms[0][0].dtype.str, float(lr), int(step), a["beta1"], a["beta2"], a["eps"],
                a["weight_decay"], bool(a["decoupled"])))
            return ms[0][0]
        if step.dtype == np.int64:
            f.adam_update_many_device(*each, lr.astype(ms[0][0].dtype, copy=False), step,
                                      a["beta1"], a["beta2"], a["eps"], a["weight_decay"],
                                      bool(a["decoupled"]))
            return ms[0][0]
    for m in ms:
        _adam(xp, base_inputs("adam_update", [lr, step], m), a, ctx)
    return ms[0][0]


@kernel("grad_sumsq")
def _grad_sumsq(xp, ins, a, ctx):
    total = None
    for g in ins:  # each a dot product of its flat view: no temporary the gradient's size
        if g.flags.c_contiguous:
            flat = g.reshape(-1)
            s = xp.dot(flat, flat)
        else:  # (a strided view, which reshape would copy: einsum reads it in place)
            idx = "abcdefghijklmnop"[:g.ndim]
            s = xp.einsum(f"{idx},{idx}->", g, g)
        total = s if total is None else total + s
    return xp.asarray(total, dtype=ins[0].dtype)


@kernel("clip_factor")
def _clip_factor(xp, ins, a, ctx):
    s = ins[0]  # (kept on the device: no host read inside a step)
    return xp.asarray(xp.minimum(a["max_norm"] / (xp.sqrt(s) + 1e-6), 1.0), dtype=s.dtype)


@kernel("step_increment")
def _step(xp, ins, a, ctx):
    s = ins[0]
    s += 1
    return s


