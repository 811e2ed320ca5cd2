"""Operator definitions; importing this package registers them all (with their kernels,
gradient rules and backward operators)."""
from netdsl.ir.ops import (  # noqa: F401
    activation,
    conv,
    dense,
    elementwise,
    loss,
    norm,
    optim,
    pool,
    shape_ops,
    sources,
    transfer,
)
