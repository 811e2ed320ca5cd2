"""Adding a source-level operator to a graph: the node (through `rewrite.make_node`, the
one node factory) plus the parameter and buffer nodes it owns. Used by the front end, one
call per op in the source.
"""
from __future__ import annotations

from netdsl.ir import registry
from netdsl.ir.graph import Graph, Node
from netdsl.ir.rewrite import make_node
from netdsl.ir.types import TensorType


def add_op(g: Graph, name: str, op_name: str, inputs: list[str], attrs: dict,
           **node_fields) -> Node:
    """Append `op_name(inputs)` as node `name`, with its parameters as `name.<param>` nodes.

    Raises ShapeError (with `{arg}` placeholders naming tensor arguments) if the shape rule
    rejects the inputs; nothing is added to the graph in that case.
    """
    op = registry.get(op_name)
    node = make_node(g, name, op_name, inputs, attrs, **node_fields)  # checks the shapes
    specs = op.params([g[i].type for i in inputs], node.attrs)
    param_names = []
    for pname, spec in specs.items():
        pnode = Node(f"{name}.{pname}", "buffer" if spec.buffer else "param", (),
                     TensorType(spec.shape, spec.dtype),
                     _param_attrs(spec),
                     loc=node_fields.get("loc"), stack=node_fields.get("stack", ()),
                     scope=node_fields.get("scope", ()),
                     annotations=dict(node_fields.get("annotations", {})))
        g.add(pnode)
        param_names.append(pnode.name)
    node.inputs = tuple(inputs) + tuple(param_names)
    return g.add(node)


def _param_attrs(spec: registry.ParamSpec) -> dict:
    attrs = {"shape": spec.shape, "init": spec.init}
    if spec.init in ("kaiming_normal", "kaiming_uniform", "uniform_fan_in"):
        attrs["fan_in"] = spec.fan_in  # the only inits that depend on it
    if spec.init == "constant":
        attrs["value"] = spec.value
    return attrs
