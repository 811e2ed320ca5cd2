"""Operators in expressions whose operands include a tensor, and the argument kinds added
for the wider operator set (axes, floats, padding).

`binop` turns `a <op> b` into graph nodes: two tensors use the element-wise operator
(`+ - * / **`, comparisons give bool masks); a tensor and a number use `scale` for
`x * k` and `x / k`, and otherwise a scalar constant - a `fill` node of shape
() and the tensor's element type - and the broadcasting operator: `x - 1`, `1 - x`,
`2 / x`, `h ** 2`, `x > 0`. The builtins `max` and `min` with a tensor argument are
element-wise (`max(x, 0)`), through `minmax`.
"""
from __future__ import annotations

from netdsl.frontend.values import Tensor, kind_of

TENSOR_OPS = {"+": "add", "-": "sub", "*": "mul", "/": "div", "**": "pow",
              ">": "greater", "<": "less", ">=": "greater_equal", "<=": "less_equal",
              "==": "equal"}


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def binop(el, e, a, b):
    """`a e.op b` where a or b is a Tensor; `el` is the Elaborator (emit, error)."""
    op = TENSOR_OPS.get(e.op)
    if isinstance(a, Tensor) and isinstance(b, Tensor) and op:
        return el.emit(op, [a, b], {}, e.loc)
    t, k = (a, b) if isinstance(a, Tensor) else (b, a)
    if not _is_num(k) or op is None:
        raise el.error(f"cannot apply `{e.op}` to {kind_of(a)} and {kind_of(b)}", e.loc)
    if e.op == "*" or (e.op == "/" and t is a):
        if e.op == "/" and k == 0:
            raise el.error("division by zero", e.loc)
        return el.emit("scale", [t], {"factor": float(k if e.op == "*" else 1 / k)}, e.loc)
    if not t.type.is_float and (isinstance(k, float) or e.op in ("/", "**")):
        raise el.error(f"cannot apply `{e.op}` to {kind_of(t)} and {kind_of(k)} {k!r}: "
                       "use cast() to make the tensor floating-point first", e.loc)
    const = el.emit("fill", [], {"shape": (), "value": float(k), "dtype": t.type.dtype}, e.loc)
    return el.emit(op, [a, const] if t is a else [const, b], {}, e.loc)


def minmax(el, name: str, vals, e):
    """The builtins `max(a, b, ...)` / `min(...)` with a tensor among the arguments: a chain
    of element-wise `maximum` / `minimum` (numbers become scalar constants)."""
    op = {"max": "maximum", "min": "minimum"}[name]
    like = next(v for v in vals if isinstance(v, Tensor))
    parts = []
    for v in vals:
        if isinstance(v, Tensor):
            parts.append(v)
        elif _is_num(v) and (like.type.is_float or isinstance(v, int)):
            parts.append(el.emit("fill", [], {"shape": (), "value": float(v),
                                              "dtype": like.type.dtype}, e.loc))
        else:
            raise el.error(f"{name}() of tensors takes tensors and numbers, not "
                           f"{kind_of(v)}", e.loc)
    if len(parts) < 2:
        raise el.error(f"{name}() of a tensor needs a second argument; for a reduction use "
                       f"a{'max' if name == 'max' else 'min'}(x, axis)", e.loc)
    acc = parts[0]
    for p in parts[1:]:
        acc = el.emit(op, [acc, p], {}, e.loc)
    return acc


EXTRA_KINDS = ("axes", "floats", "padding")


def check_kind(kind: str, v) -> str | None:
    """What a value of argument kind `kind` should have been, or None if `v` is one."""
    def is_int(x):
        return isinstance(x, int) and not isinstance(x, bool)

    if kind == "axes":
        if is_int(v) or isinstance(v, tuple) and v and all(is_int(x) for x in v):
            return None
        return "an axis or a tuple of axes"
    if kind == "floats":
        if isinstance(v, tuple) and all(_is_num(x) for x in v):
            return None
        return "a tuple of numbers"
    if kind == "padding":
        if v in ("same", "valid") or is_int(v) or isinstance(v, tuple) and v and all(
                is_int(x) for x in v):
            return None
        return 'an integer, a tuple of integers, "same" or "valid"'
    return None
