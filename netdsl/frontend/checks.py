"""Checks of static values: the kinds, ranges and choices of operator attributes, and the
64-bit range of every static integer (a literal, an arithmetic result, `int()`)."""
from __future__ import annotations

import math

from netdsl.errors import SourceLoc
from netdsl.frontend import tensor_arith
from netdsl.frontend.values import describe_value, is_num, show
from netdsl.ir import registry
from netdsl.ir.registry import INT_MAX, INT_MIN
from netdsl.ir.types import BATCH


def check_attr(el, op: str, a: registry.Arg, v, loc: SourceLoc):
    def bad(expect):
        # describe_value names a tensor by its variable or origin, not by its type alone
        return el.error(f"{op}() expects {expect} for `{a.name}`, but got "
                        f"{describe_value(v)}", loc)
    is_int = isinstance(v, int) and not isinstance(v, bool)
    if a.kind in ("int", "axis"):
        if not is_int:
            raise bad("an integer")
    elif a.kind == "float":
        if not is_num(v):
            raise bad("a number")
    elif a.kind == "bool":
        if not isinstance(v, bool):
            raise bad("true or false")
    elif a.kind == "str":
        if not isinstance(v, str):
            raise bad("a string")
    elif a.kind == "pair":
        if v is None and a.default is None:
            return v
        ok = is_int or (isinstance(v, tuple) and len(v) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) for x in v))
        if not ok:
            raise bad("an integer or a pair of integers")
    elif a.kind == "ints":
        if is_int:
            v = (v,)
        if not isinstance(v, tuple) or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise bad("a tuple of integers")
    elif a.kind in tensor_arith.EXTRA_KINDS:
        expect = tensor_arith.check_kind(a.kind, v)
        if expect:
            raise bad(expect)
    elif a.kind == "shape":
        if not isinstance(v, tuple) or not all(
                x == BATCH or isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise bad("a shape: a tuple of integers, -1 or N")
    if a.choices and v not in a.choices:
        raise el.error(f"{op}() `{a.name}` must be one of "
                       f"{', '.join(map(str, a.choices))}, not {show(v)}", loc)
    _check_range(el, op, a, v, loc)
    return v


def int_in_range(v) -> bool:
    return INT_MIN <= v <= INT_MAX


def _numbers(a: registry.Arg, v) -> tuple:
    """The numbers an attribute holds: itself, or the ints of a pair, tuple or shape."""
    if a.kind in ("int", "axis", "float"):
        return (v,)
    if a.kind in ("pair", "ints", "shape", "axes", "floats", "padding"):
        vals = v if isinstance(v, tuple) else (v,)
        return tuple(x for x in vals if is_num(x))
    return ()


def _check_range(el, op: str, a: registry.Arg, v, loc: SourceLoc) -> None:
    for x in _numbers(a, v):
        if isinstance(x, float) and not math.isfinite(x):
            raise el.error(f"{op}() `{a.name}` must be a finite number, not {x}", loc)
        if isinstance(x, int) and not int_in_range(x):
            raise el.error(f"{op}() `{a.name}` = {x} does not fit in a 64-bit integer", loc)
        if a.range is not None and x not in a.range:
            each = " (each value)" if isinstance(v, tuple) else ""
            raise el.error(f"{op}() `{a.name}` must be {_words(a.range)}{each}, not {show(x)}",
                           loc)


def _words(r: registry.Range) -> str:
    """A Range in words: "at least 1", "greater than 0", "in [0, 1)"."""
    text = str(r)
    for sym, words in ((">=", "at least"), (">", "greater than"), ("<=", "at most"),
                       ("<", "less than")):
        if text.startswith(sym + " "):
            return f"{words} {text[len(sym) + 1:]}"
    return f"in {text}"

