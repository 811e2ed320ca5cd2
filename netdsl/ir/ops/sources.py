"""Source nodes: network inputs, trainable parameters and buffers."""
from netdsl.ir.opdef import Arg, OpDef, register
from netdsl.ir.types import TensorType


def _from_attrs(_ins, attrs) -> TensorType:
    return TensorType(tuple(attrs["shape"]), attrs.get("dtype", "f32"))


for _name, _lt in (("input", "input"), ("param", "param"), ("buffer", "param")):
    register(OpDef(_name, (Arg("shape", "shape"),), _from_attrs, _lt, differentiable=False,
                   doc=f"a {_name} value (no computation)"))
