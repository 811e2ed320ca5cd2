"""The names a `.net` file can use without defining them: operators (from the registry),
the builtin functions of the front end, dtypes and keywords. For highlighting and
completion."""
from __future__ import annotations

from netdsl.frontend.parser import KEYWORDS
from netdsl.ir import registry
from netdsl.ir.types import DTYPES

# the front end's builtin functions (netdsl/frontend/elaborate.py `_builtins`; a test
# keeps the two the same)
BUILTINS = ("channels", "shape", "rank", "len", "min", "max", "int", "split", "parameter")
CONSTANTS = ("true", "false", "none")


def operators() -> dict[str, registry.OpDef]:
    """The operators a program may call, by name."""
    return {n: op for n, op in sorted(registry.load_all().items())
            if op.callable_from_language}


def keywords() -> tuple[str, ...]:
    return tuple(k for k in KEYWORDS if k not in CONSTANTS)


def dtypes() -> tuple[str, ...]:
    return tuple(DTYPES)
