"""Spatial (attribute) parallelism: the image height split across devices, with halo
exchange for convolutions and pooling (the BigData 2019 paper's attribute parallelism).

Every device holds a replica of the state and computes, for each node of the network's
convolutional trunk, a horizontal strip of its output: rows `even_parts(H, S)[d]` of an
output of height H on device d of S. How a strip is made depends on the node:

- **row-local** nodes (element-wise ops, activations, channel concat, batchnorm's
  normalisation) that read a value already cut read the same rows of their inputs,
  which are on the same device, since every value of height H is cut the same way;
  inputs that broadcast over the height (a per-channel weight) are read whole;
- **window** nodes (conv2d, max- and average pooling, transposed convolutions) read the
  input rows their windows cover: the device's own rows plus a *halo* of a few rows held
  by its neighbours (a `slice` there, a send/recv pair, a `concat` here). Where a window
  hangs over the image border, the strip is padded as the whole image is (a
  convolution's padding becomes per-strip top/bottom padding; pooling pads explicitly,
  with -inf for max pooling; a transposed convolution runs unpadded on its input rows
  and its strip is cropped out);
- **batchnorm** (and batchnorm + relu, fused) normalises with the statistics of the
  whole batch and image: its strips are synchronised exactly as data parallelism's
  replicas are (`syncbn`: each strip's moments all-gathered and combined).

A trunk starts at a window node (an attention score tensor is 4-d too, but not an image).
The first node that is none of these (global pooling, flatten, a linear head, the loss),
or is marked `@replicate`, reads the whole value: the strips are sent to device 0 and
joined there, under the value's own name, and that node runs on device 0 (a CNN's head is
a small part of its work; a window node after it cuts the trunk again). A strip that would
be empty (a value of height below S) also ends the trunk there. Autodiff turns every send
into a send back and every slice into its gradient's zero-padded strip, so the backward
pass exchanges the halos' gradients, and the gradients of the replicated parameters are
all-reduced by `gradsync` as in data parallelism: the step equals the single-device step.
"""
from __future__ import annotations

import math

from netdsl.errors import SplitError
from netdsl.ir import registry
from netdsl.ir.graph import STATE_OPS, Graph, Node
from netdsl.ir.ops.conv import explicit_padding
from netdsl.ir.ops.pool import spatial as pool_dims
from netdsl.ir.placement import copy_name, even_parts
from netdsl.ir.rewrite import make_node
from netdsl.parallel.replicate import batch_dependent, batch_rows
from netdsl.parallel.syncbn import NORMS

H = 2  # the height axis of NCHW
WINDOW = ("conv2d", "maxpool", "avgpool", "conv_transpose2d")
ROW_LOCAL_TYPES = ("elementwise", "activation")
NOT_ROW_LOCAL = ("causal_mask", "softmax", "log_softmax")  # unless along the channels


