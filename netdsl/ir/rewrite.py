"""The rewrite toolkit every pass uses: the node factories, use replacement, cloning, and
splicing new nodes into the schedule.

- `make_node` is the one way to build an operator node: attributes normalised against the
  op's signature, the type from its shape rule, position and block scope inherited from
  the node it stands for (`like`). The front end (`build.add_op`), autodiff, the optimizer
  and the memory rewrites all build nodes through it.
- `make_source` is its counterpart for source nodes (`input`, `param`, `buffer`), which
  have no inputs to type them by: their type is declared, and their attributes are kept
  as given. Between the two, every node a layer makes is built here; the others are
  copies (`Node.copy`, `clone`) and the nodes `serialize` reads back as they were saved.
- `replace_uses` points readers (and output roles) of one value at another.
- `clone` copies a node under a new name, keeping its rng key, so a recomputed copy of a
  random node draws what the original drew.
- `splice` inserts new nodes before or after existing ones in a single pass over the node
  list (a rewrite that adds thousands of nodes stays linear).

A graph's name index follows every change to `graph.nodes` (see `NodeList`), so a rewrite
never has to remember to invalidate it.
"""
from __future__ import annotations

from collections.abc import Iterable

from netdsl.errors import ShapeError
from netdsl.ir import registry
from netdsl.ir.graph import SOURCE_OPS, Graph, Node
from netdsl.ir.ops._util import pair
from netdsl.ir.types import REDUCED_DTYPES, TensorType

# fields a derived node takes from the node it stands for, so errors and plans point at
# the source line and block that caused it
INHERITED = ("loc", "stack", "scope", "device")


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
        elif a.kind in ("ints", "shape", "axes", "floats") and isinstance(v, list):
            v = tuple(v)
        elif a.kind == "padding" and isinstance(v, int) and not isinstance(v, bool):
            v = (v,) * op.extra.get("spatial", 2)  # conv padding=1 -> (1, 1)
        elif a.kind == "padding" and isinstance(v, list):
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


def make_node(g: Graph, name: str, op_name: str, inputs: Iterable[str], attrs: dict | None = None,
              *, like: Node | None = None, meta: dict | None = None, **fields) -> Node:
    """A new `op_name(inputs)` node called `name` (not yet added to `g`).

    Attributes are normalised; the type comes from the op's shape rule over the types of
    the tensor inputs (raises ShapeError if it rejects them). `like` gives loc, stack,
    scope and device unless `fields` set them. The dtype rule (an op's floating-point
    tensor arguments share one dtype; no implicit promotion) and the size limit (no
    tensor over 2**63 bytes) are checked here, for every node any layer makes.
    """
    op = registry.get(op_name)
    inputs = tuple(inputs)
    attrs = normalise_attrs(op, attrs or {})  # reads them; returns a new dict
    in_types = [g[i].type for i in inputs[:op.n_tensor_inputs(len(inputs))]]
    _check_float_dtypes(op, in_types)
    out_type = op.shape(in_types, attrs)
    if (why := out_type.size_error()) is not None:
        raise ShapeError(f"{op.name}: {why}")
    _inherit(like, fields)
    return Node(name, op_name, inputs, out_type, attrs, meta=dict(meta or {}), **fields)


def make_source(name: str, op_name: str, type: TensorType, attrs: dict, *,
                like: Node | None = None, meta: dict | None = None, **fields) -> Node:
    """A new source node `op_name` ("input", "param" or "buffer") called `name`, of `type`.

    The attributes are kept as given, past the op's signature (`shape`): the initialiser
    reads `init`, `fan_in`, `value`; the feed and the optimizer read `dtype`, `default`,
    `role`. Nothing is checked: the caller has sized the type (the front end reports a
    size over the limit at the declaration). `like` gives loc, stack, scope and device
    unless `fields` set them, as for `make_node`.
    """
    if op_name not in SOURCE_OPS:
        raise ValueError(f"{op_name} is not a source op; make_node builds operator nodes")
    _inherit(like, fields)
    return Node(name, op_name, (), type, dict(attrs), meta=dict(meta or {}), **fields)


