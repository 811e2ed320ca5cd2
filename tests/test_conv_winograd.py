"""Winograd F(2x2, 3x3) convolutions (netdsl.ir.ops.conv_winograd, with the Numba tile
transforms of the `fast` extra) against the flat-shift and im2col kernels they replace:
forward, input and weight gradients, in float64 and float32, through the conv2d kernels
and through a whole training step."""
from __future__ import annotations

import numpy as np
import pytest

import netdsl
from netdsl.backends.numpy import NumpyBackend
from netdsl.ir import registry
from netdsl.ir.ops import conv_winograd
from netdsl.runtime.executor import Executor, KernelContext

pytest.importorskip("numba")

# (x shape, out channels, padding): each is big enough for Winograd (applies() is checked),
# and not one the flat shift's image tasks take instead (conv._image_tasks_beat_winograd:
# two images or more and at most 64 channels)
CASES = [
    ((2, 72, 40, 40), 32, 1),
    ((1, 33, 35, 30), 40, 1),   # odd sizes: the last tile row and column are cropped
    ((2, 32, 36, 34), 80, 0),   # "valid"
    ((1, 40, 33, 35), 32, 2),
    ((1, 32, 33, 33), 32, (1, 0, 2, 1)),  # asymmetric: padded by conv.py, then Winograd
]


def _run(op, ins, attrs, backend):
    ctx = KernelContext(True, backend, str(ins[0].dtype))
    return registry.get(op).kernel(np, ins, attrs, ctx)


def _reference():
    be = NumpyBackend()
    be._fused = None  # no fused kernels: the flat-shift path runs
    return be


@pytest.fixture
def calls(monkeypatch):
    seen = []
    for name in ("conv", "grad_weight"):
        real = getattr(conv_winograd, name)
        monkeypatch.setattr(conv_winograd, name,
                            lambda *a, _r=real, _n=name, **k: seen.append(_n) or _r(*a, **k))
    return seen


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 3e-6)])
@pytest.mark.parametrize("shape,o,pad", CASES, ids=range(len(CASES)))
def test_winograd_kernels_equal_the_direct_ones(shape, o, pad, dtype, tol, calls):
    rng = np.random.default_rng(sum(shape) + o)
    x = rng.standard_normal(shape).astype(dtype)
    w = (rng.standard_normal((o, shape[1], 3, 3)) / 10).astype(dtype)
    b = rng.standard_normal(o).astype(dtype)
    geom = {"kernel": 3, "stride": 1, "padding": pad, "dilation": 1, "groups": 1}
    fast, ref = NumpyBackend(), _reference()
    assert fast.fused is not None
    y = _run("conv2d", [x, w, b], geom, fast)
    dy = rng.standard_normal(y.shape).astype(dtype)
    got = [y, _run("conv2d_grad_input", [dy, w], {**geom, "shape": shape}, fast),
           _run("conv2d_grad_weight", [dy, x], {**geom, "shape": w.shape}, fast)]
    assert calls == ["conv", "conv", "grad_weight"]  # Winograd ran, all three times
    want = [_run("conv2d", [x, w, b], geom, ref),
            _run("conv2d_grad_input", [dy, w], {**geom, "shape": shape}, ref),
            _run("conv2d_grad_weight", [dy, x], {**geom, "shape": w.shape}, ref)]
    for name, u, v in zip(("y", "dx", "dw"), got, want, strict=True):
        assert u.dtype == dtype and u.shape == v.shape, name
        np.testing.assert_allclose(u, v, rtol=0, atol=tol * np.abs(v).max(), err_msg=name)


def test_chunks_of_one_image_give_the_whole_batch_result(monkeypatch):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 32, 17, 19))
    w = rng.standard_normal((36, 32, 3, 3))
    dy = rng.standard_normal((3, 36, 17, 19))
    fast = NumpyBackend().fused
    calls = [(conv_winograd.conv, (fast, x, w, 1, 1)),
             (conv_winograd.grad_weight, (fast, dy, x, 1, 1))]
    assert conv_winograd.chunk(3, 32, 36, 17, 19)[0] == 3  # 90 tiles each: one chunk
    whole = [f(*args) for f, args in calls]
    monkeypatch.setattr(conv_winograd, "_ENOUGH_TILES", 1)
    assert conv_winograd.chunk(3, 32, 36, 17, 19)[0] == 1
    for (f, args), want in zip(calls, whole, strict=True):
        np.testing.assert_allclose(f(*args), want, rtol=1e-13, atol=1e-13)


