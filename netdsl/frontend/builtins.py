"""The language's builtin functions: channels, shape, rank, len, min, max, int, split,
parameter."""
from __future__ import annotations

import functools

from netdsl.frontend import tensor_arith
from netdsl.frontend.checks import int_in_range
from netdsl.frontend.values import Builtin, Tensor, is_num, where
from netdsl.ir.rewrite import make_source
from netdsl.ir.types import TensorType


def builtins(el) -> dict:
    """The builtin functions of elaborator `el`, by name: each is called as
    `fn(args, kwargs, call_expr)` and reports errors through `el`."""
    return {name: Builtin(name, functools.partial(fn, el)) for name, fn in _TABLE.items()}


def _need_tensor(el, fname, args, e, n=1):
    if len(args) != n or not all(isinstance(a, Tensor) for a in args[:n]):
        raise el.error(f"{fname}() takes {n} tensor argument{'s' * (n > 1)}", e.loc)
    return args


def _channels(el, args, kw, e):
    (t,) = _need_tensor(el, "channels", args, e)
    if t.type.rank < 2:
        raise el.error(f"channels() needs a tensor of rank 2 or more, but "
                       f"{t.describe()} is {t.type}", e.loc)
    return t.type.shape[1]


def _shape(el, args, kw, e):
    return _need_tensor(el, "shape", args, e)[0].type.shape


def _rank(el, args, kw, e):
    return _need_tensor(el, "rank", args, e)[0].type.rank


def _length(el, args, kw, e):
    if len(args) != 1 or not isinstance(args[0], tuple):
        raise el.error("len() takes one tuple", e.loc)
    return len(args[0])


def _minmax(fn):
    def f(el, args, kw, e):
        vals = args[0] if len(args) == 1 and isinstance(args[0], tuple) else args
        if any(isinstance(v, Tensor) for v in vals):  # element-wise on tensors
            return tensor_arith.minmax(el, fn.__name__, vals, e)
        if not vals or not all(is_num(v) for v in vals):
            raise el.error(f"{fn.__name__}() takes numbers", e.loc)
        return fn(vals)
    return f


def _to_int(el, args, kw, e):
    if len(args) != 1 or not is_num(args[0]):
        raise el.error("int() takes one number", e.loc)
    try:
        r = int(args[0])
    except (OverflowError, ValueError):  # int(inf), int(nan)
        raise el.error(f"int(): {args[0]} has no integer value", e.loc) from None
    if not int_in_range(r):  # int(1e30)
        raise el.error(f"int(): {args[0]} does not fit in a 64-bit integer", e.loc)
    return r


def _split(el, args, kw, e):
    if not args or not isinstance(args[0], Tensor):
        raise el.error("split() takes a tensor, then the number of parts or their sizes",
                       e.loc)
    t = args[0]
    unknown = set(kw) - {"sections", "axis"}
    if unknown:
        raise el.error(f"split() has no argument `{sorted(unknown)[0]}` "
                       "(it takes x, sections, axis)", e.loc)
    sections = args[1] if len(args) > 1 else kw.get("sections")
    axis = args[2] if len(args) > 2 else kw.get("axis", 1)
    if not isinstance(axis, int) or isinstance(axis, bool) or \
            not -t.type.rank <= axis < t.type.rank:
        raise el.error(f"split(): axis {axis!r} is out of range for {t.type}", e.loc)
    out, start = [], 0
    for s in _split_sizes(el, t.type.shape[axis], sections, e):
        out.append(el.emit("slice", [t], {"axis": axis, "start": start,
                                          "stop": start + s}, e.loc))
        start += s
    return tuple(out)


def _split_sizes(el, size, sections, e) -> list[int]:
    """The parts' sizes along an axis of `size`: `sections` equal parts, or the sizes."""
    if not isinstance(size, int):
        raise el.error("split(): cannot split the batch dimension", e.loc)
    if isinstance(sections, int) and not isinstance(sections, bool):
        if sections < 1 or size % sections:
            raise el.error(f"split(): {size} does not divide into {sections} equal parts",
                           e.loc)
        return [size // sections] * sections
    if isinstance(sections, tuple) and all(isinstance(s, int) and s > 0 for s in sections):
        if sum(sections) != size:
            raise el.error(f"split(): sizes {sections} add up to {sum(sections)}, but the "
                           f"axis has {size}", e.loc)
        return list(sections)
    raise el.error("split() needs the number of parts or a tuple of sizes", e.loc)


def _parameter(el, args, kw, e):
    shp = args[0] if args else kw.get("shape")
    init = kw.get("init", args[1] if len(args) > 1 else "normal")
    if not isinstance(shp, tuple) or not shp or not all(
            isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shp):
        raise el.error("parameter() needs a shape: a tuple of positive integers", e.loc)
    if init not in ("normal", "zeros", "ones", "uniform_fan_in"):
        raise el.error(f"parameter(): unknown init \"{init}\" (normal, zeros, ones)", e.loc)
    t = TensorType(tuple(shp))
    if (why := t.size_error()) is not None:
        raise el.error(f"parameter(): {why}", e.loc)
    name = el.node_name("parameter")
    el.g.add(make_source(name, "param", t, {"shape": tuple(shp), "init": init,
                                            "fan_in": shp[-1], "std": 0.02},
                         loc=e.loc, stack=tuple(el.stack), scope=tuple(el.scope),
                         annotations=dict(el.anns[-1])))
    return Tensor(name, t, f"parameter at {where(e.loc)}")


_TABLE = {"channels": _channels, "shape": _shape, "rank": _rank, "len": _length,
          "min": _minmax(min), "max": _minmax(max), "int": _to_int, "split": _split,
          "parameter": _parameter}
