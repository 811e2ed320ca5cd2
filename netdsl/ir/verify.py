"""The IR's invariants, checked after every pass.

- node names are unique and every input names an earlier node (topological order);
- every op is registered, and forward ops' recorded types agree with their shape rule;
- source nodes have no inputs; every output role names an existing node;
- the loss, if any, is a scalar;
- every key of a node's and of the graph's `meta` is declared (netdsl.ir.meta), and its
  value is of a declared type;
- effects: no node reads a value (or a view of it) after another node overwrote that
  value in place (`OpDef.writes`); the writer's own result is the new version and may be
  read, and so may a node that names the writer among its inputs (it reads the value as
  written: the optimizer-state write-back). This is what keeps a rewrite from moving a
  read past an update.

`Graph.verify()` calls `verify`, which takes the graph as it is (this module does not
import netdsl.ir.graph, which imports it). `check_structure` is the first group alone
(names, order, ops, sources, outputs): the cheap check the pass pipeline makes between
passes, whose last pass is followed by the whole `verify`.
"""
from __future__ import annotations

from netdsl.ir import registry
from netdsl.ir.meta import GRAPH_META, NODE_META, NODE_META_TYPES, meta_problem
from netdsl.ir.node import SOURCE_OPS


class IRError(AssertionError):
    """A broken IR invariant: a bug in a pass, never a user error."""


def check_structure(g) -> None:
    """The graph's structure alone (module doc): unique names, inputs defined before
    use, registered ops, sources without inputs, outputs that exist."""
    ops = registry.load_all()
    seen: set[str] = set()
    for n in g.nodes:
        name, inputs = n.name, n.inputs
        if name in seen:
            raise IRError(f"duplicate node name %{name}")
        if n.op not in ops:
            raise IRError(f"%{name}: unknown op {n.op!r}")
        if inputs:
            if n.op in SOURCE_OPS:
                raise IRError(f"%{name}: a {n.op} node takes no inputs")
            for i in inputs:
                if i not in seen:
                    raise IRError(f"%{name} reads %{i}, which is not defined before it")
        seen.add(name)
    _check_outputs(g, seen)


def _check_outputs(g, defined) -> None:
    for role, names in g.outputs.items():
        for name in names:
            if name not in defined:
                raise IRError(f"output {role} names %{name}, which does not exist")


def verify(g, *, recheck_shapes: bool = True) -> None:
    ops = registry.load_all()
    if (why := meta_problem(g.meta, GRAPH_META)) is not None:
        raise IRError(f"graph {g.name}: {why}")
    meta_types = NODE_META_TYPES.get
    nodes = g.nodes
    pos: dict[str, int] = {}  # the values defined so far, at their positions
    root: dict[str, str] = {}  # view -> the value whose storage it aliases (absent: itself)
    clobbered: dict[str, tuple[int, str]] = {}  # storage root -> (position, writer)
    for k, n in enumerate(nodes):
        name, inputs, o = n.name, n.inputs, n.op
        if name in pos:
            raise IRError(f"duplicate node name %{name}")
        op = ops.get(o)
        if op is None:
            raise IRError(f"%{name}: unknown op {o!r}")
        if inputs and o in SOURCE_OPS:
            raise IRError(f"%{name}: a {o} node takes no inputs")
        m = n.meta
        if m:  # (most nodes have no meta, or one key)
            for key, value in m.items():
                # an undeclared key's types are (), of which nothing is an instance
                if not isinstance(value, meta_types(key, ())):
                    raise IRError(f"%{name}: {meta_problem(m, NODE_META)}")
        for i in inputs:
            if i not in pos:
                raise IRError(f"%{name} reads %{i}, which is not defined before it")
            if clobbered:
                w = clobbered.get(root.get(i, i))
                if w is not None and pos[i] < w[0] and w[1] != name and w[1] not in inputs:
                    raise IRError(f"%{name} reads %{i} after %{w[1]} overwrote it in place")
        if recheck_shapes and o not in SOURCE_OPS and not n.meta.get("unchecked"):
            ins = [nodes[pos[i]].type for i in inputs[:op.n_tensor_inputs(len(inputs))]]
            try:
                t = op.shape(ins, n.attrs)
            except Exception as e:  # a rule rejecting its own node is an IR bug
                raise IRError(f"%{name}: shape rule of {o} fails: {e}") from e
            if t != n.type:
                raise IRError(f"%{name}: recorded type {n.type} but {o} gives {t}")
        pos[name] = k
        v = op.view_of
        if v is not None and v < len(inputs):
            root[name] = root.get(inputs[v], inputs[v])
        if op.writes:
            for j in op.written_inputs(n):
                clobbered[root.get(inputs[j], inputs[j])] = (k, name)
    _check_outputs(g, pos)
    for name in g.outputs.get("loss", []):
        t = nodes[pos[name]].type
        if t.shape != ():
            raise IRError(f"loss %{name} is not a scalar: {t}")
