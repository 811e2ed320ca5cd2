"""Annotations: which exist, what arguments they take, and where they may appear.

Memory hints (@recompute, @offload, @keep) and placement (@stage(k), @device(k),
@shard(dim, ways), @replicate, @shard_unit) are carried into node annotations; later
passes give them meaning. Here they are only validated. `@shard_unit` (on a statement or
a block) makes each evaluation of what it annotates one unit of ZeRO stage 3's parameter
gathers; its value is that evaluation's number, so each block instance (each copy of a
`repeat`) is a unit of its own, and the innermost annotation wins.
"""
from __future__ import annotations

SHARD_DIMS = ("batch", "channels", "height", "width", "features", "heads")
MEMORY_HINTS = ("recompute", "offload", "keep")


def check_annotations(anns, el, where: str, frame=None) -> dict:
    """Validate annotations; their arguments are evaluated in `frame` (the statement's
    own, so `@stage(i)` may use a repeat index), else at module level."""
    out: dict = {}
    for a in anns:
        vals = []
        for x in a.args:
            from netdsl.frontend.ast import Name
            # `@shard(channels, 2)`: a bare dimension name is a word, not a variable
            # (any bare name, so `@shard(rows, 2)` says which words are allowed instead of
            # "`rows` is not defined")
            if isinstance(x, Name) and a.name == "shard" and x is a.args[0]:
                vals.append(x.id)
            else:
                vals.append(el.expr(x, frame if frame is not None else _frame(el)))
        if a.kwargs:
            raise el.error(f"@{a.name} takes no keyword arguments", a.kwargs[0][2])
        if a.name in out:
            raise el.error(f"@{a.name} is given twice", a.loc)
        if a.name in MEMORY_HINTS or a.name == "replicate":
            if vals:
                raise el.error(f"@{a.name} takes no arguments", a.loc)
            out[a.name] = True
        elif a.name in ("stage", "device"):
            if len(vals) != 1 or not isinstance(vals[0], int) or isinstance(vals[0], bool) \
                    or vals[0] < 0:
                raise el.error(f"@{a.name} takes one non-negative integer, e.g. "
                               f"@{a.name}(1)", a.loc)
            out[a.name] = vals[0]
        elif a.name == "shard":
            if len(vals) != 2 or vals[0] not in SHARD_DIMS or not isinstance(vals[1], int) \
                    or isinstance(vals[1], bool) or vals[1] < 1:
                raise el.error(f"@shard takes a dimension ({', '.join(SHARD_DIMS)}) and a "
                               "positive number of ways, e.g. @shard(channels, 2)", a.loc)
            out[a.name] = (vals[0], vals[1])
        elif a.name == "shard_unit":
            if vals:
                raise el.error("@shard_unit takes no arguments", a.loc)
            out[a.name] = el.new_shard_unit()
        else:
            known = ", ".join("@" + k for k in MEMORY_HINTS + ("stage", "device", "shard",
                                                                  "replicate", "shard_unit"))
            raise el.error(f"unknown annotation @{a.name} (known: {known})", a.loc)
    hints = [h for h in MEMORY_HINTS if h in out]
    if len(hints) > 1:
        raise el.error(f"@{hints[0]} and @{hints[1]} contradict each other", anns[0].loc)
    if "shard" in out and "replicate" in out:
        raise el.error("@shard and @replicate contradict each other", anns[0].loc)
    if where == "network" and out:
        raise el.error("annotations on a network are not supported; use `parallel { }`",
                       anns[0].loc)
    return out


def _frame(el):
    from netdsl.frontend.frames import Frame
    return Frame({}, el.module, None)


def merge_annotations(outer: dict, inner: dict) -> dict:
    """Inner annotations win; an inner memory hint replaces an outer one, so
    `@recompute` on a block and `@keep` on one of its statements mean: keep that one."""
    if any(h in inner for h in MEMORY_HINTS):
        outer = {k: v for k, v in outer.items() if k not in MEMORY_HINTS}
    if "shard" in inner or "replicate" in inner:
        outer = {k: v for k, v in outer.items() if k not in ("shard", "replicate")}
    return {**outer, **inner}