class _Spatial:
    """One replica's rewrite (module docstring): rows [lo, hi) of the batch cut into
    `ways` strips on devices base .. base + ways - 1 of shared graph `g`; which values are
    cut, their strips, and the whole values (joined strips, head nodes) made so far."""

    def __init__(self, fwd: Graph, g: Graph, ways: int, replica: int = 0,
                 rows: tuple[int, int] | None = None, replicas: int = 1):
        self.fwd, self.g, self.ways = fwd, g, ways
        self.ops = registry.load_all()
        self.lo, self.hi = rows if rows is not None else (0, g.batch)
        self.base = replica * ways
        self.replicas = replicas
        self.bound = fwd.bind(self.hi - self.lo)
        self.strips: dict[str, list[str]] = {}  # value -> its strip on each device
        self.whole: dict[str, str] = {}  # value -> its whole value in this replica
        self.rows_cache: dict[tuple, str] = {}

    def device(self, d: int) -> int:
        return self.base + d

    def named(self, name: str) -> str:
        """The name of this replica's whole copy of `name` (the name itself without
        data-parallel replicas: `combine` makes the original names otherwise)."""
        return name if self.replicas == 1 else copy_name(name, self.base)

    # -- values on a device ------------------------------------------------------------
    def on(self, name: str, device: int) -> str:
        """Value `name` whole, for a node on `device`: a state replica there, a constant
        made there, the replica's rows of an input, the strips joined (on the replica's
        first device), or the value itself (`connect` brings a value made on another
        device with a send/recv pair)."""
        n = self.bound[name]
        if n.op in STATE_OPS or (not n.is_source and not n.inputs):
            new = name if device == 0 else copy_name(name, device)
            if new not in self.g:
                c = n.copy(name=new, device=device)
                c.meta["origin"] = name
                self.g.add(c)
            return new
        if n.op == "input":
            if self.replicas == 1:
                return name  # fed on every device
            key = (name, device, "batch")
            if key not in self.rows_cache:
                self.rows_cache[key] = self._add(
                    f"{name}.rows{self.lo}_{self.hi}@d{device}", "slice", [name],
                    {"axis": 0, "start": self.lo, "stop": self.hi, "step": 1},
                    n, device)
            return self.rows_cache[key]
        if name in self.strips:
            return self.join(name)
        return self.whole[name]

    def join(self, name: str) -> str:
        """The strips of `name` joined on the replica's first device, under `name` itself
        (or the replica's copy name), so every reader after the trunk (and the step's
        outputs) finds it by the single-device name."""
        if name not in self.whole:
            self.whole[name] = self.named(name)
            n = make_node(self.g, self.whole[name], "concat", self.strips[name], {"axis": H},
                          like=self.bound[name], device=self.base,
                          meta={"joined": True})  # not a computation of `name`
            self.g.add(n)
        return self.whole[name]

    def rows(self, name: str, device: int, lo: int, hi: int) -> str:
        """Rows [lo, hi) of value `name` (height axis) for a node on `device`: slices of
        the strips that hold them (on their devices) joined there, or a slice of the
        whole value."""
        key = (name, device, lo, hi)
        if key in self.rows_cache:
            return self.rows_cache[key]
        height = self.bound[name].type.shape[H]
        if name in self.strips:
            pieces = []
            for d, (a, b) in enumerate(even_parts(height, self.ways)):
                s, e = max(a, lo), min(b, hi)
                if s < e:
                    pieces.append(self._slice(self.strips[name][d], self.device(d), s - a,
                                              e - a, device))
        else:
            whole = self.on(name, device)
            owner = self.g[whole].device
            pieces = [self._slice(whole, device if owner is None else owner, lo, hi, device)]
        out = pieces[0] if len(pieces) == 1 else self._add(
            f"{name}.rows{lo}_{hi}@d{device}", "concat", pieces, {"axis": H},
            self.bound[name], device)
        self.rows_cache[key] = out
        return out

    def _slice(self, name: str, device: int, lo: int, hi: int, reader: int) -> str:
        if lo == 0 and hi == self.g[name].type.shape[H]:
            return name
        return self._add(f"{name}.rows{lo}_{hi}>d{reader}", "slice", [name],
                         {"axis": H, "start": lo, "stop": hi, "step": 1}, self.g[name], device)

    def _add(self, name: str, op: str, inputs: list[str], attrs: dict, like: Node,
             device: int, meta: dict | None = None) -> str:
        n = make_node(self.g, self.g.fresh_name(name), op, inputs, attrs, like=like,
                      device=device, meta=meta or {"halo": True})
        self.g.add(n)
        return n.name

    # -- which nodes are cut ------------------------------------------------------------
    def cuttable(self, n: Node) -> bool:
        """Whether node `n`'s output can be made in strips (module docstring)."""
        t = n.type
        if t.rank != 4 or not isinstance(t.shape[H], int) or t.shape[H] < self.ways:
            return False
        if n.annotations.get("replicate"):
            return False  # the user keeps it whole
        op = self.ops[n.op]
        if n.op in WINDOW:
            return self._window_ok(n)
        ins = n.inputs[:op.n_tensor_inputs(len(n.inputs))]
        if not any(i in self.strips for i in ins):
            return False  # only a window starts a trunk: the values below are images
        if n.op in NORMS:  # (batchnorm, or batchnorm + relu: synchronised over strips)
            return True
        if n.op == "concat":
            return n.attrs["axis"] in (1, -3)
        if op.layer_type not in ROW_LOCAL_TYPES or op.random:
            return False
        if n.op in NOT_ROW_LOCAL and n.attrs.get("axis", -1) not in (1, -3):
            return False
        return all(self._row_input(i, t) is not None for i in ins)

    def _window_ok(self, n: Node) -> bool:
        x = self.bound[n.inputs[0]].type
        if x.rank != 4 or not isinstance(x.shape[H], int):
            return False
        if n.op == "conv2d":
            return True
        if n.op == "conv_transpose2d":
            # every output row must take some input row (stride within the kernel's
            # span), and no output_padding rows (which get only the bias) at the bottom
            k, s, dil, out_pad = (pool_dims(n.attrs[a], 2, a, n.op)[0] for a in
                                  ("kernel", "stride", "dilation", "output_padding"))
            return s <= dil * (k - 1) + 1 and out_pad == 0
        if n.attrs.get("ceil_mode"):
            return False  # the last window may start past the image: kept whole
        padded = pool_dims(n.attrs["padding"], 2, "padding", n.op)[0] > 0
        return not (n.op == "avgpool" and padded and not n.attrs["count_include_pad"])

    def _row_input(self, name: str, out) -> bool | None:
        """For a row-local node with output type `out`: True if input `name` is read in
        strips (its height is the output's), False if whole (it broadcasts over the
        height), None if neither (the node is not row-local)."""
        t = self.bound[name].type
        if t.rank == out.rank and t.shape[H] == out.shape[H]:
            return True
        axis = t.rank - (out.rank - H)  # the input's axis aligned with the height
        return False if axis < 0 or t.shape[axis] == 1 else None

    # -- the rewrite --------------------------------------------------------------------
    def cut(self, n: Node) -> None:
        """Node `n`'s strips, one per device, side by side."""
        height = n.type.shape[H]
        names = []
        for k, (lo, hi) in enumerate(even_parts(height, self.ways)):
            d = self.device(k)
            name = copy_name(n.name, d, strip=k)
            meta = {**n.meta, "origin": n.name, "hrows": (lo, hi)}
            if self.replicas > 1:
                meta["rows"] = (self.lo, self.hi)
            if n.op == "conv_transpose2d":
                self._transposed_strip(n, d, lo, hi, name, meta)
                names.append(name)
                continue
            if n.op in WINDOW:
                ins, attrs, pre = self._window_inputs(n, d, lo, hi)
            else:
                ins, attrs, pre = self._row_inputs(n, d, lo, hi), dict(n.attrs), None
            if pre is not None:
                ins[0] = pre
            m = make_node(self.g, name, n.op, ins, attrs, like=n, device=d, meta=meta)
            self.g.add(m)
            names.append(name)
        self.strips[n.name] = names

    def _row_inputs(self, n: Node, d: int, lo: int, hi: int) -> list[str]:
        op = self.ops[n.op]
        k = op.n_tensor_inputs(len(n.inputs))
        out = []
        for j, i in enumerate(n.inputs):
            if j < k and self._row_input(i, n.type):
                out.append(self.rows(i, d, lo, hi))
            else:
                out.append(self.on(i, d))
        return out

    def _transposed_strip(self, n: Node, d: int, lo: int, hi: int, name: str,
                          meta: dict) -> None:
        """Output rows [lo, hi) of a transposed convolution: unpadded output row r takes
        input rows i with i s <= r <= i s + dil (k - 1); the strip's input rows (own and
        halo) go through the operator without height padding, and the rows it needs are
        cropped from the result (that slice is the strip)."""
        x = n.inputs[0]
        size = self.bound[x].type.shape[H]
        a = dict(n.attrs)
        k, s, p, dil = (pool_dims(a[f], 2, f, n.op) for f in
                        ("kernel", "stride", "padding", "dilation"))
        span = dil[0] * (k[0] - 1)
        first = max(0, -(-(lo + p[0] - span) // s[0]))  # ceil
        last = min(size, (hi - 1 + p[0]) // s[0] + 1)
        rows = self.rows(x, d, first, last)
        ins = [rows] + [self.on(i, d) for i in n.inputs[1:]]
        a["padding"] = (0, p[1])
        a["output_padding"] = (0, pool_dims(a["output_padding"], 2, "output_padding",
                                            n.op)[1])
        full = self._add(f"{name}.uncropped", n.op, ins, a, n, d,
                         meta={k_: v for k_, v in meta.items()
                               if k_ not in ("origin", "hrows")} | {"halo": True})
        top = lo + p[0] - first * s[0]  # row lo's place in the result
        m = make_node(self.g, name, "slice", [full],
                      {"axis": H, "start": top, "stop": top + hi - lo, "step": 1},
                      like=n, device=d, meta=meta)
        self.g.add(m)

    def _window_inputs(self, n: Node, d: int, lo: int, hi: int):
        """The halo'd input rows of a window node's strip [lo, hi), its attributes for
        the strip, and (pooling) the explicitly padded input."""
        x = n.inputs[0]
        size = self.bound[x].type.shape[H]
        a = dict(n.attrs)
        k = pool_dims(a["kernel"], 2, "kernel", n.op)
        if n.op == "conv2d":
            (top, left), (bottom, right) = explicit_padding(a)
            s = pool_dims(a["stride"], 2, "stride", n.op)
            dil = pool_dims(a["dilation"], 2, "dilation", n.op)[0]
        else:
            s = pool_dims(a["stride"] if a["stride"] is not None else a["kernel"], 2,
                          "stride", n.op)
            top, left = pool_dims(a["padding"], 2, "padding", n.op)
            dil = 1
        first = lo * s[0] - top  # the input rows the strip's windows cover: [first, last)
        last = (hi - 1) * s[0] - top + dil * (k[0] - 1) + 1
        pad_top, pad_bottom = max(0, -first), max(0, last - size)
        rows = self.rows(x, d, max(first, 0), min(last, size))
        ins = [rows] + [self.on(i, d) for i in n.inputs[1:]]
        if n.op == "conv2d":
            a["padding"] = (pad_top, left, pad_bottom, right)
            return ins, a, None
        a["stride"], a["padding"] = s, (0, left)
        pre = None
        if pad_top or pad_bottom:
            fill = -math.inf if n.op == "maxpool" else 0.0
            pre = self._add(f"{rows}.padded@d{d}", "pad", [rows],
                            {"pads": (0, 0, pad_top, pad_bottom), "value": fill},
                            self.bound[x], d)
        return ins, a, pre

    def head(self, n: Node) -> None:
        """Node `n` whole on the replica's first device (it cannot be cut)."""
        ins = [self.on(i, self.base) for i in n.inputs]
        c = n.copy(name=self.named(n.name), inputs=tuple(ins), device=self.base)
        c.meta["origin"] = n.name
        if self.replicas > 1 and batch_dependent(self.fwd[n.name]):
            c.meta["rows"] = (self.lo, self.hi)
        if self.replicas > 1 and self.ops[n.op].random:  # its rows of the batch's numbers
            c.meta.setdefault("rng_key", n.meta.get("rng_key", n.name))
            c.meta["rng_rows"] = (self.lo, self.hi, self.g.batch)
        self.g.add(c)
        self.whole[n.name] = c.name


def spatial_forward(fwd: Graph, batch: int, ways: int, gather: tuple[str, ...] = (),
                    replicas: int = 1) -> tuple[Graph, dict[str, list[str]], list[_Spatial]]:
    """The spatially split forward graph (no communication yet: `connect` adds it), the
    strips of every cut node (all replicas') and the replicas' rewrites (module
    docstring). With one replica the outputs, and the values named in `gather`, are
    whole on device 0 under their own names; with several, each replica's are whole on
    its first device (`combine` then joins the replicas')."""
    g = Graph(fwd.name, [], {}, batch, dict(fwd.parallel), dict(fwd.meta))
    reps = [_Spatial(fwd, g, ways, r, rows, replicas)
            for r, rows in enumerate(batch_rows(batch, replicas, "data-parallel replicas"))]
    whole = reps[0].bound if replicas == 1 else fwd.bind(batch)
    for idx, n in enumerate(fwd.nodes):
        if n.op in STATE_OPS or (not n.is_source and not n.inputs):
            continue  # made on each device that reads it
        if n.is_source:
            g.add(whole.nodes[idx].copy())
            continue  # fed on every device (each replica slices its rows)
        for s in reps:  # node-major: a collective's members side by side
            m = s.bound.nodes[idx]
            if s.cuttable(m):
                s.cut(m)
            else:
                s.head(m)
    strips: dict[str, list[str]] = {}
    for s in reps:
        for x, names in s.strips.items():
            strips.setdefault(x, []).extend(names)
    if not strips:
        raise SplitError(f"network `{fwd.name}` has no convolution, pooling or element-wise "
                         f"layer on an image at least {ways} rows high to split by height")
    for s in reps:
        for x in [x for names in fwd.outputs.values() for x in names] + list(gather):
            s.on(x, s.base)
    if replicas == 1:
        g.outputs = {role: [reps[0].on(x, 0) for x in names]
                     for role, names in fwd.outputs.items()}
    g.meta["spatial_layers"] = list(reps[0].strips)
    return g, strips, reps
