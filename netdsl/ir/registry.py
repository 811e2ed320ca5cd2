"""The operator registry: every operator's `OpDef` (netdsl.ir.opdef), complete on import.

Importing this module imports every operator module (netdsl.ir.ops), each of which
registers its operators, kernels and gradient rules into `OPS`; so any layer that reads the
table through here sees all of it. The operator modules themselves import netdsl.ir.opdef,
below this module, and never this one.
"""
from __future__ import annotations

from netdsl.ir import ops as _ops  # noqa: F401  (registers every operator)
from netdsl.ir.opdef import (
    GT0,
    LAYER_TYPES,
    NON_NEGATIVE,
    OPS,
    POSITIVE,
    PROBABILITY,
    REQUIRED,
    Arg,
    OpDef,
    ParamSpec,
    Range,
    grad_rule,
    kernel,
    register,
)
from netdsl.ir.types import INT_MAX, INT_MIN  # the front end checks static ints with them

__all__ = ["GT0", "INT_MAX", "INT_MIN", "LAYER_TYPES", "NON_NEGATIVE", "OPS", "POSITIVE",
           "PROBABILITY", "REQUIRED", "Arg", "OpDef", "ParamSpec", "Range", "get",
           "grad_rule", "kernel", "load_all", "register"]


def get(name: str) -> OpDef:
    return OPS[name]


def load_all() -> dict[str, OpDef]:
    """The complete operator table (every operator module is loaded with this module)."""
    return OPS
