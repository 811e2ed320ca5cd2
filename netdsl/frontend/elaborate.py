"""AST -> graph IR: evaluate a network, expanding blocks, conditionals and repeats.

Static values (ints, tuples, shapes) are computed here; every operator call becomes a node
via `ir.build.add_op`, so shapes are inferred as the program runs. Errors are collected,
not raised at once: a failing statement binds its names to POISON, and uses of POISON
report nothing further, so one run lists every independent mistake.
"""
from __future__ import annotations

import difflib
import operator
from dataclasses import dataclass

from netdsl.errors import CallSite, Diagnostic, NetdslError, ShapeError, SourceLoc
from netdsl.frontend import ast, tensor_arith
from netdsl.frontend.annotations import check_annotations, merge_annotations
from netdsl.frontend.modules import ModuleEnv
from netdsl.frontend.train import pydantic_message
from netdsl.frontend.values import (
    POISON,
    BlockRef,
    Builtin,
    ModuleRef,
    OpRef,
    Tensor,
    kind_of,
    where,
)
from netdsl.ir import registry
from netdsl.ir.build import add_op
from netdsl.ir.graph import Graph, Node
from netdsl.ir.types import BATCH, DTYPES, TensorType

MAX_REPEAT = 1_000_000
# Block calls nested deeper than this are reported as runaway recursion. It is well below
# what Python's own stack allows (each level costs several interpreter frames), so the
# check fires first; deeper expression nesting is caught as RecursionError per statement.
MAX_BLOCK_DEPTH = 64
# Static integers are capped: a result wider than this is surely a mistake, and computing
# `10 ** 10 ** 10` exactly would hang.
MAX_INT_BITS = 64


class _Fail(Exception):
    """Aborts the current statement; the diagnostic has already been recorded."""


class _Return(Exception):
    def __init__(self, value):
        self.value = value


@dataclass
class Frame:
    locals: dict
    module: ModuleEnv
    block: str | None  # None at network level


_ARITH = {"+": operator.add, "-": operator.sub, "*": operator.mul, "//": operator.floordiv,
          "%": operator.mod, "**": operator.pow, "/": operator.truediv}
_COMPARE = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
            ">": operator.gt, ">=": operator.ge}


