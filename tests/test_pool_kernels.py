"""The pooling kernels (one element-wise pass per kernel offset) against a plain loop
over windows: ties and NaN go to the first maximum in window order, padding, strides,
ceil mode, and 1-d / 3-d windows."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from netdsl.backends.numpy import NumpyBackend
from netdsl.ir import registry
from netdsl.ir.ops._util import fused_kernels
from netdsl.ir.ops.pool import _geom
from netdsl.runtime.executor import KernelContext


def reference(x, dy, a):
    """max pooling and its gradient by looping over every window."""
    d = x.ndim - 2
    k, s, p, sizes, out = _geom(x.shape, a, d)
    y = np.empty(x.shape[:2] + out, x.dtype)
    dx = np.zeros_like(x)
    for n, c in itertools.product(range(x.shape[0]), range(x.shape[1])):
        for o in itertools.product(*(range(v) for v in out)):
            best, at = None, None
            for off in itertools.product(*(range(v) for v in k)):
                i = tuple(o[j] * s[j] - p[j] + off[j] for j in range(d))
                if any(i[j] < 0 or i[j] >= sizes[j] for j in range(d)):
                    continue
                v = x[(n, c) + i]
                if best is None or v > best or (np.isnan(v) and not np.isnan(best)):
                    best, at = v, i
            y[(n, c) + o] = best
            dx[(n, c) + at] += dy[(n, c) + o]
    return y, dx


CASES = [
    ("maxpool", (2, 3, 7, 7), {"kernel": 3, "stride": 2, "padding": 1}),
    ("maxpool", (1, 2, 6, 5), {"kernel": 2}),
    ("maxpool", (2, 3, 8, 8), {"kernel": 2, "stride": 2}),  # (the fused 2x2 loop)
    ("maxpool", (1, 2, 7, 5), {"kernel": 2, "ceil_mode": True}),  # (windows past the edge)
    ("maxpool", (1, 2, 7, 6), {"kernel": 3, "stride": 2, "ceil_mode": True}),
    ("maxpool", (1, 1, 5, 5), {"kernel": 3, "stride": 1, "padding": 1}),
    ("maxpool1d", (2, 2, 9), {"kernel": 3, "stride": 2, "padding": 1}),
    ("maxpool3d", (1, 2, 4, 5, 4), {"kernel": 2, "stride": 1}),
]


@pytest.mark.parametrize("fused", [False, True], ids=["numpy", "fused"])
@pytest.mark.parametrize("op, shape, attrs", CASES)
def test_maxpool_kernels_match_the_window_loop(op, shape, attrs, fused):
    """The NumPy kernels, and with the backend's fused kernels (Numba: 2-d backward)."""
    ops = registry.load_all()
    ctx = None
    if fused:
        pytest.importorskip("numba")
        ctx = KernelContext(True, NumpyBackend(), "float64")
        assert ctx.backend.fused is not None
    a = {"stride": None, "padding": 0, "ceil_mode": False, **attrs}
    rng = np.random.default_rng(0)
    x = rng.integers(0, 3, shape).astype(np.float64)  # many ties
    x.flat[::7] = np.nan
    x.flat[3::11] = -np.inf
    y = ops[op].kernel(np, [x], a, ctx)
    dy = rng.standard_normal(y.shape)
    want_y, want_dx = reference(x, dy, a)
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_allclose(ops[op + "_grad"].kernel(np, [dy, x], a, ctx), want_dx,
                               rtol=1e-12, atol=1e-14)  # overlaps add in another order


def test_avgpool_kernel_matches_the_window_mean():
    ops = registry.load_all()
    a = {"kernel": 3, "stride": 2, "padding": 1, "ceil_mode": False,
         "count_include_pad": True}
    x = np.random.default_rng(1).standard_normal((2, 3, 7, 7))
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    want = np.array([[[[xp[n, c, 2 * i:2 * i + 3, 2 * j:2 * j + 3].mean()
                        for j in range(4)] for i in range(4)] for c in range(3)]
                     for n in range(2)])
    np.testing.assert_allclose(ops["avgpool"].kernel(np, [x], a, None), want, rtol=1e-12,
                               atol=1e-15)


@pytest.mark.parametrize("shape", [(2, 3, 8, 8), (1, 2, 7, 9)], ids=["covered", "edges"])
def test_fused_2x2_max_pool_backward_in_float32_bit_for_bit(shape):
    """numpy_fused_pool.maxpool2x2_grad moves dy's bits through integer views, masked by
    the first tap equal to the window's maximum: the compare chain's tap (ties between
    -0.0 and 0.0, NaNs, -inf), the same bits; where the windows cover x, dx starts
    uninitialised (empty_like) and every element is written."""
    pytest.importorskip("numba")
    ops = registry.load_all()
    ctx = KernelContext(True, NumpyBackend(), "float32")
    a = {"kernel": 2, "stride": None, "padding": 0, "ceil_mode": False}
    rng = np.random.default_rng(3)
    x = rng.choice(np.array([0.0, -0.0, 1.0, -1.0, np.nan, -np.inf], np.float32), shape)
    dy = rng.standard_normal((shape[0], shape[1], shape[2] // 2, shape[3] // 2))
    dy = dy.astype(np.float32)
    dy.flat[::5] = -0.0
    assert fused_kernels(ctx, dy, x) is not None  # the fused kernel runs, not NumPy's
    _, want = reference(x, dy, a)
    got = ops["maxpool_grad"].kernel(np, [dy, x], a, ctx)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)  # (a -0.0 of dy stays -0.0; the loop's += +0.0)
    nonzero = want != 0  # the bits themselves wherever the value is not a zero
    np.testing.assert_array_equal(got.view(np.int32)[nonzero], want.view(np.int32)[nonzero])
