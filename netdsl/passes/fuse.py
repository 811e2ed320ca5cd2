"""Fusion passes: operator chains that one kernel runs in fewer passes over memory.

- `fuse` (on a forward graph, before autodiff, which then uses the fused op's gradient
  rule): `relu(batchnorm(x))` where the relu is the batchnorm's only reader and the
  batchnorm's value is no graph output becomes `batchnorm_relu(x)` (see
  netdsl.ir.ops.norm_fused), `relu6(batchnorm(x))` likewise `batchnorm_relu(x, cap=6)`
  (MobileNets); `relu(add(a, b))` of two tensors of one type (a
  post-activation residual block's output) becomes `add_relu(a, b)` likewise. The fused
  node takes the relu's name (its readers and output roles are unchanged) and the first
  node's inputs, attributes, source location and scope; that node goes. A recompute
  replay (`replay` attribute) is left alone. Then (on a CPU's step: `residuals`) an
  `add` of two tensors of one type one of whose terms is a conv2d or linear read by
  nothing else becomes `conv2d_add(x, r)` or `linear_add(x, r)`, named as the add (see
  netdsl.ir.ops.product_add: the GEMM tasks add r while the result is in cache): a
  pre-activation ResNet block's last convolution and shortcut, a transformer's
  projections and residual stream. Between the two (on a CPU's step: `attention`),
  multi-head self-attention written out over one packed q/k/v projection (slices, heads
  split by reshape and permute, the products, scale and softmax or
  scaled_dot_product_attention, heads merged) becomes one `attention_qkv(qkv)` named as
  the final reshape (see netdsl.passes.fuse_attention and netdsl.ir.ops.attention).
- `fuse_grads` (on a training graph, after autodiff): an `add` of a gradient sum (autodiff
  tags them `sums_gradient_of`) one of whose inputs is an affine batchnorm's
  `batchnorm_grad_from_stats` read by nothing else becomes that node with the other input
  as its `acc`: dx is written with the sum in one pass (a pre-activation ResNet block's
  input gradient: batchnorm's dx plus the shortcut's). The fused node takes the add's
  name and place. Then a `relu_grad` whose gradient is such a sum, read by nothing else,
  takes the sum's two terms (the second as its `acc`) and the add goes (a
  post-activation block's input gradient, masked by the previous block's relu). And the
  backward of attention_qkv(qkv, p) with kept probabilities (the values' gradient, dP and
  the probabilities' gradient, summed) becomes one `attention_qkv_grad(dy, qkv, p)`.
- `join_slice_grads` (on a training graph, after autodiff): a gradient sum whose terms
  are all `slice_grad`s of one value, read by nothing else, whose unit-step slices tile
  the sliced axis (a transformer's q, k and v cut from one projection) becomes one
  `concat` of the slices' gradients: no zero-filled full-size tensors and no adds. The
  concat takes the sum's name and place. It runs whatever the fused kernels (it is faster
  in NumPy alone).

The backward fusions also run on a split step (`parallel.split.split_step`), fusing nodes
that sit on one device; the forward ones run on its forward graph before it is split.
By default `fuse` and `fuse_grads` run on a GPU's step (the Trainer's on CuPy) and where
the fused CPU kernels can (Numba is installed: the `fast` extra); without them the fused
ops' NumPy reference code recomputes the relu mask and is slower than the unfused ops, so
a CPU step is left as written.
`NETDSL_FUSE=1` or `0` (or a pass's `enabled`) forces either way, to compare.
"""
from __future__ import annotations

import functools
import importlib.util

from netdsl.config import env_switch
from netdsl.ir.graph import Graph
from netdsl.ir.rewrite import make_node
from netdsl.passes.fuse_attention import attention_into_qkv, join_attention_grads
from netdsl.passes.registry import register_pass

FUSE_ENV = "NETDSL_FUSE"


