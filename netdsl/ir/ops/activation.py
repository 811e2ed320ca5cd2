"""Element-wise activations and dropout."""
from netdsl.ir.ops._util import need_float
from netdsl.ir.registry import Arg, OpDef, register


def _same(op):
    def shape(ins, a):
        need_float(ins[0], op)
        return ins[0]
    return shape


def _per_elem(k):
    return lambda ins, out, a: k * out.numel()


# name, FLOPs per element, what backward retains, extra attributes
_ACTS = (
    ("relu", 1, ("output",), ()),
    ("leaky_relu", 2, ("inputs",), (Arg("slope", "float", 0.01),)),
    ("gelu", 20, ("inputs",), ()),  # tanh approximation-free erf form; cost is nominal
    ("sigmoid", 4, ("output",), ()),
    ("tanh", 4, ("output",), ()),
)
for _name, _k, _ret, _extra in _ACTS:
    register(OpDef(_name, (Arg("x", "tensor"),) + _extra, _same(_name), "activation",
                   flops=_per_elem(_k), retains=_ret, doc=f"element-wise {_name}"))

register(OpDef(
    "dropout", (Arg("x", "tensor"), Arg("p", "float", 0.5)), _same("dropout"), "dropout",
    flops=_per_elem(2), retains=("mask",),
    doc="inverted dropout: zero with probability p in training, identity in evaluation"))
