"""The graph IR: tensor types, nodes and graphs, the operator registry."""
from netdsl.ir.graph import Graph, Node
from netdsl.ir.registry import OPS, Arg, OpDef, ParamSpec, get, load_all
from netdsl.ir.types import BATCH, TensorType

__all__ = ["BATCH", "OPS", "Arg", "Graph", "Node", "OpDef", "ParamSpec", "TensorType", "get",
           "load_all"]