def fusion_enabled(device: str = "cpu") -> bool:
    """NETDSL_FUSE if set; else, for a GPU's step, yes (the CuPy backend's CUDA kernels run
    batchnorm with its relu, and its dx with the gradient sum, in one launch each: a
    launch and a pass over memory saved either way); else whether Numba (what runs the
    fused CPU kernels) is installed, looked up, not imported."""
    forced = env_switch(FUSE_ENV, None)
    if forced is not None:
        return forced
    return device == "gpu" or importlib.util.find_spec("numba") is not None


def fuse_options(device: str = "cpu") -> dict:
    """The `fuse` pass's options for a step on `device`: on whether fusion runs there
    (fusion_enabled), and the residual and attention kernels on a CPU only (on a GPU
    neither has been measured, so its step is left as it was)."""
    cpu = device == "cpu"
    return {"enabled": fusion_enabled(device), "residuals": cpu, "attention": cpu}


def _unbroadcast_pair(g: Graph, n) -> bool:
    """n (an add) has two inputs of its own type: no broadcasting, which the fused
    kernels do not do."""
    return len(n.inputs) == 2 and g[n.inputs[0]].type == g[n.inputs[1]].type == n.type


def _sole_reader(g: Graph):
    """only(x, r): value x is read by node r alone and is no graph output, so a fusion into
    r may drop it. The readers are found on the first question (a pass that finds nothing
    to fuse asks none, and listing a big split step's consumers is not free)."""
    @functools.cache
    def facts():
        return g.consumers(), {x for names in g.outputs.values() for x in names}

    def only(x: str, r: str) -> bool:
        readers, outputs = facts()
        return readers[x] == [r] and x not in outputs
    return only


# the forward pairs `fuse` makes: (the reader, the op it reads) -> (the fused op, the
# attributes it adds to the read op's)
_FUSED = {("relu", "batchnorm"): ("batchnorm_relu", {}),
          ("relu6", "batchnorm"): ("batchnorm_relu", {"cap": 6.0}),
          ("relu", "add"): ("add_relu", {})}
_READERS = {reader for reader, _ in _FUSED}


@register_pass("fuse")
def fuse(g: Graph, enabled: bool | None = None, residuals: bool = True,
         attention: bool = True) -> Graph:
    """relu(batchnorm(x)) -> batchnorm_relu(x), relu6(batchnorm(x)) -> batchnorm_relu(x,
    cap=6) and relu(add(a, b)) -> add_relu(a, b) where the relu is the only reader; then,
    with `attention`, multi-head attention written out over a packed q/k/v projection ->
    attention_qkv(qkv) (netdsl.passes.fuse_attention); then, with `residuals`,
    add(conv2d(x), r) -> conv2d_add(x, r) and add(linear(x), r) -> linear_add(x, r) where
    the add is the product's only reader."""
    if not (fusion_enabled() if enabled is None else enabled):
        return g
    g = _activations(g)
    if attention:
        g = attention_into_qkv(g, _sole_reader(g))
    return _residuals_into_products(g) if residuals else g


def _activations(g: Graph) -> Graph:
    only = _sole_reader(g)
    pairs = {}  # relu (or relu6) name -> the node it reads
    for n in g.nodes:
        if n.op not in _READERS:
            continue
        first = g[n.inputs[0]]
        if ((n.op, first.op) in _FUSED and not first.attrs.get("replay")
                and first.device == n.device
                and only(first.name, n.name)
                and (first.op != "add" or _unbroadcast_pair(g, first))):
            pairs[n.name] = first
    if not pairs:
        return g
    def fused(g, n):
        first = pairs[n.name]
        op, added = _FUSED[(n.op, first.op)]
        f = make_node(g, n.name, op, first.inputs, {**first.attrs, **added}, like=first,
                      meta={**first.meta, "fused": (first.name, n.name)})
        f.annotations = {**first.annotations, **n.annotations}
        return f
    return _rebuilt(g, {first.name for first in pairs.values()}, dict.fromkeys(pairs, fused))


_WITH_RESIDUAL = {"conv2d": "conv2d_add", "linear": "linear_add"}


