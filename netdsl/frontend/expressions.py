"""Evaluating expressions: names, static arithmetic (range-checked), tensor arithmetic,
indexing, attributes and calls. A mixin of the Elaborator (it uses `error` and `emit`)."""
from __future__ import annotations

import difflib
import math
import operator

from netdsl.errors import SourceLoc
from netdsl.frontend import ast, tensor_arith
from netdsl.frontend.checks import int_in_range
from netdsl.frontend.frames import Frame
from netdsl.frontend.synonyms import by_meaning
from netdsl.frontend.values import (
    POISON,
    BlockRef,
    Builtin,
    ModuleRef,
    OpRef,
    Tensor,
    is_num,
    kind_of,
)
from netdsl.ir import registry
from netdsl.ir.types import BATCH

# Static integers are 64-bit signed (registry.INT_MIN..INT_MAX), checked where each is
# made; `**` is checked before computing, as `10 ** 10 ** 10` exactly would hang.
MAX_INT_BITS = 64

_ARITH = {"+": operator.add, "-": operator.sub, "*": operator.mul, "//": operator.floordiv,
          "%": operator.mod, "**": operator.pow, "/": operator.truediv}
_COMPARE = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
            ">": operator.gt, ">=": operator.ge}


_METHOD_NAMES: dict = {}  # AST node class -> the name of the method that evaluates it


