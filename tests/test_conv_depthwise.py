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
    ((6, 4, 14, 14), 1, 3, 1, 1, 1),  # stacks of 6 images (MobileNetV2's 14x14)
    ((4, 3, 7, 7), 2, 3, 2, 1, 1),  # stacks, strided, two outputs a channel
    ((6, 2, 30, 30), 1, 3, 1, 1, 1),  # stacks of 2 (3 do not fit a chunk)
    ((2, 3, 6, 7), 1, 3, 1, 2, 1),  # stride 1, but padded past "same": phases
    ((2, 3, 8, 9), 1, 3, 1, 0, 1),  # unpadded: dx as a forward padded past "same"
    ((3, 2, 9, 10), 2, (3, 5), 1, (0, 1), 1),  # unpadded rows, taps short of the edges
    ((2, 3, 9, 11), 1, 3, (2, 1), 1, 1),  # strided rows only: phases, not unpadded rows
    ((2, 3, 12, 9), 2, 3, (3, 1), 1, 1),
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
    # the conv2d kernels took the loops; at stride 1 with one output a channel the input
    # gradient is the forward's loops on dy with the kernel flipped
    kh, kw = w.shape[2:]
    dh, dwl = (d, d) if not isinstance(d, tuple) else d
    (sh, sw), (ph, pw) = (v if isinstance(v, tuple) else (v, v) for v in (s, p))
    flipped = (sh, sw) == (1, 1) and m == 1 and ph <= dh * (kh - 1) and pw <= dwl * (kw - 1)
    dx_kernel = "depthwise_forward" if flipped else "depthwise_grad_input"
    assert sorted(calls) == sorted(["depthwise_forward", dx_kernel, "depthwise_grad_weight"])
    assert np.shares_memory(got[0], slot)
    want = _three(_reference(), x, w, dy, a)
    for name, u, v in zip(("y", "dx", "dw"), got, want, strict=True):
        assert u.dtype == v.dtype == dtype and u.shape == v.shape, name
        scale = max(float(np.abs(v).max()), 1.0)
        np.testing.assert_allclose(u, v, rtol=0, atol=tol * scale, err_msg=name)


def test_the_weight_gradient_is_the_same_on_any_number_of_threads():
    """Channels are split among the tasks, each channel's images summed in order: the same
    bits with one task as with three."""
    geom = (3, 3, 1, 1, 1, 1, 1, 1)
    for shape in ((3, 6, 20, 20), (4, 6, 7, 7)):  # one image a stack, and four
        x, w, dy = _data(shape, 1, 3, 1, 1, 1, np.float32)
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


def test_stacks_are_the_images_of_a_channel_that_fit_one_chunk():
    geom = (3, 3, 1, 1, 1, 1, 1, 1)
    assert dw.stack(8, 7, 7, *geom) == 8  # 9 x 9 phase planes: 8 x 81 elements a run
    assert dw.stack(8, 14, 14, *geom) == 8  # 16 x 16: 2,048, one chunk
    assert dw.stack(8, 28, 28, *geom) == 2  # 30 x 30: 3 would fit, but 3 does not divide 8
    assert dw.stack(8, 56, 56, *geom) == 1
    assert dw.stack(7, 14, 14, *geom) == 7


@pytest.mark.parametrize("geom", [(3, 3, 1, 1, 1, 1, 1, 1), (3, 3, 2, 2, 1, 1, 1, 1),
                                  (3, 3, 1, 1, 2, 2, 2, 2)])
def test_stacked_images_give_the_bits_of_one_image_at_a_time(geom):
    """Forward and input gradient: each output the same taps in the same order, stacked or
    not; the stack's unused rows neither reach y nor add into dx."""
    kh, kw, sh, sw, ph, pw, dh, dwl = geom
    x, w, dy = _data((8, 3, 7, 7), 2, kh, sh, ph, dh, np.float32)
    s = dw.stack(8, 7, 7, *geom)
    assert s == 8
    ys, dxs = [], []
    for k in (1, s):
        y = np.full(dy.shape, np.nan, np.float32)
        dx = np.full(x.shape, np.nan, np.float32)
        dw.depthwise_forward(x, w, sh, sw, ph, pw, dh, dwl, y, k, 2)
        dw.depthwise_grad_input(dy, w, sh, sw, ph, pw, dh, dwl, dx, k, 2)
        ys.append(y)
        dxs.append(dx)
    assert np.array_equal(ys[0], ys[1]) and np.array_equal(dxs[0], dxs[1])
    assert not np.isnan(ys[1]).any() and not np.isnan(dxs[1]).any()
