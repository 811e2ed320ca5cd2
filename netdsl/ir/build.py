"""Adding a source-level operator to a graph: the node (through `rewrite.make_node`) plus
the parameter and buffer nodes it owns (through `rewrite.make_source`). Used by the front end, one
call per op in the source.
"""
from __future__ import annotations

from netdsl.errors import ShapeError
from netdsl.ir import registry
from netdsl.ir.graph import Graph, Node
from netdsl.ir.rewrite import make_node, make_source
from netdsl.ir.types import TensorType


def add_op(g: Graph, name: str, op_name: str, inputs: list[str], attrs: dict,
           shared: dict[str, str] | None = None, **node_fields) -> Node:
    """Append `op_name(inputs)` as node `name`, with its parameters as `name.<param>` nodes.

    `shared` ties parameters: {param: existing param node} uses that node instead of making
    `name.<param>` (weight tying); its shape and dtype must be what the op needs. Autodiff
    sums the gradients of a node's uses, so a tied parameter gets the sum of both.

    Raises ShapeError (with `{arg}` placeholders naming tensor arguments) if the shape rule
    rejects the inputs; nothing is added to the graph in that case.
    """
    op = registry.get(op_name)
    # the node first: make_node checks the shape rule, the dtype rule and the sizes
    node = make_node(g, name, op_name, inputs, attrs, **node_fields)
    specs = op.params([g[i].type for i in inputs], node.attrs)
    if not specs and not shared:  # most ops own no parameters: nothing more to add
        node.inputs = tuple(inputs)
        return g.add(node)
    for t in [TensorType(s.shape, s.dtype) for s in specs.values()]:
        if (why := t.size_error()) is not None:
            raise ShapeError(f"{op.name}: {why}")
    shared = dict(shared or {})
    for pname, pnode_name in shared.items():
        spec = specs.get(pname)
        if spec is None or spec.buffer:
            trainable = [k for k, v in specs.items() if not v.buffer]
            raise ShapeError(f"{op.name} has no parameter `{pname}` to share (its "
                             f"parameters: {', '.join(trainable) or 'none'})")
        want, have = TensorType(spec.shape, spec.dtype), g[pnode_name].type
        if g[pnode_name].op != "param":
            raise ShapeError(f"{op.name}: `{pname}` must be a parameter, but "
                             f"{pnode_name} is computed by {g[pnode_name].op}")
        if have != want:
            raise ShapeError(f"{op.name}: the shared `{pname}` ({pnode_name}) is {have}, but "
                             f"this call needs a {pname} of {want}")
    param_names = []
    for pname, spec in specs.items():
        if pname in shared:
            param_names.append(shared[pname])
            continue
        pnode = make_source(f"{name}.{pname}", "buffer" if spec.buffer else "param",
                            TensorType(spec.shape, spec.dtype), _param_attrs(spec),
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
