"""Element-wise arithmetic beyond add/sub/mul: unary math (sqrt, exp, log, abs, neg),
div, pow, maximum, minimum, comparisons, where and cast (ONNX / PyTorch semantics).

Binary operators broadcast like NumPy; their gradients are summed back to each operand's
shape (`unbroadcast`). Scalar constants in expressions (`x - 1`, `h ** 2`) reach these
operators as a `fill` node of shape () (see netdsl.frontend.tensor_arith).
"""
from netdsl.errors import ShapeError
from netdsl.ir.opdef import ANY_DEVICE, Arg, OpDef, grad_rule, kernel, register
from netdsl.ir.ops._unary import unary
from netdsl.ir.ops._util import broadcast, need_float
from netdsl.ir.ops.elementwise import unbroadcast
from netdsl.ir.types import DTYPES, TensorType

# -- unary math ---------------------------------------------------------------------------
unary("sqrt", lambda xp, x, a: xp.sqrt(x), lambda xp, y, a: 0.5 / y, reads="output",
      scratch=(0, 1), layer_type="elementwise", doc="element-wise square root")
unary("exp", lambda xp, x, a: xp.exp(x), lambda xp, y, a: y, reads="output",
      layer_type="elementwise", doc="element-wise e ** x", precision="f32")
unary("log", lambda xp, x, a: xp.log(x), lambda xp, x, a: 1.0 / x,
      scratch=(0, 1), layer_type="elementwise", doc="element-wise natural logarithm")
unary("abs", lambda xp, x, a: xp.abs(x), lambda xp, x, a: xp.sign(x),
      scratch=(0, 1), layer_type="elementwise",
      doc="element-wise |x| (gradient 0 at 0, like torch)")


def _same_float(op):
    def shape(ins, a):
        need_float(ins[0], op)
        return ins[0]
    return shape


register(OpDef("neg", (Arg("x", "tensor"),), _same_float("neg"), "elementwise",
               flops=lambda ins, out, a: out.numel(), doc="element-wise -x"))


@kernel("neg")
def _neg(xp, ins, a, ctx):
    return -ins[0]


@grad_rule("neg")
def _neg_rule(n, b, gy):
    return [b.emit("neg", [gy])]


# -- binary ----------------------------------------------------------------------------------
def _binary_float(op):
    def shape(ins, a):
        x, y = ins
        if x.dtype != y.dtype:
            raise ShapeError(f"{op}: dtypes differ: {{a}} is {x} and {{b}} is {y}")
        need_float(x, op, "a")
        return TensorType(broadcast(x, y, op), x.dtype)
    return shape


_AB = (Arg("a", "tensor"), Arg("b", "tensor"))
register(OpDef("div", _AB, _binary_float("div"), "elementwise",
               flops=lambda ins, out, a: out.numel(), retains=("input1", "output"),
               doc="element-wise a / b with NumPy broadcasting"))
register(OpDef("pow", _AB, _binary_float("pow"), "elementwise",
               flops=lambda ins, out, a: 10 * out.numel(), retains=("inputs", "output"),
               doc="element-wise a ** b with NumPy broadcasting", precision="f32"))
for _name in ("maximum", "minimum"):
    register(OpDef(_name, _AB, _binary_float(_name), "elementwise",
                   flops=lambda ins, out, a: out.numel(), retains=("inputs",),
                   doc=f"element-wise {_name} of a and b (ties share the gradient equally)"))


def _grad_like(k):
    """Backward ops whose result has the (broadcast) shape of the forward output."""
    def shape(ins, a):
        return TensorType(ins[0].shape, ins[0].dtype)
    return shape


register(OpDef("pow_grad_base", (Arg("dy", "tensor"), Arg("a", "tensor"), Arg("b", "tensor")),
               _grad_like(0), "backward", flops=lambda ins, out, a: 12 * out.numel(),
               differentiable=False, doc="dy * b * a ** (b - 1) (0 where b == 0)"))
register(OpDef("pow_grad_exponent",
               (Arg("dy", "tensor"), Arg("a", "tensor"), Arg("y", "tensor")),
               _grad_like(0), "backward", flops=lambda ins, out, a: 12 * out.numel(),
               differentiable=False, doc="dy * a ** b * log(a) (0 where a == 0 and b >= 0)"))
register(OpDef("minmax_grad", (Arg("dy", "tensor"), Arg("a", "tensor"), Arg("b", "tensor"),
                               Arg("mode", "str", choices=("maximum", "minimum")),
                               Arg("operand", "int")),
               _grad_like(0), "backward", flops=lambda ins, out, a: 3 * out.numel(),
               differentiable=False,
               doc="dy where operand `operand` wins, dy / 2 on ties, 0 elsewhere"))


@kernel("div")
def _div(xp, ins, a, ctx):
    return ins[0] / ins[1]


@kernel("pow")
def _pow(xp, ins, a, ctx):
    return xp.power(ins[0], ins[1])


@kernel("maximum")
def _maximum(xp, ins, a, ctx):
    return xp.maximum(ins[0], ins[1])


@kernel("minimum")
def _minimum(xp, ins, a, ctx):
    return xp.minimum(ins[0], ins[1])


@kernel("pow_grad_base")
def _pow_gb(xp, ins, a, ctx):
    dy, x, e = ins
    g = dy * e * xp.power(x, e - 1.0)
    return xp.where(e == 0, 0.0, g).astype(dy.dtype)  # torch: zero for a zero exponent


