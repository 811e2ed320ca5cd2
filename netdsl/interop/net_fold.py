"""Find the repeated structure in a `Program` (flat netdsl calls): the segments between
single-value cuts, and the blocks (with parameters) that equal segments are instances of.

1. Cut the call sequence where exactly one value is live: between two cuts lies a segment
   with one input and one output (a residual block, a conv-bn-relu). A one-call segment
   that only post-processes joins the one before it; a kind of segment that always
   follows one other kind joins it (a fire module's squeeze and expand parts).
2. Segments of two or more calls with the same skeleton (operators, wiring, non-numeric
   attributes) are instances of one block; the numeric attributes that differ between
   instances (widths, strides...) become its parameters, one per distinct column.
`net_writer` writes the blocks, their calls, and `repeat`s of equal consecutive calls.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from netdsl.interop.onnx_read import Call, Program
from netdsl.ir import registry

# numeric attributes that may differ between instances of one block
ABSTRACT = {"out_channels": "width", "out_features": "features", "kernel": "kernel",
            "stride": "stride", "padding": "padding", "dilation": "dilation",
            "groups": "groups", "num": "num", "dim": "dim"}
_SHORT = {"conv2d": "conv", "batchnorm": "bn", "layernorm": "ln", "linear": "fc",
          "maxpool": "pool", "avgpool": "pool", "global_avgpool": "gap"}
_FOLLOWERS = ("norm", "activation", "elementwise", "dropout")


@dataclass
class Segment:
    calls: list[Call]
    input: str | None  # the one value it reads from before it (None: several)

    @property
    def out(self) -> str:
        return self.calls[-1].out


@dataclass
class BlockType:
    name: str
    skeleton: tuple
    params: list[str]  # parameter names, in call order
    columns: list[int | None]  # per abstract position: index into params, or None (constant)
    constants: list  # per abstract position: its value when constant
    instances: list[Segment]


# -- segments and blocks ------------------------------------------------------------------------

def segments(p: Program) -> list[Segment]:
    calls = p.calls
    last = {}
    for i, c in enumerate(calls):
        for a in c.args:
            last[a] = i
    for o in p.outputs:
        last[o] = len(calls)
    live = {name for name, _ in p.inputs if name in last}
    segs, start = [], 0
    prev = next(iter(live)) if len(live) == 1 else None
    for i, c in enumerate(calls):
        for a in set(c.args):
            if last.get(a) == i:
                live.discard(a)
        if last.get(c.out, -1) > i:
            live.add(c.out)
        if live == {c.out}:
            segs.append(Segment(calls[start:i + 1], prev))
            start, prev = i + 1, c.out
    if start < len(calls):
        segs.append(Segment(calls[start:], prev))
    return _merge_pairs(_attach_followers(segs))


def _attach_followers(segs: list[Segment]) -> list[Segment]:
    """A one-call segment that only post-processes (norm, activation, element-wise: the
    ReLU after a residual sum, the BN after a convolution) joins the segment before it, so
    conv-bn-relu and residual-then-relu are one unit each."""
    out: list[Segment] = []
    for s in segs:
        if (out and len(s.calls) == 1 and s.input == out[-1].out
                and registry.get(s.calls[0].op).layer_type in _FOLLOWERS):
            out[-1] = Segment(out[-1].calls + s.calls, out[-1].input)
        else:
            out.append(s)
    return out


def _merge_pairs(segs: list[Segment]) -> list[Segment]:
    """Join segments of kind B to the segment before them when every B (two or more) comes
    right after a segment of one other kind A that never repeats back to back: SqueezeNet's
    squeeze conv and its expand branches become one fire unit. Runs of one kind are left
    for `repeat`; merged kinds are not merged again."""
    original = [skeleton(s)[0] for s in segs]
    for b in dict.fromkeys(k for k in original if k is not None):
        kinds = [skeleton(s)[0] for s in segs]
        idx = [i for i, k in enumerate(kinds) if k == b]
        if len(idx) < 2 or idx[0] == 0:
            continue
        before = {kinds[i - 1] for i in idx}
        a = next(iter(before))
        if (len(before) != 1 or a is None or a == b
                or any(x == y == a for x, y in zip(kinds, kinds[1:]))
                or any(segs[i].input != segs[i - 1].out for i in idx)):
            continue
        for i in reversed(idx):
            segs[i - 1:i + 1] = [Segment(segs[i - 1].calls + segs[i].calls, segs[i - 1].input)]
    return segs


def skeleton(s: Segment):
    """(structure, numeric values): equal structures are instances of one block."""
    if s.input is None:
        return None, []
    idx = {s.input: "in"}
    sk, vec = [], []
    for j, c in enumerate(s.calls):
        if any(a not in idx for a in c.args):
            return None, []
        fixed = tuple(sorted((k, v) for k, v in c.attrs.items() if k not in ABSTRACT))
        abstract = tuple(k for k in c.attrs if k in ABSTRACT)
        sk.append((c.op, tuple(idx[a] for a in c.args), fixed, abstract, tuple(c.params)))
        vec.extend(c.attrs[k] for k in abstract)
        idx[c.out] = j
    return tuple(sk), vec


def block_types(segs: list[Segment]) -> dict[int, BlockType]:
    """Blocks for the skeletons two or more segments share; keyed by id(segment)."""
    groups: dict[tuple, list[Segment]] = {}
    vecs: dict[int, list] = {}
    for s in segs:
        if len(s.calls) < 2:
            continue
        sk, vec = skeleton(s)
        if sk is not None:
            groups.setdefault(sk, []).append(s)
            vecs[id(s)] = vec
    out: dict[int, BlockType] = {}
    taken: Counter = Counter()
    for sk, inst in groups.items():
        if len(inst) < 2:
            continue
        cols = list(zip(*(vecs[id(s)] for s in inst)))
        names, columns, consts, seen = [], [], [], {}
        keys = [k for _, _, _, abstract, _ in sk for k in abstract]
        for key, col in zip(keys, cols):
            if len(set(col)) == 1:
                columns.append(None)
                consts.append(col[0])
                continue
            if col not in seen:
                base = ABSTRACT[key]
                n = sum(1 for x in names if x.rstrip("0123456789") == base)
                seen[col] = len(names)
                names.append(base if n == 0 else f"{base}{n + 1}")
            columns.append(seen[col])
            consts.append(None)
        bt = BlockType(_block_name(sk, taken), sk, names, columns, consts, inst)
        for s in inst:
            out[id(s)] = bt
    return out


def _block_name(sk, taken: Counter) -> str:
    ops = [op for op, *_ in sk]
    if any(op in ("add", "concat") and len(refs) > 1 and "in" in refs or
           op in ("add", "concat") and len(set(refs)) > 1 for op, refs, *_ in sk):
        base = "residual" if "add" in ops else "branches"
    else:
        base = "_".join(_SHORT.get(op, op) for op in ops[:4])
    taken[base] += 1
    return base if taken[base] == 1 else f"{base}{taken[base]}"


def call_args(bt: BlockType, s: Segment) -> list:
    _, vec = skeleton(s)
    args: list = [None] * len(bt.params)
    for col, v in zip(bt.columns, vec):
        if col is not None:
            args[col] = v
    return args