class Elaborator:
    def __init__(self, module: ModuleEnv, net: ast.NetworkDef, diagnostics: list | None = None):
        self.module = module
        self.net = net
        self.g = Graph(net.name)
        self.diags: list[Diagnostic] = diagnostics if diagnostics is not None else []
        self._seen_diags: set = set()
        self.stack: list[CallSite] = []
        self.scope: list[str] = []
        self.counters: list[dict[str, int]] = [{}]
        self.anns: list[dict] = [{}]
        self.parallel: dict = {}
        self.builtins = _builtins(self)
        registry.load_all()

    # -- diagnostics ---------------------------------------------------------------------
    def error(self, message: str, loc: SourceLoc | None, notes=()) -> _Fail:
        key = (message, loc)
        if key not in self._seen_diags:  # a block called 790 times reports its error once
            self._seen_diags.add(key)
            self.diags.append(Diagnostic(message, loc, tuple(self.stack), list(notes)))
        return _Fail()

    # -- entry ---------------------------------------------------------------------------
    def run(self) -> Graph:
        frame = Frame({}, self.module, None)
        try:
            self.anns = [check_annotations(self.net.annotations, self, "network")]
        except _Fail:  # reported; go on without them (this used to escape as a crash)
            self.anns = [{}]
        outputs, losses = [], []
        parallel_seen = False
        for st in self.net.body:
            try:
                if isinstance(st, ast.InputDecl):
                    try:
                        self.input_decl(st, frame)
                    except _Fail:
                        # a bad declaration still declares the name: later uses of it
                        # should not each report "`x` is not defined"
                        frame.locals.setdefault(st.name, POISON)
                        raise
                elif isinstance(st, ast.OutputDecl):
                    for e in st.values:
                        outputs.append(self.tensor_value(e, frame, "output"))
                elif isinstance(st, ast.LossDecl):
                    if losses:
                        raise self.error("a network has one `loss`", st.loc)
                    t = self.tensor_value(st.value, frame, "loss")
                    if t is not POISON and t.type.shape != ():
                        raise self.error(f"the loss must be a scalar, but it is {t.type}",
                                         st.value.loc)
                    losses.append(t)
                elif isinstance(st, ast.ParallelDecl):
                    if parallel_seen:
                        raise self.error("a network has one `parallel` declaration", st.loc)
                    parallel_seen = True
                    self.parallel_decl(st, frame)
                else:
                    self.stmt(st, frame)
            except _Fail:
                pass
            except _Return:
                self.error("`return` is only allowed inside a block", st.loc)
            except RecursionError:
                # expressions nested hundreds deep; the finally clauses of call_block have
                # already unwound scope and stack
                self.error("this statement nests expressions or block calls too deeply to "
                           "compile", st.loc)
        if not outputs and not losses and not self.diags:
            self.error(f"network `{self.net.name}` declares no `output` and no `loss`",
                       self.net.loc)
        self.g.outputs["output"] = [t.node for t in outputs if t is not POISON]
        if losses and losses[0] is not POISON:
            self.g.outputs["loss"] = [losses[0].node]
        self.g.parallel = dict(self.parallel)
        self.g.meta["source"] = self.module.file
        if self.diags:
            raise NetdslError(diagnostics=self.diags)
        self._check_stages()
        if self.diags:
            raise NetdslError(diagnostics=self.diags)
        return self.g

    def _check_stages(self):
        stages = self.parallel.get("pipeline", 1)
        for n in self.g.nodes:
            k = n.annotations.get("stage")
            if k is not None and k >= stages:
                self.stack = list(n.stack)
                self.error(f"@stage({k}) needs a pipeline of at least {k + 1} stages, but "
                           f"`parallel` declares pipeline = {stages}", n.loc)
                return

    # -- declarations --------------------------------------------------------------------
    def input_decl(self, st: ast.InputDecl, frame: Frame):
        if st.dtype not in DTYPES:
            raise self.error(f"unknown element type `{st.dtype}`; use one of "
                             f"{', '.join(DTYPES)}", st.dtype_loc)
        dims = []
        for i, e in enumerate(st.dims):
            d = self.expr(e, frame)
            if d == BATCH:
                if i != 0:
                    raise self.error("the batch dimension N may only be the first dimension",
                                     e.loc)
            elif d is POISON:
                raise _Fail()
            elif not isinstance(d, int) or isinstance(d, bool) or d < 1:
                raise self.error(f"a dimension must be a positive integer or N, not "
                                 f"{_describe_value(d)}", e.loc)
            dims.append(d)
        if not dims or dims[0] != BATCH:
            raise self.error(f"input `{st.name}` must have the batch dimension N first, e.g. "
                             f"{st.dtype}[N, ...]", st.loc)
        if st.name in frame.locals or st.name in self.g:
            raise self.error(f"`{st.name}` is already defined", st.loc)
        t = TensorType(tuple(dims), st.dtype)
        self.g.add(Node(st.name, "input", (), t, {"shape": tuple(dims), "dtype": st.dtype},
                        loc=st.loc, annotations=dict(self.anns[-1])))
        frame.locals[st.name] = Tensor(st.name, t, f"input at {where(st.loc)}", st.name)

    def parallel_decl(self, st: ast.ParallelDecl, frame: Frame):
        from pydantic import ValidationError

        from netdsl.config import ParallelConfig
        vals = {}
        for s in st.settings:
            vals[s.name] = self.expr(s.value, frame)
        try:
            # strict: `data = true` or `data = "2"` are mistakes, not 1 and 2
            cfg = ParallelConfig.model_validate(vals, strict=True)
        except ValidationError as e:
            err = e.errors()[0]
            field = err["loc"][0] if err["loc"] else None
            if field is None and "microbatches" in vals:  # the model-level check
                field = "microbatches"
            loc = next((s.loc for s in st.settings if s.name == field), st.loc)
            if err["type"] == "extra_forbidden":
                msg = (f"`parallel` has no setting `{field}`; it has "
                       f"{', '.join(ParallelConfig.model_fields)}")
            else:
                msg = pydantic_message(err, str(field) if field else "", lambda v: (
                    _describe_value(v) if isinstance(v, Tensor) else _show(v) or kind_of(v)))
            raise self.error(f"invalid parallel declaration: {msg}", loc) from None
        self.parallel = cfg.model_dump()

    # -- statements ----------------------------------------------------------------------
    def stmt(self, st: ast.Stmt, frame: Frame):
        pushed = False
        if st.annotations:
            try:
                anns = check_annotations(st.annotations, self, "statement", frame)
            except _Fail:
                # the bad annotation is reported; still run the statement (without its
                # annotations) so the names it binds exist and its own errors show
                anns = {}
            self.anns.append(merge_annotations(self.anns[-1], anns))
            pushed = True
        try:
            self._stmt(st, frame)
        finally:
            if pushed:
                self.anns.pop()

    def _stmt(self, st: ast.Stmt, frame: Frame):
        if isinstance(st, ast.Assign):
            try:
                v = self.expr(st.value, frame)
            except _Fail:
                for t in st.targets:
                    frame.locals[t] = POISON
                raise
            self.bind(st, v, frame)
        elif isinstance(st, ast.Repeat):
            try:
                n = self.expr(st.count, frame)
                if n is POISON:
                    raise _Fail()
                if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                    raise self.error(f"repeat needs a non-negative integer count, not "
                                     f"{kind_of(n)} {_show(n)}".rstrip(), st.count.loc)
                if n > MAX_REPEAT:
                    raise self.error(f"repeat count {n} is larger than {MAX_REPEAT}",
                                     st.count.loc)
            except _Fail:
                _poison_assigned(st.body, frame)  # no cascade of "`h` is not defined"
                raise
            before = len(self.diags)
            for i in range(n):
                if st.var:
                    frame.locals[st.var] = i
                self.body(st.body, frame)
                if len(self.diags) > before:  # the body failed: one report is enough
                    break
        elif isinstance(st, ast.If):
            try:
                c = self.expr(st.test, frame)
                if c is POISON:
                    raise _Fail()
                if not isinstance(c, bool):
                    raise self.error(f"an `if` condition must be true or false, not "
                                     f"{kind_of(c)}", st.test.loc)
            except _Fail:
                _poison_assigned(st.body + st.orelse, frame)
                raise
            self.body(st.body if c else st.orelse, frame)
        elif isinstance(st, ast.Return):
            if frame.block is None:
                raise self.error("`return` is only allowed inside a block", st.loc)
            vals = tuple(self.expr(e, frame) for e in st.values)
            raise _Return(vals[0] if len(vals) == 1 else vals)
        elif isinstance(st, (ast.InputDecl, ast.OutputDecl, ast.LossDecl, ast.ParallelDecl)):
            kw = type(st).__name__.replace("Decl", "").lower()
            raise self.error(f"`{kw}` may only appear at the top level of a network", st.loc)
        else:  # pragma: no cover
            raise self.error(f"unsupported statement {type(st).__name__}", st.loc)

    def body(self, stmts, frame: Frame):
        for s in stmts:
            try:
                self.stmt(s, frame)
            except _Fail:
                pass

    def bind(self, st: ast.Assign, v, frame: Frame):
        if len(st.targets) == 1:
            name = st.targets[0]
            frame.locals[name] = _named(v, name)
            return
        if v is POISON:
            for t in st.targets:
                frame.locals[t] = POISON
            return
        if not isinstance(v, tuple) or len(v) != len(st.targets):
            got = f"{len(v)} values" if isinstance(v, tuple) else kind_of(v)
            for t in st.targets:
                frame.locals[t] = POISON
            raise self.error(f"cannot unpack {got} into {len(st.targets)} names", st.loc)
        for t, x in zip(st.targets, v):
            frame.locals[t] = _named(x, t)

    # -- expressions ---------------------------------------------------------------------
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
        hint = difflib.get_close_matches(name, known, n=1)
        msg = f"`{name}` is not defined"
        if hint:
            msg += f"; did you mean `{hint[0]}`?"
        raise self.error(msg, loc)

    def expr(self, e: ast.Expr, frame: Frame):
        m = getattr(self, "e_" + type(e).__name__)
        return m(e, frame)

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
        if not _is_num(v):
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
            if not (_is_num(a) and _is_num(b)):
                raise self.error(f"cannot compare {kind_of(a)} with {kind_of(b)}", e.loc)
            return _COMPARE[e.op](a, b)
        if BATCH in (a, b):
            raise self.error("the batch dimension N cannot take part in arithmetic; "
                             "use it whole, e.g. reshape(x, (N, -1))", e.loc)
        if e.op == "+" and isinstance(a, tuple) and isinstance(b, tuple):
            return a + b
        if not (_is_num(a) and _is_num(b)):
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
            raise self.error(f"arithmetic error: {ex}", e.loc) from None
        if isinstance(r, complex):  # (-8) ** 0.5
            raise self.error(f"{a} ** {b} has no real value", e.loc)
        if isinstance(r, int) and r.bit_length() > MAX_INT_BITS:
            raise self.error(f"the result of `{e.op}` is too large (static integers have at "
                             f"most {MAX_INT_BITS} bits)", e.loc)
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

    def _bind_args(self, what: str, names: list[str], args, kwargs, e: ast.Call,
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
        names = [a.name for a in op.signature]
        variadic = next((a.name for a in op.signature if a.kind == "tensors"), None)
        locs: dict = {}
        bound = self._bind_args(f"{name}()", names, args, kwargs, e, variadic, locs)
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
                                     f"{_describe_value(v)}", aloc)
                tensors.append(v)
            elif a.kind == "tensors":
                if not v or not all(isinstance(t, Tensor) for t in v):
                    raise self.error(f"{name}() expects one or more tensors", aloc)
                tensors.extend(v)
            else:
                attrs[a.name] = self._check_attr(name, a, v, aloc)
        return self.emit(name, tensors, attrs, e.loc)

    def _check_attr(self, op: str, a: registry.Arg, v, loc: SourceLoc):
        def bad(expect):
            # a tensor used to print as "but got a tensor f32[N, 4] " with no name
            return self.error(f"{op}() expects {expect} for `{a.name}`, but got "
                              f"{_describe_value(v)}", loc)
        is_int = isinstance(v, int) and not isinstance(v, bool)
        if a.kind in ("int", "axis"):
            if not is_int:
                raise bad("an integer")
        elif a.kind == "float":
            if not _is_num(v):
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
            raise self.error(f"{op}() `{a.name}` must be one of "
                             f"{', '.join(map(str, a.choices))}, not {_show(v)}", loc)
        return v

    def node_name(self, base: str) -> str:
        counts = self.counters[-1]
        k = counts.get(base, 0)
        counts[base] = k + 1
        local = base if k == 0 else f"{base}_{k}"
        return ".".join(self.scope + [local])

    def emit(self, op: str, tensors: list[Tensor], attrs: dict, loc: SourceLoc) -> Tensor:
        name = self.node_name(op)
        try:
            node = add_op(self.g, name, op, [t.node for t in tensors], attrs, loc=loc,
                          stack=tuple(self.stack), scope=tuple(self.scope),
                          annotations=dict(self.anns[-1]))
        except ShapeError as ex:
            names = [a.name for a in registry.get(op).tensor_args]
            desc = {n: t.describe() for n, t in zip(names, tensors)}
            if names and registry.get(op).signature[0].kind == "tensors":
                desc = {names[0]: "the inputs"}
            try:
                msg = str(ex).format(**desc)
            except (KeyError, IndexError):
                msg = str(ex)
            raise self.error(msg, loc) from None
        return Tensor(node.name, node.type, f"from {op} at {where(loc)}")

    def call_block(self, ref: BlockRef, args, kwargs, e: ast.Call):
        b: ast.BlockDef = ref.block
        if len(self.stack) >= MAX_BLOCK_DEPTH:
            # was 200, which overflowed Python's stack (RecursionError) before firing
            raise self.error(f"block calls are nested more than {MAX_BLOCK_DEPTH} deep; "
                             f"does block `{b.name}` call itself?", e.loc)
        names = [p.name for p in b.params]
        bound = self._bind_args(f"block `{b.name}`", names, args, kwargs, e)
        frame = Frame({}, ref.module, b.name)
        for p in b.params:
            if p.name in bound:
                frame.locals[p.name] = _named(bound[p.name], p.name)
            elif p.default is not None:
                frame.locals[p.name] = self.expr(p.default, Frame({}, ref.module, b.name))
            else:
                raise self.error(f"block `{b.name}` is missing its argument `{p.name}`",
                                 e.loc)
        # scope entry: `name` for the first call in this scope, then `name[1]`, `name[2]`..
        counts = self.counters[-1]
        k = counts.get("block:" + b.name, 0)
        counts["block:" + b.name] = k + 1
        self.scope.append(b.name if k == 0 else f"{b.name}[{k}]")
        self.counters.append({})
        self.stack.append(CallSite(b.name, e.loc))
        before = len(self.diags)
        pushed = False
        if b.annotations:
            anns = check_annotations(b.annotations, self, "block", frame)
            self.anns.append(merge_annotations(self.anns[-1], anns))
            pushed = True
        try:
            for st in b.body:
                try:
                    self.stmt(st, frame)
                except _Fail:
                    pass
            result = None
        except _Return as r:
            result = r.value
        finally:
            self.scope.pop()
            self.counters.pop()
            self.stack.pop()
            if pushed:
                self.anns.pop()
        if len(self.diags) > before:
            raise _Fail()
        return result


