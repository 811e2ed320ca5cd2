"""The IR's invariants, checked after every pass.

- node names are unique and every input names an earlier node (topological order);
- every op is registered, and forward ops' recorded types agree with their shape rule;
- source nodes have no inputs; every output role names an existing node;
- the loss, if any, is a scalar;
- effects: no node reads a value (or a view of it) after another node overwrote that
  value in place (`OpDef.writes`); the writer's own result is the new version and may be
  read, and so may a node that names the writer among its inputs (it reads the value as
  written: the optimizer-state write-back). This is what keeps a rewrite from moving a
  read past an update.
"""
from __future__ import annotations

from netdsl.ir import registry
from netdsl.ir.graph import Graph


class IRError(AssertionError):
    """A broken IR invariant: a bug in a pass, never a user error."""


def verify(g: Graph, *, recheck_shapes: bool = True) -> None:
    ops = registry.load_all()
    seen: dict[str, object] = {}
    root: dict[str, str] = {}  # value -> the value whose storage it aliases (itself if none)
    pos: dict[str, int] = {}
    clobbered: dict[str, tuple[int, str]] = {}  # storage root -> (position, writer)
    for k, n in enumerate(g.nodes):
        if n.name in seen:
            raise IRError(f"duplicate node name %{n.name}")
        if n.op not in ops:
            raise IRError(f"%{n.name}: unknown op {n.op!r}")
        for i in n.inputs:
            if i not in seen:
                raise IRError(f"%{n.name} reads %{i}, which is not defined before it")
        for i in n.inputs:
            w = clobbered.get(root.get(i, i))
            if w is not None and pos[i] < w[0] and w[1] != n.name and w[1] not in n.inputs:
                raise IRError(f"%{n.name} reads %{i} after %{w[1]} overwrote it in place")
        if n.is_source and n.inputs:
            raise IRError(f"%{n.name}: a {n.op} node takes no inputs")
        if recheck_shapes and not n.is_source and not n.meta.get("unchecked"):
            op = ops[n.op]
            ins = [seen[i].type for i in n.inputs[:op.n_tensor_inputs(len(n.inputs))]]
            try:
                t = op.shape(ins, n.attrs)
            except Exception as e:  # a rule rejecting its own node is an IR bug
                raise IRError(f"%{n.name}: shape rule of {n.op} fails: {e}") from e
            if t != n.type:
                raise IRError(f"%{n.name}: recorded type {n.type} but {n.op} gives {t}")
        seen[n.name] = n
        pos[n.name] = k
        op = ops[n.op]
        root[n.name] = (root.get(n.inputs[op.view_of], n.inputs[op.view_of])
                        if op.view_of is not None and op.view_of < len(n.inputs) else n.name)
        for j in op.written_inputs(n):
            clobbered[root.get(n.inputs[j], n.inputs[j])] = (k, n.name)
    for role, names in g.outputs.items():
        for name in names:
            if name not in seen:
                raise IRError(f"output {role} names %{name}, which does not exist")
    for name in g.outputs.get("loss", []):
        if seen[name].type.shape != ():
            raise IRError(f"loss %{name} is not a scalar: {seen[name].type}")
