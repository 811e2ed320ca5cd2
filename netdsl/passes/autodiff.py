"""Reverse-mode autodiff as a graph transformation: forward graph -> training graph.

`autodiff(g)` appends the backward pass to a graph whose `outputs["loss"]` names a scalar:

1. every `dropout` is lowered to an explicit `dropout_mask` node and a `mul`, so the mask
   is a graph value that forward and backward share (and the backward is deterministic);
2. the seed d(loss)/d(loss) = 1 is a `fill` node;
3. nodes are visited in reverse topological order; each op's gradient rule
   (`OpDef.grad`, attached with `registry.grad_rule`) emits ordinary IR nodes through a
   `GradBuilder` and returns one gradient value name (or None) per input, parameters and
   buffers included;
4. a value read by several nodes gets the sum of its gradient contributions (`add` nodes);
5. a gradient is held in the type of its value: under mixed precision (netdsl.passes.
   precision) a contribution a rule gives in another float type is cast to it;
6. only values that both depend on a parameter and reach the loss get gradients; backward
   nodes whose results no parameter gradient needs are removed (so e.g. the first conv
   never computes a gradient for the network input).

Results: `outputs["grads"]` lists one gradient node per `param` node, in param order
(a `fill` of zeros for a parameter that does not reach the loss), and
`g.meta["grad_of"] = {grad_node: param_node}`. Backward nodes carry
`meta["phase"] = "backward"` plus the forward node's loc, stack, scope and device, so
errors and plans point at the source line that caused them.

A gradient rule `rule(node, b, gy) -> list[str | None]` uses:
- `b.emit(op, inputs, attrs=None, tag="") -> str`: add a backward node, return its name;
- `b.type(value) -> TensorType`: the type of any value in the graph.
"""
from __future__ import annotations

from netdsl.errors import NetdslError
from netdsl.ir import registry
from netdsl.ir.graph import Graph, Node
from netdsl.ir.rewrite import make_node
from netdsl.ir.types import TensorType
from netdsl.passes.registry import register_pass


class GradBuilder:
    """Emits backward nodes into a graph on behalf of one forward node at a time."""

    def __init__(self, g: Graph, total=None):
        self.g = g
        self.fwd: Node | None = None  # the forward node whose gradient is being built
        self._total = total
        # what a rule shares with the rules of related nodes (a collective's members emit
        # one backward collective between them)
        self.memo: dict = {}

    def type(self, value: str) -> TensorType:
        return self.g[value].type

    def grad_total(self, value: str) -> str | None:
        """The whole gradient of another forward value (a collective's sibling member),
        once every reader of it has contributed."""
        return self._total(value)

    def emit(self, op_name: str, inputs: list[str], attrs: dict | None = None,
             tag: str = "", device: int | None = None) -> str:
        """Add a backward node; it sits where its forward node does unless `device`
        says otherwise (the gradient of a `recv` is sent back from the receiver)."""
        fwd = self.fwd
        base = fwd.name if fwd is not None else "grad"
        name = self.g.fresh_name(f"{base}.grad" + (f".{tag}" if tag else ""))
        fields = {} if device is None else {"device": device}
        self.g.add(make_node(self.g, name, op_name, inputs, attrs, like=fwd,
                             meta={"phase": "backward", "forward": base}, **fields))
        return name

    def emit_group(self, op_name: str, inputs: list[str], attrs: dict, names: list[str],
                   devices: list[int | None]) -> list[str]:
        """Add the members of one backward collective, adjacent, member k on devices[k]."""
        base = self.fwd.name if self.fwd is not None else "grad"
        for k, (name, dev) in enumerate(zip(names, devices, strict=True)):
            self.g.add(make_node(self.g, name, op_name, inputs, {**attrs, "index": k},
                                 like=self.fwd, device=dev,
                                 meta={"phase": "backward", "forward": base,
                                       "members": tuple(names)}))
        return names


def lower_dropout(g: Graph) -> Graph:
    """Replace each `dropout(x)` by `mul(x, dropout_mask(x))` (in place; names kept)."""
    nodes: list[Node] = []
    for n in g.nodes:
        if n.op == "dropout":
            mask = make_node(g, f"{n.name}.mask", "dropout_mask", (n.inputs[0],),
                             {"p": n.attrs["p"]}, like=n,
                             meta={**n.meta, "rng_key": n.meta.get("rng_key", n.name)})
            nodes.append(mask)
            n = n.copy(op="mul", inputs=(n.inputs[0], mask.name), attrs={})
            n.meta["lowered_from"] = "dropout"
        nodes.append(n)
    g.nodes = nodes
    return g


@register_pass("autodiff")
def autodiff(g: Graph) -> Graph:
    """The training graph of forward graph `g` (which is not modified); see module doc."""
    if not g.outputs.get("loss"):
        raise NetdslError(f"graph `{g.name}` has no loss to differentiate; declare one")
    if "grads" in g.outputs:
        raise NetdslError(f"graph `{g.name}` already has gradients")
    g = lower_dropout(g.copy())
    loss = g.outputs["loss"][0]
    forward = list(g.nodes)
    params = [n.name for n in forward if n.op == "param"]
    back = _Backward(g, _active(forward, params, loss))
    seed = back.seed(loss)
    for n in reversed(forward):
        if not n.is_source and n.name in back.active:
            back.visit(n)
    grad_names, grad_of = back.param_gradients(params, seed)
    back.close()
    g.outputs["grads"] = grad_names
    g.meta["grad_of"] = grad_of
    _prune_backward(g, set(grad_names))
    return g  # (verified by run_pipeline)


