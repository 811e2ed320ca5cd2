"""AST -> graph IR: evaluate a network, expanding blocks, conditionals and repeats.

Static values (ints, tuples, shapes) are computed here; every operator call becomes a node
via `ir.build.add_op`, so shapes are inferred as the program runs. Errors are collected,
not raised at once: a failing statement binds its names to POISON, and uses of POISON
report nothing further, so one run lists every independent mistake.

The evaluator is split by job: statements, declarations and blocks here; expressions in
`expressions.py`; argument binding and operator calls in `arguments.py`; attribute checks
in `checks.py`; builtin functions in `builtins.py`.
"""
from __future__ import annotations

from netdsl.errors import CallSite, Diagnostic, NetdslError, ShapeError, SourceLoc
from netdsl.frontend import ast
from netdsl.frontend.annotations import check_annotations, merge_annotations
from netdsl.frontend.arguments import ArgumentBinding
from netdsl.frontend.builtins import builtins
from netdsl.frontend.expressions import Expressions
from netdsl.frontend.frames import Fail, Frame, Return, poison_assigned
from netdsl.frontend.modules import ModuleEnv
from netdsl.frontend.repeats import same_copies, worth_cutting
from netdsl.frontend.train import pydantic_message
from netdsl.frontend.values import (
    POISON,
    BlockRef,
    Tensor,
    describe_value,
    kind_of,
    named,
    show,
    where,
)
from netdsl.ir import registry
from netdsl.ir.build import add_op
from netdsl.ir.graph import Graph
from netdsl.ir.rewrite import make_source
from netdsl.ir.types import BATCH, DTYPES, INT_MAX, TensorType

MAX_REPEAT = 1_000_000
# Block calls nested deeper than this are reported as runaway recursion. It is well below
# what Python's own stack allows (each level costs several interpreter frames), so the
# check fires first; deeper expression nesting is caught as RecursionError per statement.
MAX_BLOCK_DEPTH = 64


