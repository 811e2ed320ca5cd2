"""Depthwise convolutions' direct loops (netdsl.backends.numpy_fused_depthwise, the `fast`
extra) against the grouped-GEMM reference kernels they replace: forward, input and weight
gradients over strides, paddings, dilations, kernel sizes and channel multipliers, in
float64 and float32; the conv2d kernels take them; the weight gradient does not depend
on the thread count; a budget too small for one task leaves the reference to run."""
from __future__ import annotations

import numpy as np
import pytest

from netdsl.backends.numpy import NumpyBackend
from netdsl.ir import registry
from netdsl.runtime.executor import KernelContext

pytest.importorskip("numba")
from netdsl.backends import numpy_fused_depthwise as dw  # noqa: E402

# (x shape, channel multiplier, kernel, stride, padding, dilation)
CASES = [
    ((2, 3, 9, 11), 1, 3, 1, 1, 1),
    ((2, 3, 9, 11), 2, 3, 2, 1, 1),
    ((1, 4, 10, 7), 1, 3, 2, 0, 1),
    ((2, 2, 12, 12), 3, 5, 3, 2, 2),
    ((3, 5, 6, 6), 1, 1, 1, 0, 1),
    ((2, 3, 7, 8), 1, 3, 1, 2, 2),
    ((1, 2, 5, 40), 1, (1, 3), (1, 2), (0, 1), 1),  # rectangular kernel and stride
    ((2, 16, 70, 70), 1, 3, 1, 1, 1),  # runs of more than one chunk
]


def _attrs(c, m, k, s, p, d):
    return {"out_channels": c * m, "kernel": k, "stride": s, "padding": p, "dilation": d,
            "groups": c}


def _three(backend, x, w, dy, a, out=None):
    """conv2d's forward, input gradient and weight gradient kernels on `backend`."""
    ctx = KernelContext(True, backend, str(x.dtype), out=out)
    with backend.running():
        y = registry.get("conv2d").kernel(np, [x, w], a, ctx)
        ctx = KernelContext(True, backend, str(x.dtype))
        dx = registry.get("conv2d_grad_input").kernel(np, [dy, w], {**a, "shape": x.shape}, ctx)
        gw = registry.get("conv2d_grad_weight").kernel(np, [dy, x], {**a, "shape": w.shape},
                                                       ctx)
    return y, dx, gw


def _reference():
    be = NumpyBackend()
    be._fused = None  # the grouped GEMMs run
    return be


def _data(shape, m, k, s, p, d, dtype, seed=0):
    """x, w and a dy of the output's shape."""
    rng = np.random.default_rng(seed)
    n, c, h, w = shape
    (kh, kw), (sh, sw), (ph, pw) = (v if isinstance(v, tuple) else (v, v) for v in (k, s, p))
    ho = (h + 2 * ph - d * (kh - 1) - 1) // sh + 1
    wo = (w + 2 * pw - d * (kw - 1) - 1) // sw + 1
    return (rng.standard_normal(shape).astype(dtype),
            rng.standard_normal((c * m, 1, kh, kw)).astype(dtype),
            rng.standard_normal((n, c * m, ho, wo)).astype(dtype))


KERNELS = ("depthwise_forward", "depthwise_grad_input", "depthwise_grad_weight")


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 1e-5)])
@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_depthwise_loops_match_the_grouped_gemms(case, dtype, tol, monkeypatch):
    shape, m, k, s, p, d = case
    x, w, dy = _data(shape, m, k, s, p, d, dtype)
    a = _attrs(shape[1], m, k, s, p, d)
    fast = NumpyBackend()
    assert fast.fused is not None  # loaded (and warmed up) before the count starts
    calls = []
    for name in KERNELS:
        def counted(*args, _kernel=getattr(dw, name), _name=name):
            calls.append(_name)
            return _kernel(*args)
        monkeypatch.setattr(dw, name, counted)
    slot = np.full(dy.shape, np.nan, dtype)  # a planned slot: written, not copied into
    got = _three(fast, x, w, dy, a, out=slot)
    assert sorted(calls) == list(KERNELS)  # the conv2d kernels took the loops
    assert np.shares_memory(got[0], slot)
    want = _three(_reference(), x, w, dy, a)
    for name, u, v in zip(("y", "dx", "dw"), got, want, strict=True):
        assert u.dtype == v.dtype == dtype and u.shape == v.shape, name
        scale = max(float(np.abs(v).max()), 1.0)
        np.testing.assert_allclose(u, v, rtol=0, atol=tol * scale, err_msg=name)


def test_the_weight_gradient_is_the_same_on_any_number_of_threads():
    """Channels are split among the tasks, each channel's images summed in order: the same
    bits with one task as with three."""
    x, w, dy = _data((3, 6, 20, 20), 1, 3, 1, 1, 1, np.float32)
    geom = (3, 3, 1, 1, 1, 1, 1, 1)
    one = dw.grad_weight(dy, x, w.shape, geom, 1, 1 << 30)
    three = dw.grad_weight(dy, x, w.shape, geom, 3, 1 << 30)
    assert np.array_equal(one, three)


def test_a_budget_below_one_task_leaves_the_reference_to_run():
    x, w, dy = _data((1, 2, 20, 20), 1, 3, 1, 1, 1, np.float32)
    geom = (3, 3, 1, 1, 1, 1, 1, 1)
    plane = dw.scratch_elems(20, 20, *geom)
    assert dw.conv(x, w, geom, 4, plane - 1) is None
    assert dw.grad_input(dy, w, x.shape, geom, 4, plane - 1) is None
    assert dw.conv(x, w, geom, 4, plane) is not None