def _poison_assigned(stmts, frame: Frame) -> None:
    """Bind every name a skipped body would have assigned to POISON."""
    for st in stmts:
        if isinstance(st, ast.Assign):
            for t in st.targets:
                frame.locals[t] = POISON
        elif isinstance(st, ast.Repeat):
            _poison_assigned(st.body, frame)
        elif isinstance(st, ast.If):
            _poison_assigned(st.body + st.orelse, frame)


def _describe_value(v) -> str:
    if isinstance(v, Tensor):
        return f"{v.describe()}, a tensor {v.type}"
    shown = _show(v)
    return f"{kind_of(v)} {shown}" if shown else kind_of(v)


def _named(v, name):
    if isinstance(v, Tensor):
        return Tensor(v.node, v.type, v.origin, name)
    return v


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _show(v) -> str:
    if isinstance(v, Tensor):
        return ""
    if isinstance(v, str):
        return f'"{v}"' if v != BATCH else ""
    return repr(v) if not isinstance(v, bool) else str(v).lower()


# -- builtin functions -------------------------------------------------------------------
def _builtins(el: Elaborator) -> dict:
    def need_tensor(fname, args, e, n=1):
        if len(args) != n or not all(isinstance(a, Tensor) for a in args[:n]):
            raise el.error(f"{fname}() takes {n} tensor argument{'s' * (n > 1)}", e.loc)
        return args

    def channels(args, kw, e):
        (t,) = need_tensor("channels", args, e)
        if t.type.rank < 2:
            raise el.error(f"channels() needs a tensor of rank 2 or more, but "
                           f"{t.describe()} is {t.type}", e.loc)
        return t.type.shape[1]

    def shape(args, kw, e):
        return need_tensor("shape", args, e)[0].type.shape

    def rank(args, kw, e):
        return need_tensor("rank", args, e)[0].type.rank

    def length(args, kw, e):
        if len(args) != 1 or not isinstance(args[0], tuple):
            raise el.error("len() takes one tuple", e.loc)
        return len(args[0])

    def minmax(fn):
        def f(args, kw, e):
            vals = args[0] if len(args) == 1 and isinstance(args[0], tuple) else args
            if any(isinstance(v, Tensor) for v in vals):  # element-wise on tensors
                return tensor_arith.minmax(el, fn.__name__, vals, e)
            if not vals or not all(_is_num(v) for v in vals):
                raise el.error(f"{fn.__name__}() takes numbers", e.loc)
            return fn(vals)
        return f

    def to_int(args, kw, e):
        if len(args) != 1 or not _is_num(args[0]):
            raise el.error("int() takes one number", e.loc)
        try:
            return int(args[0])
        except (OverflowError, ValueError):  # int(1e400), int(nan)
            raise el.error(f"int(): {args[0]} has no integer value", e.loc) from None

    def split(args, kw, e):
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
        size = t.type.shape[axis]
        if not isinstance(size, int):
            raise el.error("split(): cannot split the batch dimension", e.loc)
        if isinstance(sections, int) and not isinstance(sections, bool):
            if sections < 1 or size % sections:
                raise el.error(f"split(): {size} does not divide into {sections} equal parts",
                               e.loc)
            sizes = [size // sections] * sections
        elif isinstance(sections, tuple) and all(isinstance(s, int) and s > 0 for s in sections):
            sizes = list(sections)
            if sum(sizes) != size:
                raise el.error(f"split(): sizes {sections} add up to {sum(sizes)}, but the "
                               f"axis has {size}", e.loc)
        else:
            raise el.error("split() needs the number of parts or a tuple of sizes", e.loc)
        out, start = [], 0
        for s in sizes:
            out.append(el.emit("slice", [t], {"axis": axis, "start": start,
                                              "stop": start + s}, e.loc))
            start += s
        return tuple(out)

    def parameter(args, kw, e):
        shp = args[0] if args else kw.get("shape")
        init = kw.get("init", args[1] if len(args) > 1 else "normal")
        if not isinstance(shp, tuple) or not shp or not all(
                isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shp):
            raise el.error("parameter() needs a shape: a tuple of positive integers", e.loc)
        if init not in ("normal", "zeros", "ones", "uniform_fan_in"):
            raise el.error(f"parameter(): unknown init \"{init}\" (normal, zeros, ones)", e.loc)
        name = el.node_name("parameter")
        t = TensorType(tuple(shp))
        el.g.add(Node(name, "param", (), t, {"shape": tuple(shp), "init": init,
                                              "fan_in": shp[-1], "std": 0.02},
                      loc=e.loc, stack=tuple(el.stack), scope=tuple(el.scope),
                      annotations=dict(el.anns[-1])))
        return Tensor(name, t, f"parameter at {where(e.loc)}")

    table = {"channels": channels, "shape": shape, "rank": rank, "len": length,
             "min": minmax(min), "max": minmax(max), "int": to_int, "split": split,
             "parameter": parameter}
    return {k: Builtin(k, f) for k, f in table.items()}