def _residuals_into_products(g: Graph) -> Graph:
    """add(p, r) or add(r, p) -> p's op with r added (conv2d_add, linear_add: the sum
    added to each block of the product while it is in cache) where p, a conv2d or linear,
    is read by the add alone and the add does not broadcast. The fused node takes the
    add's name and place, p's inputs with r second, p's attributes."""
    only = _sole_reader(g)
    fused = {}  # add name -> (the product, the other term)
    for n in g.nodes:
        if n.op != "add" or n.device is not None or not _unbroadcast_pair(g, n):
            continue
        for k, i in enumerate(n.inputs):
            p = g[i]
            if (p.op in _WITH_RESIDUAL and p.device is None and not p.attrs.get("replay")
                    and only(i, n.name)):
                fused[n.name] = (p, n.inputs[1 - k])
                break
    if not fused:
        return g
    def with_residual(g, n):
        p, r = fused[n.name]
        f = make_node(g, n.name, _WITH_RESIDUAL[p.op], (p.inputs[0], r) + p.inputs[1:],
                      p.attrs, like=p, meta={**p.meta, "fused": (p.name, n.name)})
        f.annotations = {**p.annotations, **n.annotations}
        return f
    return _rebuilt(g, {p.name for p, _ in fused.values()},
                    dict.fromkeys(fused, with_residual))


def _rebuilt(g: Graph, dropped: set[str], remake: dict) -> Graph:
    """A copy of g without the `dropped` nodes and with each node named in `remake`
    replaced, in its place, by remake[name](the copy, the node)."""
    g = g.copy()
    g.nodes = [remake[n.name](g, n) if n.name in remake else n
               for n in g.nodes if n.name not in dropped]
    return g


@register_pass("fuse_grads")
def fuse_grads(g: Graph, enabled: bool | None = None) -> Graph:
    """add(batchnorm_grad_from_stats(...), other) -> batchnorm_grad_from_stats(..., acc=other)
    (and sync_batchnorm_grad_input's) and relu_grad(add(a, b), y) -> relu_grad(a, y,
    acc=b) for autodiff's gradient sums; the kept attention probabilities' backward nodes
    and their sum -> attention_qkv_grad (netdsl.passes.fuse_attention.join_attention_grads)."""
    if not (fusion_enabled() if enabled is None else enabled):
        return g
    g = _sums_into_relu_grads(_sums_into_batchnorm_dx(g))
    return join_attention_grads(g, _sole_reader(g))


def _sums_into_batchnorm_dx(g: Graph) -> Graph:
    only = _sole_reader(g)
    fused = {}  # add name -> (from_stats node, its inputs with acc)
    taken = set()
    for n in g.nodes:
        if n.op != "add" or "sums_gradient_of" not in n.meta or len(n.inputs) != 2:
            continue
        for k, i in enumerate(n.inputs):
            d, other = g[i], n.inputs[1 - k]
            if not (d.op in _DX_WITH_ACC and d.device == n.device
                    and only(i, n.name) and i not in taken
                    and d.type == n.type == g[other].type):
                continue
            ins = _with_acc(g, d, other)
            if ins is not None:
                fused[n.name] = (d, ins)
                taken.add(i)
                break
    if not fused:
        return g
    def with_acc(g, n):
        d, ins = fused[n.name]
        return make_node(g, n.name, d.op, ins, d.attrs, like=d,
                         meta={**n.meta, "fused": (d.name, n.name)})
    return _rebuilt(g, taken, dict.fromkeys(fused, with_acc))


