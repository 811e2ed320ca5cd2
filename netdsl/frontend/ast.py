"""The syntax tree of a `.net` file: small frozen dataclasses, each with its location."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from netdsl.errors import SourceLoc


@dataclass(frozen=True)
class Expr:
    loc: SourceLoc


@dataclass(frozen=True)
class Name(Expr):
    id: str


@dataclass(frozen=True)
class Const(Expr):
    value: Any


@dataclass(frozen=True)
class TupleExpr(Expr):
    items: tuple[Expr, ...]


@dataclass(frozen=True)
class Call(Expr):
    func: Expr
    args: tuple[Expr, ...]
    kwargs: tuple[tuple[str, Expr, SourceLoc], ...]


@dataclass(frozen=True)
class Index(Expr):
    obj: Expr
    index: Expr


@dataclass(frozen=True)
class Attr(Expr):
    obj: Expr
    name: str


@dataclass(frozen=True)
class BinOp(Expr):
    op: str  # + - * / // % ** == != < <= > >= and or
    left: Expr
    right: Expr


@dataclass(frozen=True)
class Unary(Expr):
    op: str  # - not
    operand: Expr


@dataclass(frozen=True)
class Cond(Expr):
    test: Expr
    then: Expr
    orelse: Expr


@dataclass(frozen=True)
class Annotation:
    name: str
    args: tuple[Expr, ...]
    kwargs: tuple[tuple[str, Expr, SourceLoc], ...]
    loc: SourceLoc


@dataclass(frozen=True)
class Stmt:
    loc: SourceLoc
    annotations: tuple[Annotation, ...] = field(default=(), kw_only=True)


@dataclass(frozen=True)
class Assign(Stmt):
    targets: tuple[str, ...]
    value: Expr


@dataclass(frozen=True)
class Repeat(Stmt):
    count: Expr
    var: str | None
    body: tuple[Stmt, ...]


@dataclass(frozen=True)
class If(Stmt):
    test: Expr
    body: tuple[Stmt, ...]
    orelse: tuple[Stmt, ...]


@dataclass(frozen=True)
class Return(Stmt):
    values: tuple[Expr, ...]


@dataclass(frozen=True)
class InputDecl(Stmt):
    name: str
    dtype: str
    dims: tuple[Expr, ...]
    dtype_loc: SourceLoc


@dataclass(frozen=True)
class OutputDecl(Stmt):
    values: tuple[Expr, ...]


@dataclass(frozen=True)
class LossDecl(Stmt):
    value: Expr


@dataclass(frozen=True)
class Setting:
    name: str
    value: Expr
    loc: SourceLoc


@dataclass(frozen=True)
class ParallelDecl(Stmt):
    settings: tuple[Setting, ...]


@dataclass(frozen=True)
class Param:
    name: str
    default: Expr | None
    loc: SourceLoc


@dataclass(frozen=True)
class BlockDef:
    name: str
    params: tuple[Param, ...]
    body: tuple[Stmt, ...]
    annotations: tuple[Annotation, ...]
    loc: SourceLoc
    file: str


@dataclass(frozen=True)
class NetworkDef:
    name: str
    body: tuple[Stmt, ...]
    annotations: tuple[Annotation, ...]
    loc: SourceLoc


@dataclass(frozen=True)
class TrainDef:
    settings: tuple[Setting, ...]
    loc: SourceLoc


@dataclass(frozen=True)
class Import:
    module: str | None  # `import resnet`
    path: str | None  # `import "blocks.net" as b`
    alias: str
    loc: SourceLoc


@dataclass(frozen=True)
class Module:
    file: str
    imports: tuple[Import, ...]
    blocks: tuple[BlockDef, ...]
    networks: tuple[NetworkDef, ...]
    train: TrainDef | None