class Expressions:
    # -- values --------------------------------------------------------------------------
    def tensor_value(self, e: ast.Expr, frame: Frame, what: str):
        v = self.expr(e, frame)
        if v is POISON:
            return POISON
        if not isinstance(v, Tensor):
            raise self.error(f"the {what} must be a tensor, not {kind_of(v)}", e.loc)
        return v

    def lookup(self, name: str, loc: SourceLoc, frame: Frame):
        for table in (frame.locals, frame.module.globals, self.builtins):
            if name in table:
                return table[name]
        if name in registry.OPS and registry.OPS[name].callable_from_language:
            return OpRef(name)
        if name == BATCH:
            return BATCH
        known = list(frame.locals) + list(frame.module.globals) + list(self.builtins) + [
            o for o in registry.OPS if registry.OPS[o].callable_from_language]
        msg = f"`{name}` is not defined"
        # by meaning first (`upsample`, `dense`, `cross_entropy`), then by spelling
        meant = by_meaning(name, lambda c: c in known)
        if meant is not None:
            msg += f"; {meant}"
        else:
            hint = difflib.get_close_matches(name, known, n=1)
            if hint:
                msg += f"; did you mean `{hint[0]}`?"
        raise self.error(msg, loc)

    def expr(self, e: ast.Expr, frame: Frame):
        # the method's name is built once per AST class, not once per node (a big file has
        # millions of nodes)
        name = _METHOD_NAMES.get(type(e))
        if name is None:
            name = _METHOD_NAMES[type(e)] = "e_" + type(e).__name__
        return getattr(self, name)(e, frame)

    def e_Name(self, e: ast.Name, frame):
        return self.lookup(e.id, e.loc, frame)

    def e_Const(self, e: ast.Const, frame):
        return e.value

    def e_TupleExpr(self, e: ast.TupleExpr, frame):
        return tuple(self.expr(x, frame) for x in e.items)

    def e_Attr(self, e: ast.Attr, frame):
        obj = self.expr(e.obj, frame)
        if obj is POISON:
            return POISON
        if isinstance(obj, ModuleRef):
            g = obj.module.globals
            if e.name not in g or isinstance(g[e.name], ModuleRef):
                hint = difflib.get_close_matches(e.name, list(g), n=1)
                raise self.error(f"module `{obj.module.name}` has no block `{e.name}`"
                                 + (f"; did you mean `{hint[0]}`?" if hint else ""), e.loc)
            return g[e.name]
        if isinstance(obj, Tensor):
            props = {"shape": obj.type.shape, "rank": obj.type.rank,
                     "channels": obj.type.shape[1] if obj.type.rank > 1 else None,
                     "dtype": obj.type.dtype}
            if e.name in props and props[e.name] is not None:
                return props[e.name]
            # `emb.weight`: a parameter of the operator that made the tensor, to tie it
            pnode = f"{obj.node}.{e.name}"
            if pnode in self.g and self.g[pnode].op == "param":
                return Tensor(pnode, self.g[pnode].type, f"the {e.name} of {obj.describe()}")
        raise self.error(f"{kind_of(obj)} has no attribute `{e.name}`", e.loc)

    def e_Index(self, e: ast.Index, frame):
        obj, i = self.expr(e.obj, frame), self.expr(e.index, frame)
        if obj is POISON or i is POISON:
            return POISON
        if not isinstance(obj, tuple):
            raise self.error(f"only tuples and shapes can be indexed, not {kind_of(obj)} "
                             "(use slice() or split() on tensors)", e.loc)
        if not isinstance(i, int) or isinstance(i, bool):
            raise self.error(f"an index must be an integer, not {kind_of(i)}", e.index.loc)
        if not -len(obj) <= i < len(obj):
            raise self.error(f"index {i} is out of range for a tuple of {len(obj)}", e.loc)
        return obj[i]

    def e_Unary(self, e: ast.Unary, frame):
        v = self.expr(e.operand, frame)
        if v is POISON:
            return POISON
        if e.op == "not":
            if not isinstance(v, bool):
                raise self.error(f"`not` needs true or false, not {kind_of(v)}", e.loc)
            return not v
        if isinstance(v, Tensor):
            return self.emit("scale", [v], {"factor": -1.0}, e.loc)
        if not is_num(v):
            raise self.error(f"cannot negate {kind_of(v)}", e.loc)
        return -v

    def e_Cond(self, e: ast.Cond, frame):
        c = self.expr(e.test, frame)
        if c is POISON:
            return POISON
        if not isinstance(c, bool):
            raise self.error(f"an `if` condition must be true or false, not {kind_of(c)}",
                             e.test.loc)
        return self.expr(e.then if c else e.orelse, frame)

    def e_BinOp(self, e: ast.BinOp, frame):
        if e.op in ("and", "or"):
            a = self.expr(e.left, frame)
            if a is POISON:
                return POISON
            if not isinstance(a, bool):
                raise self.error(f"`{e.op}` needs true or false, not {kind_of(a)}", e.left.loc)
            if (e.op == "and" and not a) or (e.op == "or" and a):
                return a
            b = self.expr(e.right, frame)
            if b is not POISON and not isinstance(b, bool):
                raise self.error(f"`{e.op}` needs true or false, not {kind_of(b)}", e.right.loc)
            return b
        a, b = self.expr(e.left, frame), self.expr(e.right, frame)
        if a is POISON or b is POISON:
            return POISON
        if isinstance(a, Tensor) or isinstance(b, Tensor):
            return self.tensor_binop(e, a, b)
        if e.op in _COMPARE:
            if e.op in ("==", "!="):
                return _COMPARE[e.op](a, b)
            if not (is_num(a) and is_num(b)):
                raise self.error(f"cannot compare {kind_of(a)} with {kind_of(b)}", e.loc)
            return _COMPARE[e.op](a, b)
        if BATCH in (a, b):
            raise self.error("the batch dimension N cannot take part in arithmetic; "
                             "use it whole, e.g. reshape(x, (N, -1))", e.loc)
        if e.op == "+" and isinstance(a, tuple) and isinstance(b, tuple):
            return a + b
        if not (is_num(a) and is_num(b)):
            raise self.error(f"cannot apply `{e.op}` to {kind_of(a)} and {kind_of(b)}", e.loc)
        if e.op in ("/", "//", "%") and b == 0:
            raise self.error("division by zero", e.loc)
        if e.op == "**" and a == 0 and b < 0:
            raise self.error("division by zero (0 raised to a negative power)", e.loc)
        if e.op == "**" and isinstance(a, int) and isinstance(b, int) and abs(a) > 1 \
                and b * (abs(a).bit_length() - 1) > MAX_INT_BITS:
            # checked before computing: `10 ** 10 ** 10` would run (almost) forever
            raise self.error(f"{a} ** {b} is too large (static integers have at most "
                             f"{MAX_INT_BITS} bits)", e.loc)
        try:
            r = _ARITH[e.op](a, b)
        except (OverflowError, ValueError, ZeroDivisionError) as ex:
            # OverflowError's text is an errno tuple, "(34, 'Numerical result out of range')"
            what = "is too large for a float" if isinstance(ex, OverflowError) else "is undefined"
            raise self.error(f"the result of `{a!r} {e.op} {b!r}` {what}", e.loc) from None
        if isinstance(r, complex):  # (-8) ** 0.5
            raise self.error(f"{a} ** {b} has no real value", e.loc)
        if isinstance(r, int) and not int_in_range(r):
            raise self.error(f"the result of `{e.op}`, {r}, does not fit in a 64-bit integer "
                             "(static integers are 64-bit signed)", e.loc)
        if isinstance(r, float) and not math.isfinite(r):
            raise self.error(f"the result of `{e.op}` is too large for a float", e.loc)
        return r

    def tensor_binop(self, e: ast.BinOp, a, b):
        return tensor_arith.binop(self, e, a, b)

    # -- calls ---------------------------------------------------------------------------
    def e_Call(self, e: ast.Call, frame):
        f = self.expr(e.func, frame)
        args = [self.expr(a, frame) for a in e.args]
        kwargs = {}
        for name, ex, kloc in e.kwargs:
            if name in kwargs:
                raise self.error(f"argument `{name}` is given twice", kloc)
            kwargs[name] = (self.expr(ex, frame), kloc)
        if f is POISON or any(a is POISON for a in args) or any(
                v is POISON for v, _ in kwargs.values()):
            return POISON
        if isinstance(f, OpRef):
            return self.call_op(f.name, args, kwargs, e)
        if isinstance(f, BlockRef):
            return self.call_block(f, args, kwargs, e)
        if isinstance(f, Builtin):
            return f.fn(args, {k: v for k, (v, _) in kwargs.items()}, e)
        raise self.error(f"{kind_of(f)} cannot be called", e.loc)

