"""`netdsl export --half`: the exported model with float16 in place of float32.

A trained model's weights are its f32 master weights (a mixed-precision run keeps them
so); `--half` writes them, and every float the model computes, as float16: the inputs
and outputs, the Constant nodes (in the blocks' functions too), and Casts to float. A
Resize keeps its scales (and region) in float32, which ONNX requires. The model is then
checked as any export is (shape inference, onnx.checker), and runs where float16 kernels
do (a GPU's runtime; onnx's reference evaluator).
"""
from __future__ import annotations

import numpy as np

# Resize's inputs that ONNX types as float32 whatever the data: roi (1) and scales (2)
_FLOAT32_INPUTS = {"Resize": (1, 2)}


def to_half(onnx, model) -> None:
    """Make `model` (a ModelProto, its initializers already float16) compute in float16."""
    f32, f16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    bodies = [model.graph.node] + [f.node for f in model.functions]
    keep = {node.input[k] for body in bodies for node in body
            for k in _FLOAT32_INPUTS.get(node.op_type, ()) if k < len(node.input)}
    for body in bodies:
        for node in body:
            if node.op_type == "Constant" and node.output[0] not in keep:
                for att in node.attribute:
                    if att.name == "value" and att.t.data_type == f32:
                        arr = onnx.numpy_helper.to_array(att.t).astype(np.float16)
                        att.t.CopyFrom(onnx.numpy_helper.from_array(arr, att.t.name))
            elif node.op_type == "Cast":
                for att in node.attribute:
                    if att.name == "to" and att.i == f32:
                        att.i = f16
    g = model.graph
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.tensor_type.elem_type == f32:
            vi.type.tensor_type.elem_type = f16


def half_weight(name: str, arr: np.ndarray) -> np.ndarray:
    """A weight as `--half` writes it: floats in float16; one beyond float16's range (it
    would hold inf) is refused, naming it."""
    if arr.dtype.kind != "f":
        return arr
    with np.errstate(over="ignore"):
        half = arr.astype(np.float16)
    if not np.isfinite(half).all() and np.isfinite(arr).all():
        from netdsl.errors import InteropError
        raise InteropError(f"weight `{name}` holds values beyond float16's range (largest "
                           f"|w| {float(np.abs(arr).max()):.4g}, float16's 65504): export it "
                           "without --half (float32 weights)")
    return half