def test_chunks_are_as_many_images_as_make_enough_tiles():
    assert conv_winograd.chunk(16, 32, 32, 16, 16)[0] == 16  # ResNet-164: the whole batch
    assert conv_winograd.chunk(8, 64, 64, 224, 224)[0] == 1  # VGG-16: 12,544 tiles each
    per, elems = conv_winograd.chunk(8, 256, 256, 56, 56)
    assert per == 6  # 784 tiles each: 4,704 >= 4,096
    assert elems == 6 * 16 * 784 * 512 + 32 * (conv_winograd._SKEW + 256 * 256)


def test_where_winograd_applies():
    big = (3, 3, 1, 1, 1, 1, 1, 1)
    assert conv_winograd.applies(big, 1, 8, 64, 64, 56, 56)
    assert not conv_winograd.applies(big, 1, 8, 16, 64, 56, 56)  # too few channels
    assert not conv_winograd.applies(big, 2, 8, 64, 64, 56, 56)  # grouped
    assert not conv_winograd.applies((3, 3, 2, 2, 1, 1, 1, 1), 1, 8, 64, 64, 28, 28)
    assert not conv_winograd.applies((3, 3, 1, 1, 2, 2, 2, 2), 1, 8, 64, 64, 56, 56)
    assert not conv_winograd.applies(big, 1, 2, 64, 64, 7, 7)  # 32 tiles
    assert not conv_winograd.applies(big, 1, 4, 64, 64, 8, 8)  # 64 tiles
    assert conv_winograd.applies(big, 1, 6, 64, 64, 8, 8)  # 96 tiles
    assert conv_winograd.applies(big, 1, 64, 512, 512, 7, 7)  # small images too


NET = """
network wide {
    input x: f32[N, 3, 32, 32]
    input y: i64[N]
    h = relu(batchnorm(conv2d(x, 72, kernel=3, padding=1)))
    h = relu(batchnorm(conv2d(h, 72, kernel=3, padding=1))) + h
    h = conv2d(h, 48, kernel=3, padding=0)
    logits = linear(flatten(avgpool(h, 6)), 10)
    output logits
    loss softmax_cross_entropy(logits, y)
}
"""


@pytest.mark.parametrize("dtype,tol", [("f64", 1e-10), ("f32", 2e-4)])
def test_training_step_with_winograd_equals_the_reference(monkeypatch, dtype, tol, calls):
    """The whole step (loss, every gradient) with the fused kernels (Winograd in the two
    72-channel convolutions) and without (NumPy reference kernels)."""
    from netdsl.passes.autodiff import autodiff
    g = autodiff(netdsl.loads(NET).lower(4))
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((4, 3, 32, 32)), "y": rng.integers(0, 10, 4)}
    runs = []
    for on in ("1", "0"):
        monkeypatch.setenv("NETDSL_FUSED_KERNELS", on)
        r = Executor(g, "numpy", dtype=dtype, seed=3).run(feeds, roles=("loss", "grads"))
        runs.append([np.asarray(v, np.float64) for k in ("loss", "grads") for v in r[k]])
    assert "conv" in calls and "grad_weight" in calls
    for a, b in zip(*runs, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * max(np.abs(b).max(), 1e-3))


def test_conv2d_picks_its_path_by_shape():
    """conv.py's path selector, which the kernel and its workspace rule both follow."""
    from netdsl.ir.ops.conv import _forward_path
    s1, s2 = (3, 3, 1, 1, 1, 1, 1, 1), (3, 3, 2, 2, 1, 1, 1, 1)
    assert _forward_path(2, 8, 6, (1, 1, 1, 1, 0, 0, 1, 1), 1, 12, 12, True) == "pointwise"
    assert _forward_path(16, 128, 128, s1, 1, 56, 56, True) == "winograd"
    assert _forward_path(16, 64, 64, s1, 1, 56, 56, True) == "flat"  # an image a task
    assert _forward_path(1, 64, 64, s1, 1, 56, 56, True) == "winograd"  # one image
    assert _forward_path(16, 64, 64, s1, 1, 8, 8, True) == "winograd"  # 8x8: 256 tiles
    assert _forward_path(8, 64, 64, s1, 1, 224, 224, True) == "winograd"  # 224x224
    assert _forward_path(16, 128, 128, s1, 1, 56, 56, False) == "flat"  # no fused kernels
    assert _forward_path(16, 512, 512, s1, 1, 7, 7, True) == "winograd"  # 256 tiles
    assert _forward_path(2, 512, 512, s1, 1, 7, 7, True) == "folded"  # small, wide
    assert _forward_path(32, 1, 16, s1, 1, 8, 8, True) == "folded"  # C*kh*kw = 9
    assert _forward_path(4, 64, 64, s1, 1, 8, 8, True) == "flat"  # small, narrow
    assert _forward_path(2, 8, 6, s2, 1, 36, 36, True) == "im2col"
    assert _forward_path(16, 256, 256, s2, 1, 28, 28, True) == "folded"
