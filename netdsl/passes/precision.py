"""Mixed precision as rewrites: `precision` on the forward graph (before `fuse` and
autodiff), `loss_scale` on the training graph (f16, after autodiff and before the
optimizer).

`precision(g, dtype, device)` gives every operator node the type its op's rule
(`OpDef.precision`, netdsl.ir.opdef.PRECISIONS) asks for, by `cast` nodes on its inputs:
- "reduced" (convolutions, linear layers, products): every float input, parameters
  included, cast to `dtype` ("bf16" or "f16"): the step computes from a 2-byte copy of
  the master weights, which stay f32 in the state;
- "f32" (losses, sums, exp, pow): every float input cast to f32;
- "follow" (the rest): tensor inputs of different float types cast to the widest; the
  parameters and buffers it reads stay as they are (batchnorm updates its f32 running
  statistics in place; its kernel computes in f32).
A value is cast to a type once, just before its first reader, and every later reader
shares the cast (autocast caches its casts of the weights likewise); a loss the rules
leave 2-byte is cast to f32. The nodes' types follow from their shape rules. Autodiff then
differentiates the casts like any op (a cast's gradient is the cast back), so the
activations' gradients are 2-byte and every parameter's gradient is f32. The graph's
`meta["precision"]` records the type and the kind of kernels it runs with (`device`:
"cpu", "numba" or "gpu", netdsl.ir.precision: which read 2-byte values themselves,
`OpDef.reads_reduced`; the storage plan counts the others' conversions to f32 as their
workspace).

`loss_scale(g)` (f16: its 5 bits of exponent flush small gradients to zero) builds
torch.amp.GradScaler's step into the graph: the backward starts from the scalar input
`loss_scale` (role "loss_scale", fed by the trainer each step) instead of 1, so every
gradient is the loss's times the scale; `found_inf` checks the parameters' gradients
(summed over the devices of a split by an all_reduce), and `unscale` divides each by
the scale after that check. `outputs["found_inf"]` is the flag; the optimizer's updates
(added after) carry it as `meta["gate"]`, and the executor skips them where it is set.
The scale's rule (start at 2**16, halve on inf or NaN, double after 2,000 clean steps)
is the trainer's (netdsl.runtime.loss_scale).
"""
from __future__ import annotations

from netdsl.errors import NetdslError
from netdsl.ir import registry
from netdsl.ir.graph import Graph, Node
from netdsl.ir.rewrite import make_node, make_source, replace_uses
from netdsl.ir.types import REDUCED_DTYPES, TensorType
from netdsl.options import PRECISIONS
from netdsl.passes.optimizer import per_device_total
from netdsl.passes.registry import register_pass

F16_MAX = 65504.0  # the largest finite f16
# the float types by width, for "follow" ops reading several
_WIDTH = {"f16": 0, "bf16": 0, "f32": 1, "f64": 2}


@register_pass("precision")
def precision(g: Graph, dtype: str = "f32", device: str = "cpu") -> Graph:
    """A copy of forward graph `g` at mixed precision `dtype` (module docstring); "f32":
    `g` itself."""
    if dtype == "f32":
        return g
    if dtype not in REDUCED_DTYPES:
        raise NetdslError(f"--precision must be {', '.join(PRECISIONS[:-1])} or "
                          f"{PRECISIONS[-1]}, not {dtype!r}")
    ops = registry.load_all()
    g = g.copy()
    casts: dict[tuple[str, str], str] = {}
    nodes: list[Node] = []

    def cast(x: str, to: str, reader: Node) -> str:
        key = (x, to)
        if key not in casts:
            c = make_node(g, g.fresh_name(f"{x}.{to}"), "cast", [x], {"dtype": to},
                          like=reader)
            g.add(c)
            nodes.append(c)
            casts[key] = c.name
        return casts[key]

    for n in list(g.nodes):
        if n.is_source:
            nodes.append(n)
            continue
        op = ops[n.op]
        wanted = _wanted(op, n, g, dtype)
        n.inputs = tuple(cast(x, wanted[k], n) if k in wanted else x
                         for k, x in enumerate(n.inputs))
        if wanted or any(g[i].type.dtype in REDUCED_DTYPES for i in n.inputs):
            n.type = op.shape([g[i].type for i in
                               n.inputs[:op.n_tensor_inputs(len(n.inputs))]], n.attrs)
        if dtype == "f16" and n.type.dtype == "f16":
            _check_f16_range(op, n)
        nodes.append(n)
    g.nodes = nodes
    _loss_in_f32(g, cast)
    g.meta["precision"] = {"dtype": dtype, "device": device}
    return g  # (verified by run_pipeline)