class Elaborator(Expressions, ArgumentBinding):
    # cut long repeats whose copies are all alike (netdsl.frontend.repeats), and build the
    # graph again in full only where the check finds no error
    errors_first = True

    def __init__(self, module: ModuleEnv, net: ast.NetworkDef, diagnostics: list | None = None):
        self.module = module
        self.net = net
        self.cut_repeats = 0
        self.g = Graph(net.name)
        self.diags: list[Diagnostic] = diagnostics if diagnostics is not None else []
        self._seen_diags: set = set()
        self.stack: list[CallSite] = []
        self.scope: list[str] = []
        self.counters: list[dict[str, int]] = [{}]
        self.anns: list[dict] = [{}]
        self.parallel: dict = {}
        self.shard_units = 0
        self.builtins = builtins(self)
        registry.load_all()

    # -- diagnostics ---------------------------------------------------------------------
    def error(self, message: str, loc: SourceLoc | None, notes=()) -> Fail:
        key = (message, loc)
        if key not in self._seen_diags:  # a block called 790 times reports its error once
            self._seen_diags.add(key)
            self.diags.append(Diagnostic(message, loc, tuple(self.stack), list(notes)))
        return Fail()

    def new_shard_unit(self) -> int:
        """The number of one evaluation of a `@shard_unit` (frontend/annotations.py)."""
        self.shard_units += 1
        return self.shard_units

    # -- entry ---------------------------------------------------------------------------
    def run(self) -> Graph:
        g = self._run()  # (raises the diagnostics it found)
        if self.cut_repeats:  # no error: the graph is every copy of every repeat
            again = type(self)(self.module, self.net)
            again.errors_first = False
            return again.run()
        return g

    def _run(self) -> Graph:
        frame = Frame({}, self.module, None)
        try:
            self.anns = [check_annotations(self.net.annotations, self, "network")]
        except Fail:  # reported; go on without them (the diagnostics are raised below)
            self.anns = [{}]
        outputs, losses = [], []
        parallel_seen = False
        for st in self.net.body:
            try:
                if isinstance(st, ast.InputDecl):
                    try:
                        self.input_decl(st, frame)
                    except Fail:
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
            except Fail:
                pass
            except Return:
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
        self._check_param_count()
        self.g.parallel = dict(self.parallel)
        self.g.meta["source"] = self.module.file
        if self.diags:
            raise NetdslError(diagnostics=self.diags)
        self._check_stages()
        if self.diags:
            raise NetdslError(diagnostics=self.diags)
        return self.g

    def _check_param_count(self):
        """Each tensor fits in 64 bits (checked as it is made); so must their total."""
        total = 0
        for n in self.g.nodes:
            if n.op in ("param", "buffer"):
                total += n.type.numel()
                if total > INT_MAX:
                    self.stack = list(n.stack)
                    self.error(f"the network has more than {INT_MAX:.3g} parameters (at "
                               f"`{n.name}`); no memory can hold them", n.loc)
                    return

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
                raise Fail()
            elif not isinstance(d, int) or isinstance(d, bool) or d < 1:
                raise self.error(f"a dimension must be a positive integer or N, not "
                                 f"{describe_value(d)}", e.loc)
            dims.append(d)
        if not dims or dims[0] != BATCH:
            raise self.error(f"input `{st.name}` must have the batch dimension N first, e.g. "
                             f"{st.dtype}[N, ...]", st.loc)
        if st.name in frame.locals or st.name in self.g:
            raise self.error(f"`{st.name}` is already defined", st.loc)
        t = TensorType(tuple(dims), st.dtype)
        if (why := t.size_error()) is not None:
            raise self.error(f"input `{st.name}`: {why}", st.loc)
        self.g.add(make_source(st.name, "input", t, {"shape": tuple(dims), "dtype": st.dtype},
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
            if field is None:  # the model-level checks, each named by its setting
                field = next((f for f in ("virtual_stages", "shard", "microbatches", "spatial")
                              if f in vals and f in str(err["msg"])), None)
            loc = next((s.loc for s in st.settings if s.name == field), st.loc)
            if err["type"] == "extra_forbidden":
                msg = (f"`parallel` has no setting `{field}`; it has "
                       f"{', '.join(ParallelConfig.model_fields)}")
            else:
                msg = pydantic_message(err, str(field) if field else "", lambda v: (
                    describe_value(v) if isinstance(v, Tensor) else show(v) or kind_of(v)))
            raise self.error(f"invalid parallel declaration: {msg}", loc) from None
        self.parallel = cfg.model_dump()

    # -- statements ----------------------------------------------------------------------
    def stmt(self, st: ast.Stmt, frame: Frame):
        pushed = False
        if st.annotations:
            try:
                anns = check_annotations(st.annotations, self, "statement", frame)
            except Fail:
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
            except Fail:
                for t in st.targets:
                    frame.locals[t] = POISON
                raise
            self.bind(st, v, frame)
        elif isinstance(st, ast.Repeat):
            try:
                n = self.expr(st.count, frame)
                if n is POISON:
                    raise Fail()
                if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                    raise self.error(f"repeat needs a non-negative integer count, not "
                                     f"{kind_of(n)} {show(n)}".rstrip(), st.count.loc)
                if n > MAX_REPEAT:
                    raise self.error(f"repeat count {n} is larger than {MAX_REPEAT}",
                                     st.count.loc)
            except Fail:
                poison_assigned(st.body, frame)  # no cascade of "`h` is not defined"
                raise
            self._repeat(st, n, frame)
        elif isinstance(st, ast.If):
            try:
                c = self.expr(st.test, frame)
                if c is POISON:
                    raise Fail()
                if not isinstance(c, bool):
                    raise self.error(f"an `if` condition must be true or false, not "
                                     f"{kind_of(c)}", st.test.loc)
            except Fail:
                poison_assigned(st.body + st.orelse, frame)
                raise
            self.body(st.body if c else st.orelse, frame)
        elif isinstance(st, ast.Return):
            if frame.block is None:
                raise self.error("`return` is only allowed inside a block", st.loc)
            vals = tuple(self.expr(e, frame) for e in st.values)
            raise Return(vals[0] if len(vals) == 1 else vals)
        elif isinstance(st, (ast.InputDecl, ast.OutputDecl, ast.LossDecl, ast.ParallelDecl)):
            kw = type(st).__name__.replace("Decl", "").lower()
            raise self.error(f"`{kw}` may only appear at the top level of a network", st.loc)
        else:  # pragma: no cover
            raise self.error(f"unsupported statement {type(st).__name__}", st.loc)

    def _repeat(self, st: ast.Repeat, n: int, frame: Frame):
        """`n` copies of the body; with `errors_first`, a long repeat without an index is
        cut after two copies where the rest would repeat them (`repeats.same_copies`)."""
        before = len(self.diags)
        cut = self.errors_first and st.var is None and n > 2
        names, starts = [dict(frame.locals)], [len(self.g.nodes)]
        for i in range(n):
            if st.var:
                frame.locals[st.var] = i
            self.body(st.body, frame)
            if len(self.diags) > before:  # the body failed: one report is enough
                break
            if cut and i < 2:
                names.append(dict(frame.locals))
                starts.append(len(self.g.nodes))
                if i == 1 and worth_cutting(starts[1] - starts[0], n) and same_copies(
                        self.g, tuple(names), tuple(starts)):
                    self.cut_repeats += 1
                    break

    def body(self, stmts, frame: Frame):
        for s in stmts:
            try:
                self.stmt(s, frame)
            except Fail:
                pass

    def bind(self, st: ast.Assign, v, frame: Frame):
        if len(st.targets) == 1:
            name = st.targets[0]
            frame.locals[name] = named(v, name)
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
            frame.locals[t] = named(x, t)


    def node_name(self, base: str) -> str:
        counts = self.counters[-1]
        k = counts.get(base, 0)
        counts[base] = k + 1
        local = base if k == 0 else f"{base}_{k}"
        return ".".join(self.scope + [local])

    def emit(self, op: str, tensors: list[Tensor], attrs: dict, loc: SourceLoc,
             shared: dict | None = None) -> Tensor:
        name = self.node_name(op)
        shared = shared or {}
        try:
            node = add_op(self.g, name, op, [t.node for t in tensors], attrs,
                          shared={k: n for k, (n, _) in shared.items()} if shared else None,
                          loc=loc,
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
            # an error about a shared parameter points at the `weight=` that shares it
            at = next((kloc for k, (_, kloc) in shared.items() if f"`{k}`" in msg), loc)
            raise self.error(msg, at) from None
        return Tensor(node.name, node.type, f"from {op} at {where(loc)}")

    def call_block(self, ref: BlockRef, args, kwargs, e: ast.Call):
        b: ast.BlockDef = ref.block
        if len(self.stack) >= MAX_BLOCK_DEPTH:
            raise self.error(f"block calls are nested more than {MAX_BLOCK_DEPTH} deep; "
                             f"does block `{b.name}` call itself?", e.loc)
        names = [p.name for p in b.params]
        bound = self.bind_args(f"block `{b.name}`", names, args, kwargs, e)
        frame = Frame({}, ref.module, b.name)
        for p in b.params:
            if p.name in bound:
                frame.locals[p.name] = named(bound[p.name], p.name)
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
                except Fail:
                    pass
            result = None
        except Return as r:
            result = r.value
        finally:
            self.scope.pop()
            self.counters.pop()
            self.stack.pop()
            if pushed:
                self.anns.pop()
        if len(self.diags) > before:
            raise Fail()
        return result


