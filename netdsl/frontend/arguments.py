"""Binding call arguments to parameter names, and calling operators with checked
attributes. A mixin of the Elaborator."""
from __future__ import annotations

import difflib

from netdsl.frontend import ast
from netdsl.frontend.checks import check_attr
from netdsl.frontend.values import Tensor, describe_value
from netdsl.ir import registry


class ArgumentBinding:
    def bind_args(self, what: str, names: list[str], args, kwargs, e: ast.Call,
                   variadic: str | None = None, locs: dict | None = None) -> dict:
        """Match positional and keyword arguments to parameter names; `locs` (if given)
        receives where each bound argument is written, for errors about its value."""
        bound: dict = {}
        locs = {} if locs is None else locs
        arg_locs = [a.loc for a in e.args]
        if variadic is not None:
            k = 0
            while k < len(args) and isinstance(args[k], Tensor):
                k += 1
            if k == 1 and isinstance(args[0], Tensor) or k > 1:
                bound[variadic] = tuple(args[:k])
            elif args and isinstance(args[0], tuple):
                bound[variadic], k = args[0], 1
            if variadic in bound:
                locs[variadic] = arg_locs[0]
            args, arg_locs = args[k:], arg_locs[k:]
            names = [n for n in names if n != variadic]
        if len(args) > len(names):
            raise self.error(f"{what} takes at most {len(names)} positional arguments "
                             f"({', '.join(names)}) but {len(args)} were given", e.loc)
        for n, v, loc in zip(names, args, arg_locs):
            bound[n] = v
            locs[n] = loc
        for k, (v, kloc) in kwargs.items():
            if k not in names and k != variadic:
                hint = difflib.get_close_matches(k, names, n=1)
                raise self.error(f"{what} has no argument `{k}`"
                                 + (f"; did you mean `{hint[0]}`?" if hint else
                                    f" (it takes {', '.join(names) or 'none'})"), kloc)
            if k in bound:
                raise self.error(f"{what} got argument `{k}` both by position and by name",
                                 kloc)
            bound[k] = v
            locs[k] = kloc
        return bound

    def call_op(self, name: str, args, kwargs, e: ast.Call):
        op = registry.get(name)
        names, variadic = op.arg_names, op.variadic_arg
        locs: dict = {}
        # `weight=emb.weight`: a keyword that is not an argument but names one of the
        # op's parameters, given a parameter tensor, ties that parameter (checked in add_op)
        shared = {k: kwargs.pop(k) for k in [k for k, (v, _) in kwargs.items()
                                             if k not in names and isinstance(v, Tensor)
                                             and self.g[v.node].op == "param"]}
        bound = self.bind_args(f"{name}()", names, args, kwargs, e, variadic, locs)
        tensors, attrs = [], {}
        for a in op.signature:
            if a.name not in bound:
                if a.required:
                    raise self.error(f"{name}() is missing its argument `{a.name}`", e.loc)
                continue
            v = bound[a.name]
            # errors about one argument point at that argument, not at the callee
            aloc = locs.get(a.name, e.loc)
            if a.kind == "tensor":
                if not isinstance(v, Tensor):
                    raise self.error(f"{name}() expects a tensor for `{a.name}`, but got "
                                     f"{describe_value(v)}", aloc)
                tensors.append(v)
            elif a.kind == "tensors":
                if not v or not all(isinstance(t, Tensor) for t in v):
                    raise self.error(f"{name}() expects one or more tensors", aloc)
                tensors.extend(v)
            else:
                attrs[a.name] = check_attr(self, name, a, v, aloc)
        return self.emit(name, tensors, attrs, e.loc,
                         shared={k: (v.node, loc) for k, (v, loc) in shared.items()})