def _active(forward: list[Node], params: list[str], loss: str) -> set[str]:
    """The values that both depend on a parameter through differentiable ops and reach
    the loss: the only ones that get gradients."""
    ops = registry.load_all()
    depends = set(params)
    for n in forward:
        if not n.is_source and ops[n.op].differentiable and any(i in depends for i in n.inputs):
            depends.add(n.name)
    reaches = {loss}
    for n in reversed(forward):
        if n.name in reaches:
            reaches.update(n.inputs)
    return depends & reaches


class _Backward:
    """The backward pass under construction: each active value's gradient contributions,
    summed once (when the value's own gradient rule, or a parameter, needs the total)."""

    def __init__(self, g: Graph, active: set[str]):
        self.g, self.active = g, active
        self.contribs: dict[str, list[str]] = {}
        self.totals: dict[str, str | None] = {}
        self.b = GradBuilder(g, self.total)

    def total(self, value: str) -> str | None:
        """The gradient of `value`: its contributions, summed with `add` nodes (once)."""
        if value in self.totals:
            return self.totals[value]
        b = self.b
        parts = self.contribs.pop(value, [])
        acc = parts[0] if parts else None
        prev, b.fwd = b.fwd, self.g[value]  # the sum sits with the value (on its device)
        for p in parts[1:]:
            acc = b.emit("add", [acc, p], tag="acc")
            self.g[acc].meta["sums_gradient_of"] = value  # (a pipeline re-chains these sums)
        b.fwd = prev
        self.totals[value] = acc
        return acc

    def seed(self, loss: str) -> str:
        """d(loss)/d(loss) = 1, the loss's first contribution."""
        self.b.fwd = self.g[loss]
        seed = self.b.emit("fill", [], {"shape": (), "value": 1.0,
                                        "dtype": self.g[loss].type.dtype}, tag="seed")
        self.contribs[loss] = [seed]
        return seed

    def visit(self, n: Node) -> None:
        """Apply forward node `n`'s gradient rule to its total gradient, if it has one."""
        b = self.b
        b.fwd = n
        gy = self.total(n.name)
        if gy is None:
            return
        op = registry.OPS[n.op]
        if op.grad is None:
            raise NetdslError(f"cannot differentiate `{n.op}` (node %{n.name}): it has no "
                              f"gradient rule", loc=n.loc, stack=n.stack)
        grads = op.grad(n, b, gy)
        if len(grads) != len(n.inputs):
            raise AssertionError(f"gradient rule of {n.op} returned {len(grads)} gradients "
                                 f"for {len(n.inputs)} inputs")
        for inp, gi in zip(n.inputs, grads, strict=True):
            if gi is not None and inp in self.active:
                t = self.g[inp].type
                if self.g[gi].type.shape != t.shape:
                    raise AssertionError(f"gradient {gi} of %{inp} has type "
                                         f"{self.g[gi].type}, value has {t}")
                if self.g[gi].type.dtype != t.dtype:
                    # mixed precision: a gradient is held in its value's type (an f32
                    # parameter read as it is by a 2-byte op gets an f32 gradient)
                    gi = b.emit("cast", [gi], {"dtype": t.dtype}, tag="cast")
                self.contribs.setdefault(inp, []).append(gi)

    def param_gradients(self, params: list[str], seed: str) -> tuple[list[str], dict]:
        """One gradient node per parameter, in order, and {gradient: parameter}."""
        b, grad_names, grad_of = self.b, [], {}
        for p in params:
            pn = self.g[p]
            b.fwd = pn
            gp = self.total(p)
            if gp is None:  # the parameter does not reach the loss: its gradient is zero
                gp = b.emit("fill", [], {"shape": pn.type.shape, "value": 0.0,
                                         "dtype": pn.type.dtype}, tag="zero")
            elif gp in grad_of or gp == seed or self.g[gp].meta.get("phase") != "backward":
                # the same value is already another parameter's gradient (add(p, q) passes
                # gy to both): copy it so that each parameter owns its gradient node
                gp = b.emit("scale", [gp], {"factor": 1.0}, tag="own")
            grad_names.append(gp)
            grad_of[gp] = p
        return grad_names, grad_of

    def close(self) -> None:
        # the builder and `total` refer to each other: broken here, freed by refcount
        self.b._total = None


def _prune_backward(g: Graph, keep: set[str]) -> None:
    """Drop backward nodes that no gradient in `keep` depends on."""
    needed = set(keep)
    for n in reversed(g.nodes):
        if n.name in needed:
            needed.update(n.inputs)
    g.nodes = [n for n in g.nodes if n.meta.get("phase") != "backward" or n.name in needed]