def _sums_into_relu_grads(g: Graph) -> Graph:
    """relu_grad(sum, y) -> relu_grad(a, y, acc=b) where `sum` is autodiff's add(a, b) of a
    value's gradients read by nothing else (a post-activation block's input gradient)."""
    only = _sole_reader(g)
    folded = {}  # relu_grad name -> the sum it takes in
    for n in g.nodes:
        if n.op != "relu_grad" or len(n.inputs) != 2:
            continue
        s = g[n.inputs[0]]
        if (s.op == "add" and "sums_gradient_of" in s.meta and s.device == n.device
                and only(s.name, n.name) and _unbroadcast_pair(g, s) and s.type == n.type):
            folded[n.name] = s
    if not folded:
        return g
    def with_acc(g, n):
        s = folded[n.name]
        return make_node(g, n.name, "relu_grad", (s.inputs[0], n.inputs[1], s.inputs[1]),
                         like=n, meta={**n.meta, "fused": (s.name, n.name)})
    return _rebuilt(g, {s.name for s in folded.values()}, dict.fromkeys(folded, with_acc))


# the batchnorm dx ops with an `acc` input after the weight and bias: their inputs then
_DX_WITH_ACC = {"batchnorm_grad_from_stats": 5, "sync_batchnorm_grad_input": 6}


def _with_acc(g: Graph, d, other: str) -> tuple[str, ...] | None:
    """d's inputs with `other` as acc (after the weight and bias; a plain batchnorm's dx
    reads only the weight, so its bias is added), or None (not affine)."""
    if len(d.inputs) == _DX_WITH_ACC[d.op]:
        return d.inputs + (other,)
    fwd = g[d.meta.get("forward", "")] if d.meta.get("forward", "") in g else None
    if len(d.inputs) == 4 and fwd is not None and fwd.op == "batchnorm":
        return d.inputs + (fwd.inputs[2], other)  # (x, weight, bias, ...): its bias
    return None


@register_pass("join_slice_grads")
def join_slice_grads(g: Graph) -> Graph:
    """add(slice_grad(a), slice_grad(b), ...) -> concat(a, b, ...) where the slices tile
    their axis (autodiff's gradient sums)."""
    only = _sole_reader(g)
    sums: dict[str, list] = {}  # the value summed -> its sum's add nodes, in order
    for n in g.nodes:
        if n.op == "add" and "sums_gradient_of" in n.meta:
            sums.setdefault(n.meta["sums_gradient_of"], []).append(n)
    joins = {}  # the last add's name -> (concat inputs, axis)
    dropped = set()
    for adds in sums.values():
        names = {a.name for a in adds}
        terms = [i for a in adds for i in a.inputs if i not in names]
        parts = _tiling(g, terms, only, names)
        if parts is not None:
            joins[adds[-1].name] = parts
            dropped |= names - {adds[-1].name} | set(terms)
    if not joins:
        return g
    def concat(g, n):
        ins, axis = joins[n.name]
        meta = {k: v for k, v in n.meta.items() if k != "sums_gradient_of"}
        return make_node(g, n.name, "concat", ins, {"axis": axis}, like=n,
                         meta={**meta, "joined": True})
    return _rebuilt(g, dropped, dict.fromkeys(joins, concat))


def _tiling(g: Graph, terms: list[str], only, adds: set[str]):
    """(the slices' gradients ordered along the axis, the axis) if `terms` are unit-step
    slice_grads, each read only by the sum, that cover their axis once; else None."""
    ds = [g[t] for t in terms]
    if len(ds) < 2 or any(
            d.op != "slice_grad" or d.device != ds[0].device or d.attrs["step"] != 1
            or not any(only(d.name, a) for a in adds) for d in ds):
        return None
    shape = tuple(ds[0].attrs["shape"])
    axis = ds[0].attrs["axis"] % len(shape)
    if any(tuple(d.attrs["shape"]) != shape or d.attrs["axis"] % len(shape) != axis
           for d in ds):
        return None
    spans = sorted(((d.attrs["start"], d.attrs["start"] + g[d.inputs[0]].type.shape[axis], d)
                    for d in ds), key=lambda s: s[:2])
    at = 0
    for start, stop, _ in spans:
        if start != at:
            return None
        at = stop
    if at != shape[axis]:
        return None
    return tuple(d.inputs[0] for _, _, d in spans), axis
