"""Hand-built graphs for the stats, DOT and CLI tests (no front end needed)."""
from __future__ import annotations

from netdsl.ir.build import add_op
from netdsl.ir.graph import Graph, Node
from netdsl.ir.types import TensorType


def toy(blocks: int = 5) -> Graph:
    """x[N,3,8,8] -> stem (conv3x3 4ch + BN) -> stage of `blocks` copies blk[i] of
    (conv1x1 4ch no bias, relu) -> flatten -> linear 10; labels y -> loss."""
    g = Graph("toy")
    g.add(Node("x", "input", (), TensorType(("N", 3, 8, 8)), {"shape": ("N", 3, 8, 8)}))
    g.add(Node("y", "input", (), TensorType(("N",), "i64"), {"shape": ("N",), "dtype": "i64"}))
    add_op(g, "stem.conv", "conv2d", ["x"], {"out_channels": 4, "kernel": 3, "padding": 1},
           scope=("stem",))
    add_op(g, "stem.bn", "batchnorm", ["stem.conv"], {}, scope=("stem",))
    h = "stem.bn"
    for i in range(blocks):
        s = ("stage", f"blk[{i}]")
        add_op(g, f"stage.blk[{i}].conv", "conv2d", [h],
               {"out_channels": 4, "kernel": 1, "bias": False}, scope=s)
        add_op(g, f"stage.blk[{i}].relu", "relu", [f"stage.blk[{i}].conv"], {}, scope=s)
        h = f"stage.blk[{i}].relu"
    add_op(g, "flat", "flatten", [h], {})
    add_op(g, "fc", "linear", ["flat"], {"out_features": 10})
    add_op(g, "loss", "softmax_cross_entropy", ["fc", "y"], {})
    g.outputs = {"output": ["fc"], "loss": ["loss"]}
    return g.verify()
