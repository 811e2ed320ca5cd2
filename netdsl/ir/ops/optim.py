"""Optimizer update operators (emitted by netdsl.passes.optimizer).

Every update node is in place: its kernel writes into the storage of the inputs listed in
`OpDef.writes` (the parameter and its optimizer state, all persistent) and its
value is the updated parameter itself, so it costs no memory of its own. Semantics follow
PyTorch's torch.optim.SGD / Adam / AdamW (dampening 0, amsgrad off, maximize off).
"""

import functools

import numpy as np

from netdsl.errors import ShapeError
from netdsl.ir.ops._util import fused_kernels
from netdsl.ir.registry import Arg, OpDef, kernel, register


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
    differentiable=False, writes=(0, 3), view_of=0, extra={"fused_kernels": True},
    doc="p -= lr * g (with L2 weight decay, momentum and Nesterov as in torch.optim.SGD)"))

register(OpDef(
    "adam_update",
    (Arg("param", "tensor"), Arg("grad", "tensor"), Arg("lr", "tensor"), Arg("exp_avg", "tensor"),
     Arg("exp_avg_sq", "tensor"), Arg("step", "tensor"), Arg("beta1", "float", 0.9),
     Arg("beta2", "float", 0.999), Arg("eps", "float", 1e-8), Arg("weight_decay", "float", 0.0),
     Arg("decoupled", "bool", False)),
    _like_param("adam_update"), "optimizer", flops=lambda ins, out, a: 12 * out.numel(),
    differentiable=False, writes=(0, 3, 4), view_of=0, extra={"fused_kernels": True},
    doc="Adam (decoupled=false: L2 decay in the gradient) or AdamW (decoupled=true)"))


def _step_shape(ins, a):
    (s,) = ins
    if s.shape != ():
        raise ShapeError(f"step_increment expects a scalar step counter, got {s}")
    return s


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
    Python numbers). One step's parameters share them: cached, not rebuilt per tensor
    (transformer-tiny's 30 updates took 0.52 ms with them rebuilt, 0.32 ms cached:
    bench/refs/netdsl_step.py --profile)."""
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


@kernel("step_increment")
def _step(xp, ins, a, ctx):
    s = ins[0]
    s += 1
    return s


