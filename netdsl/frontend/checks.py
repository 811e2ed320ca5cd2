"""Checks of static values given to operators: kinds, ranges and choices of attributes."""
from __future__ import annotations

from netdsl.errors import SourceLoc
from netdsl.frontend.values import describe_value, is_num, show
from netdsl.ir import registry
from netdsl.ir.types import BATCH


def check_attr(el, op: str, a: registry.Arg, v, loc: SourceLoc):
    def bad(expect):
        # a tensor used to print as "but got a tensor f32[N, 4] " with no name
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
    elif a.kind == "shape":
        if not isinstance(v, tuple) or not all(
                x == BATCH or isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise bad("a shape: a tuple of integers, -1 or N")
    if a.choices and v not in a.choices:
        raise el.error(f"{op}() `{a.name}` must be one of "
                         f"{', '.join(map(str, a.choices))}, not {show(v)}", loc)
    return v