def _wanted(op, n: Node, g: Graph, dtype: str) -> dict[int, str]:
    """{input index: the type it must be cast to} for node `n` under its op's rule."""
    written = set(op.written_inputs(n))
    floats = [(k, g[x].type.dtype) for k, x in enumerate(n.inputs)
              if g[x].type.is_float and k not in written]
    if op.precision == "reduced":
        return {k: dtype for k, t in floats if t != dtype}
    if op.precision == "f32":
        return {k: "f32" for k, t in floats if t != "f32"}
    tensors = [(k, t) for k, t in floats if k < op.n_tensor_inputs(len(n.inputs))]
    if len({t for _, t in tensors}) < 2:
        return {}
    widest = max((t for _, t in tensors), key=_WIDTH.__getitem__)
    return {k: widest for k, t in tensors if t != widest}


def _check_f16_range(op, n: Node) -> None:
    """An attribute the node's f16 value holds as it is (a mask's fill value, a clip
    bound) must be within f16's range: refused here, naming the node and its line."""
    for name in op.extra.get("output_attrs", ()):
        v = n.attrs.get(name)
        if v is not None and abs(v) > F16_MAX:
            raise NetdslError(
                f"{n.op} %{n.name} cannot run in f16: its {name}={v:g} is beyond f16's "
                f"range (+-{F16_MAX:g}), so its output would hold inf; give a {name} within "
                "it, or train with --precision bf16 (f32's range)", loc=n.loc, stack=n.stack)


def _loss_in_f32(g: Graph, cast) -> None:
    losses = g.outputs.get("loss", [])
    if losses and g[losses[0]].type.dtype in REDUCED_DTYPES:
        c = cast(losses[0], "f32", g[losses[0]])
        g.nodes = [n for n in g.nodes if n.name != c] + [g[c]]  # after the loss
        g.outputs["loss"] = [c]


def _seed(g: Graph) -> Node:
    """Autodiff's seed d(loss)/d(loss) = 1: the backward `fill` of 1 for the loss."""
    loss = g.outputs["loss"][0]
    for n in g.nodes:
        if (n.op == "fill" and n.meta.get("forward") == loss and n.type.shape == ()
                and n.attrs["value"] == 1.0 and n.meta.get("phase") == "backward"):
            return n
    raise NetdslError(f"graph `{g.name}` has no gradient seed for its loss %{loss}")


@register_pass("loss_scale")
def loss_scale(g: Graph) -> Graph:
    """A copy of training graph `g` (after autodiff, and a split's gradient all-reduce)
    whose gradients are computed from the loss times the fed scale and unscaled after a
    check for inf and NaN (module docstring)."""
    if "grads" not in g.outputs:
        raise NetdslError(f"graph `{g.name}` has no gradients to scale; run autodiff first")
    g = g.copy()
    seed = _seed(g)
    scale = g.fresh_name("loss_scale")
    # (fed to every device of a split, as the learning rate is: unplaced)
    src = make_source(scale, "input", TensorType((), seed.type.dtype),
                      {"shape": (), "dtype": seed.type.dtype, "default": 1.0,
                       "role": "loss_scale"}, like=seed, device=None,
                      meta={"phase": "backward"})
    g.nodes = [src if n.name == seed.name else n for n in g.nodes]
    replace_uses(g, seed.name, scale)
    grads = list(g.outputs["grads"])
    params = [g[g.meta["grad_of"][x]] for x in grads]
    flags = per_device_total(g, params, grads, "found_inf", "loss_scale.found_inf")
    unscaled = []
    for p, gp in zip(params, grads, strict=True):
        name = g.fresh_name(f"{p.name}.grad_unscaled")
        g.add(make_node(g, name, "unscale", [gp, scale, flags[p.device]], like=p,
                        meta={"phase": "optimizer"}))
        unscaled.append(name)
    g.outputs["grads"] = unscaled
    g.meta["grad_of"] = {u: g.meta["grad_of"][x] for u, x in zip(unscaled, grads, strict=True)}
    g.outputs["found_inf"] = [flags[min(flags, key=lambda d: -1 if d is None else d)]]
    return g  # (verified by run_pipeline)
