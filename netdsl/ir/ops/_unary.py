"""Registering an element-wise unary operator together with its backward operator.

`unary(name, f, df, reads=...)` registers `name(x, attrs...)`, whose kernel is `f(xp, x, a)`,
and `name_grad(dy, v, attrs...)`, whose kernel is `dy * df(xp, v, a)`, where `v` is the
forward input (reads="input") or output (reads="output"), whichever the derivative is
cheaper from. The gradient rule passes the forward node's attributes on unchanged.
A derivative that is a 0/1 window of v (relu6, clip) gives `window(a) -> (lo, hi,
closed)`: the backward kernel is then the fused kernels' one pass where they run.
"""
from __future__ import annotations

from collections.abc import Callable

from netdsl.ir.opdef import Arg, OpDef, grad_rule, kernel, register
from netdsl.ir.ops._util import fused_kernels, grad_shape, need_float, scratch_rule


def unary(name: str, f: Callable, df: Callable, *, reads: str = "input", flops: int = 1,
          attrs: tuple[Arg, ...] = (), layer_type: str = "activation", doc: str = "",
          check: Callable | None = None, scratch: tuple[float, float] = (0, 0),
          window: Callable | None = None, precision: str = "follow",
          output_attrs: tuple[str, ...] = ()) -> None:
    """Register `name` and `name_grad`; `check(x_type, attrs)` may raise ShapeError.
    `scratch`: the temporaries the forward and the backward kernel hold at once besides
    their result, in multiples of the result's float32 bytes (a bool mask is 0.25): their
    workspace rules (tests/test_plan.py measures them with tracemalloc). `precision`: the
    forward op's mixed-precision rule (netdsl.ir.opdef.PRECISIONS); `output_attrs`: the
    attributes its value may hold as they are (under f16 they must be within its range)."""
    def shape(ins, a):
        need_float(ins[0], name)
        if check is not None:
            check(ins[0], a)
        return ins[0]

    register(OpDef(name, (Arg("x", "tensor"),) + attrs, shape, layer_type,
                   flops=lambda ins, out, a: flops * out.numel(),
                   workspace=scratch_rule(scratch[0]),
                   retains=("inputs",) if reads == "input" else ("output",),
                   doc=doc or f"element-wise {name}", precision=precision,
                   extra={"output_attrs": output_attrs} if output_attrs else {}))
    # the backward signature repeats the forward attributes without their defaults
    gattrs = tuple(Arg(x.name, x.kind, x.default, x.choices) for x in attrs)
    register(OpDef(f"{name}_grad", (Arg("dy", "tensor"), Arg("v", "tensor")) + gattrs,
                   grad_shape(f"{name}_grad"), "backward",
                   flops=lambda ins, out, a: (flops + 1) * out.numel(), differentiable=False,
                   workspace=scratch_rule(scratch[1]),
                   extra={"fused_kernels": ("elementwise",) if window is not None else ()},
                   doc=f"backward of {name}: dy * {name}'(x), from the forward {reads}"))

    kernel(name)(lambda xp, ins, a, ctx: f(xp, ins[0], a))

    @kernel(f"{name}_grad")
    def _grad(xp, ins, a, ctx):
        dy, v = ins
        fast = None if window is None else fused_kernels(ctx, dy, v)
        if fast is not None and dy.dtype == v.dtype:  # one pass, bit for bit the product
            lo, hi, closed = window(a)
            out, t = ctx.out_like(dy), dy.dtype.type
            fast.window_grad(dy.reshape(-1), v.reshape(-1), t(lo), t(hi), t(1), closed,
                             out.reshape(-1))
            return out
        return dy * df(xp, v, a)

    @grad_rule(name)
    def _rule(n, b, gy):
        v = n.inputs[0] if reads == "input" else n.name
        return [b.emit(f"{name}_grad", [gy, v], {x.name: n.attrs[x.name] for x in attrs})]
