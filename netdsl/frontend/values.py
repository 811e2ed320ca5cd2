"""Values the elaborator computes with: static numbers, tuples and strings, and tensors."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from netdsl.errors import SourceLoc
from netdsl.ir.types import BATCH, TensorType


@dataclass(frozen=True)
class Tensor:
    """A tensor value: the graph node that produces it, its type, where it came from."""

    node: str
    type: TensorType
    origin: str  # "conv2d at line 12, column 9" - for error messages
    var: str | None = None  # the source variable it was last bound to

    def describe(self) -> str:
        if self.var:
            return f"`{self.var}` ({self.origin})" if self.origin else f"`{self.var}`"
        return f"the value {self.origin}" if self.origin else "the argument"


@dataclass(frozen=True)
class BlockRef:
    block: Any  # ast.BlockDef
    module: Any  # ModuleEnv


@dataclass(frozen=True)
class OpRef:
    name: str


@dataclass(frozen=True)
class Builtin:
    name: str
    fn: Any


@dataclass(frozen=True)
class ModuleRef:
    module: Any  # ModuleEnv


class Poison:
    """Stands for a value whose computation already failed: using it reports nothing more."""

    _inst = None

    def __new__(cls):
        if cls._inst is None:
            cls._inst = super().__new__(cls)
        return cls._inst

    def __repr__(self):
        return "<poison>"


POISON = Poison()


def kind_of(v) -> str:
    if isinstance(v, Tensor):
        return f"a tensor {v.type}"
    if isinstance(v, bool):
        return "a bool"
    if isinstance(v, int):
        return "an int"
    if isinstance(v, float):
        return "a float"
    if isinstance(v, str):
        return "the batch dimension N" if v == "N" else "a string"
    if isinstance(v, tuple):
        return "a tuple"
    if v is None:
        return "none"
    if isinstance(v, BlockRef):
        return f"the block `{v.block.name}`"
    if isinstance(v, OpRef):
        return f"the operator `{v.name}`"
    if isinstance(v, Builtin):
        return f"the function `{v.name}`"
    if isinstance(v, ModuleRef):
        return f"the module `{v.module.name}`"
    return type(v).__name__


def where(loc: SourceLoc | None) -> str:
    return f"line {loc.line}, column {loc.column}" if loc else ""


def describe_value(v) -> str:
    if isinstance(v, Tensor):
        return f"{v.describe()}, a tensor {v.type}"
    shown = show(v)
    return f"{kind_of(v)} {shown}" if shown else kind_of(v)


def named(v, name):
    if isinstance(v, Tensor):
        return Tensor(v.node, v.type, v.origin, name)
    return v


def is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def show(v) -> str:
    if isinstance(v, Tensor):
        return ""
    if isinstance(v, str):
        return f'"{v}"' if v != BATCH else ""
    return repr(v) if not isinstance(v, bool) else str(v).lower()