def _inherit(like: Node | None, fields: dict) -> None:
    if like is not None:
        for f in INHERITED:
            fields.setdefault(f, getattr(like, f))


def _check_float_dtypes(op: registry.OpDef, in_types) -> None:
    """The dtype rule: an operator's floating-point tensor arguments share one dtype. There
    is no implicit promotion (PyTorch's f32 @ f64 is an error too); a mix is a mistake
    in the program, reported here for every operator rather than in each shape rule.
    Under mixed precision a backward operator (or one that declares
    `extra["mixed_floats"]`: a synchronised batchnorm) reads 2-byte values beside f32
    ones (parameters read as they are, batchnorm's statistics): there the 2-byte floats
    count as f32, which their kernels compute in."""
    if len(in_types) < 2:  # nothing to disagree with
        return
    floats = [(i, t) for i, t in enumerate(in_types[:op.n_tensor_inputs(len(in_types))])
              if t.is_float]
    if op.layer_type == "backward" or op.extra.get("mixed_floats"):
        floats = [(i, t.with_dtype("f32") if t.dtype in REDUCED_DTYPES else t)
                  for i, t in floats]
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


def clone(node: Node, name: str, inputs: Iterable[str] | None = None, *,
          attrs: dict | None = None, meta: dict | None = None) -> Node:
    """A copy of `node` named `name`, optionally reading other inputs and with some
    attributes or meta entries changed. Its random draws stay keyed to the original."""
    c = node.copy(name=name, inputs=tuple(node.inputs if inputs is None else inputs))
    c.attrs.update(attrs or {})
    c.meta.setdefault("rng_key", node.meta.get("rng_key", node.name))
    c.meta.update(meta or {})
    return c


def replace_uses(g: Graph, old: str, new: str, *, readers: Iterable[str] | None = None,
                 outputs: bool = True) -> int:
    """Make `readers` (default: every node but `new` itself) read `new` where they read
    `old`, and, with `outputs`, output roles name `new`. Returns how many inputs changed."""
    only = None if readers is None else set(readers)
    changed = 0
    for n in g.nodes:
        if n.name == new or (only is not None and n.name not in only) or old not in n.inputs:
            continue
        n.inputs = tuple(new if i == old else i for i in n.inputs)
        changed += 1
    if outputs:
        for role, names in g.outputs.items():
            g.outputs[role] = [new if x == old else x for x in names]
    return changed


def splice(g: Graph, *, before: dict[str, list[Node]] | None = None,
           after: dict[str, list[Node]] | None = None) -> Graph:
    """Insert nodes before/after named anchors, in one pass (order within a list kept)."""
    before, after = before or {}, after or {}
    missing = [a for a in (*before, *after) if a not in g]
    if missing:
        raise KeyError(f"splice anchors not in graph {g.name}: {', '.join(missing[:5])}")
    out: list[Node] = []
    for n in g.nodes:
        out.extend(before.get(n.name, ()))
        out.append(n)
        out.extend(after.get(n.name, ()))
    g.nodes = out
    return g


def move_after(g: Graph, moves: dict[str, str]) -> Graph:
    """Reorder: each node `name` in `moves` is taken out and put right after the node
    `moves[name]` (which may itself be moved; nodes after one anchor keep their order)."""
    after: dict[str, list[Node]] = {}
    for n in g.nodes:
        if n.name in moves:
            after.setdefault(moves[n.name], []).append(n)
    out: list[Node] = []
    for n in g.nodes:
        if n.name in moves:
            continue
        # n, then what moves after it, depth first (a stack: chains of moves can be long)
        stack = [n]
        while stack:
            m = stack.pop()
            out.append(m)
            stack.extend(reversed(after.get(m.name, ())))
    if len(out) != len(g.nodes):
        raise KeyError(f"move_after: an anchor is missing or the moves form a cycle in "
                       f"{g.name}")
    g.nodes = out
    return g
