"""Operator definitions; importing this package registers them all."""
from netdsl.ir.ops import (  # noqa: F401
    activation, conv, dense, elementwise, loss, norm, pool, shape_ops, sources)