@kernel("pow_grad_exponent")
def _pow_ge(xp, ins, a, ctx):
    dy, x, y = ins
    with _quiet(xp):
        g = dy * y * xp.log(x)
    return xp.where(x == 0, 0.0, g).astype(dy.dtype)


class _quiet:
    """Silence NumPy's log(0) / log(-x) warnings; the value is masked or is torch's NaN."""

    def __init__(self, xp):
        self.xp, self.old = xp, None

    def __enter__(self):
        if hasattr(self.xp, "seterr"):
            self.old = self.xp.seterr(divide="ignore", invalid="ignore")

    def __exit__(self, *exc):
        if self.old is not None:
            self.xp.seterr(**self.old)


@kernel("minmax_grad")
def _minmax_grad(xp, ins, a, ctx):
    dy, x, y = ins
    mine, other = (x, y) if a["operand"] == 0 else (y, x)
    wins = mine > other if a["mode"] == "maximum" else mine < other
    w = wins.astype(dy.dtype) + 0.5 * (mine == other).astype(dy.dtype)
    return dy * w


@grad_rule("div")
def _div_rule(n, b, gy):
    x, y = n.inputs
    t = b.emit("div", [gy, y], tag="a")  # dy / b, at the output's shape
    db = b.emit("neg", [b.emit("mul", [t, n.name], tag="ty")], tag="b")  # -dy * a / b**2
    return [unbroadcast(b, t, x), unbroadcast(b, db, y)]


@grad_rule("pow")
def _pow_rule(n, b, gy):
    x, y = n.inputs
    da = b.emit("pow_grad_base", [gy, x, y], tag="a")
    db = b.emit("pow_grad_exponent", [gy, x, n.name], tag="b")
    return [unbroadcast(b, da, x), unbroadcast(b, db, y)]


def _minmax_rule(mode):
    def rule(n, b, gy):
        x, y = n.inputs
        return [unbroadcast(b, b.emit("minmax_grad", [gy, x, y], {"mode": mode, "operand": k},
                                      tag="ab"[k]), v) for k, v in enumerate((x, y))]
    return rule


grad_rule("maximum")(_minmax_rule("maximum"))
grad_rule("minimum")(_minmax_rule("minimum"))


# -- comparisons (masks for `where`) ----------------------------------------------------------
def _compare_shape(op):
    def shape(ins, a):
        x, y = ins
        if x.dtype != y.dtype:
            raise ShapeError(f"{op}: dtypes differ: {{a}} is {x} and {{b}} is {y}")
        return TensorType(broadcast(x, y, op), "bool")
    return shape


_COMPARE = {"greater": "greater", "less": "less", "greater_equal": "greater_equal",
            "less_equal": "less_equal", "equal": "equal"}
for _name, _np in _COMPARE.items():
    register(OpDef(_name, _AB, _compare_shape(_name), "elementwise",
                   flops=lambda ins, out, a: out.numel(), differentiable=False,
                   doc=f"element-wise a {_name.replace('_', ' ')} b, a bool mask"))
    kernel(_name)(lambda xp, ins, a, ctx, _f=_np: getattr(xp, _f)(ins[0], ins[1]))


# -- where and cast ---------------------------------------------------------------------------
def _where_shape(ins, a):
    c, x, y = ins
    if c.dtype != "bool":
        raise ShapeError(f"where expects a bool condition, but {{cond}} is {c}")
    if x.dtype != y.dtype:
        raise ShapeError(f"where: dtypes differ: {{a}} is {x} and {{b}} is {y}")
    return TensorType(broadcast(TensorType(broadcast(c, x, "where"), x.dtype), y, "where"),
                      x.dtype)


register(OpDef("where", (Arg("cond", "tensor"), Arg("a", "tensor"), Arg("b", "tensor")),
               _where_shape, "elementwise", flops=lambda ins, out, a: out.numel(),
               retains=("input0",), doc="a where cond is true, else b (broadcasting)"))


@kernel("where")
def _where(xp, ins, a, ctx):
    return xp.where(ins[0], ins[1], ins[2])


@grad_rule("where")
def _where_rule(n, b, gy):
    c, x, y = n.inputs
    zero = b.emit("fill", [], {"shape": (), "value": 0.0, "dtype": b.type(gy).dtype},
                  tag="zero")
    da = b.emit("where", [c, gy, zero], tag="a")
    db = b.emit("where", [c, zero, gy], tag="b")
    return [None, unbroadcast(b, da, x), unbroadcast(b, db, y)]


def _cast_shape(ins, a):
    return TensorType(ins[0].shape, a["dtype"])


register(OpDef("cast", (Arg("x", "tensor"), Arg("dtype", "str", choices=tuple(DTYPES))),
               _cast_shape, "elementwise", flops=lambda ins, out, a: out.numel(),
               reads_reduced=ANY_DEVICE,
               doc="convert to another element type (gradient flows between float types)"))


@kernel("cast")
def _cast(xp, ins, a, ctx):
    return ins[0].astype(ctx.dtype_of(a["dtype"]))


@grad_rule("cast")
def _cast_rule(n, b, gy):
    src = b.type(n.inputs[0]).dtype
    if not (b.type(n.inputs[0]).is_float and n.type.is_float):
        return [None]
    return [b.emit("cast", [gy], {"dtype": src})]
