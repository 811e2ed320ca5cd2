"""Adding operator nodes to a graph: attribute normalisation, shape rule, parameters.

Used by the front end (one call per op in the source) and by passes that emit new nodes
(autodiff, optimizer updates), so every node is made the same way.
"""
from __future__ import annotations

from netdsl.errors import ShapeError
from netdsl.ir import registry
from netdsl.ir.graph import Graph, Node
from netdsl.ir.ops._util import pair
from netdsl.ir.types import TensorType


def normalise_attrs(op: registry.OpDef, attrs: dict) -> dict:
    """Fill defaults and canonicalise (pairs become 2-tuples) in signature order."""
    out = {}
    for a in op.attr_args:
        if a.name in attrs:
            v = attrs[a.name]
        elif a.required:
            raise ShapeError(f"{op.name}: missing argument `{a.name}`")
        else:
            v = a.default
        if a.kind == "pair" and v is not None:
            v = pair(v)
        elif a.kind in ("ints", "shape") and isinstance(v, list):
            v = tuple(v)
        elif a.kind == "float" and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        out[a.name] = v
    # an argument that defaults to another (pooling's stride = its kernel) is resolved
    # here, so the IR never holds a `none` a pass or kernel must reinterpret
    for name, source in op.extra.get("default_from", {}).items():
        if out.get(name) is None:
            out[name] = out[source]
    return out


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
    attrs = normalise_attrs(op, attrs)
    in_types = [g[i].type for i in inputs]
    _check_float_dtypes(op, inputs, in_types)
    out_type = op.shape(in_types, attrs)
    specs = op.params(in_types, attrs)
    for t in [out_type] + [TensorType(s.shape, s.dtype) for s in specs.values()]:
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
        pnode = Node(f"{name}.{pname}", "buffer" if spec.buffer else "param", (),
                     TensorType(spec.shape, spec.dtype),
                     _param_attrs(spec),
                     loc=node_fields.get("loc"), stack=node_fields.get("stack", ()),
                     scope=node_fields.get("scope", ()),
                     annotations=dict(node_fields.get("annotations", {})))
        g.add(pnode)
        param_names.append(pnode.name)
    return g.add(Node(name, op_name, tuple(inputs) + tuple(param_names), out_type, attrs,
                      **node_fields))


def _check_float_dtypes(op: registry.OpDef, inputs, in_types) -> None:
    """The dtype rule: an operator's floating-point tensor arguments share one dtype. There
    is no implicit promotion (PyTorch's f32 @ f64 is an error too); a mix is a mistake
    in the program, reported here for every operator rather than in each shape rule."""
    floats = [(i, t) for i, t in enumerate(in_types[:op.n_tensor_inputs(len(in_types))])
              if t.is_float]
    for i, t in floats[1:]:
        j, first = floats[0]
        if t.dtype != first.dtype:
            names = [a.name for a in op.tensor_args]
            variadic = op.signature and op.signature[0].kind == "tensors"

            def arg(k):
                return f"input {k + 1}" if variadic or k >= len(names) else f"{{{names[k]}}}"
            raise ShapeError(f"{op.name}: floating-point dtypes differ: {arg(j)} is {first} "
                             f"and {arg(i)} is {t}; netdsl does not promote implicitly, so "
                             "declare these inputs with one dtype")


def _param_attrs(spec: registry.ParamSpec) -> dict:
    attrs = {"shape": spec.shape, "init": spec.init}
    if spec.init in ("kaiming_normal", "kaiming_uniform", "uniform_fan_in"):
        attrs["fan_in"] = spec.fan_in  # the only inits that depend on it
    return attrs
