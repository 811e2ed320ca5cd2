"""Operator definitions; importing this package registers them all (with their kernels,
gradient rules and backward operators)."""
from netdsl.ir.ops import (  # noqa: F401
    activation,
    activation_fns,
    arith,
    conv,
    dense,
    elementwise,
    loss,
    norm,
    norm_group,
    optim,
    pool,
    reduce,
    resize,
    shape_ops,
    sources,
)
