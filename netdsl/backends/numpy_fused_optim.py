"""Optimizer updates for the NumPy backend's fused kernels (Numba, the `fast` extra)."""
from __future__ import annotations

import math

import numba

# One pass over the parameter, its gradient and its momentum buffer (NumPy takes five, two
# of them allocating). No fastmath: the same float operations in the same order as the
# NumPy reference kernel (netdsl.ir.ops.optim), so the result is bit for bit the same.
_EXACT = {"cache": True, "nogil": True, "error_model": "numpy"}


@numba.njit(**_EXACT)
def sgd_update(p, g, buf, lr, momentum, weight_decay, nesterov):
    """In place on 1-d p (and buf with momentum): torch.optim.SGD's step. The scalars are
    in p's dtype."""
    for i in range(p.size):
        gi = g[i]
        if weight_decay != 0:
            gi = gi + weight_decay * p[i]
        if momentum != 0:
            b = buf[i] * momentum + gi
            buf[i] = b
            gi = gi + momentum * b if nesterov else b
        p[i] = p[i] - lr * gi


@numba.njit(**_EXACT)
def adam_update(p, g, m, v, decay, wd, b1, c1, b2, c2, step_size, bc2_sqrt, eps):
    """In place on 1-d p, m and v: the Adam / AdamW step of the NumPy kernel, element by
    element in the same order (decay is 1 - lr * wd for AdamW, else 1 and wd the L2
    weight decay). The scalars are in p's dtype."""
    for i in range(p.size):
        pi = p[i] * decay
        gi = g[i]
        if wd != 0:
            gi = gi + wd * pi
        mi = m[i] * b1 + c1 * gi
        vi = v[i] * b2 + c2 * (gi * gi)
        m[i] = mi
        v[i] = vi
        p[i] = pi - step_size * (mi / (math.sqrt(vi) / bc2_sqrt + eps))


# A group of parameters (an `*_update_group` node): each in turn, by the loops above. Not
# one compiled call over all of them: Numba takes a group's arrays as a tuple, compiled
# anew for every length (over a minute for a deep network's group), or as a reflected
# list, whose every array is unboxed again at every call.
def sgd_update_many(ps, gs, bufs, lr, momentum, weight_decay, nesterov):
    for p, g, buf in zip(ps, gs, bufs, strict=True):
        sgd_update(p, g, buf, lr, momentum, weight_decay, nesterov)


def adam_update_many(ps, gs, ms, vs, *scalars):
    for p, g, m, v in zip(ps, gs, ms, vs, strict=True):
        adam_update(p, g, m, v, *scalars)
