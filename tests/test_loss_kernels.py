"""Softmax cross-entropy's fused kernels (netdsl.backends.numpy_fused_loss: the plain case
in one pass) against the NumPy reference kernels: the loss and the gradient, mean and
sum, float32 and float64; ignored labels and weights take the reference path; a label out
of range is the same error either way."""
from __future__ import annotations

import numpy as np
import pytest

from netdsl.backends.numpy import NumpyBackend
from netdsl.errors import NetdslError
from netdsl.ir import registry
from netdsl.ir.graph import Node
from netdsl.ir.types import TensorType
from netdsl.runtime.executor import KernelContext

pytest.importorskip("numba")
OPS = registry.load_all()
DEFAULTS = {"weight": None, "ignore_index": -100, "reduction": "mean", "axis": 1,
            "label_smoothing": 0.0}


def _ctx(fused: bool):
    be = NumpyBackend()
    if not fused:
        be._fused = None
    ctx = KernelContext(True, be, "float32")
    ctx.node = Node("loss", "softmax_cross_entropy", (), TensorType(()), {})
    return ctx


def _both(op, ins, a):
    """(fused, reference) results, and whether the fused kernel ran."""
    fused = _ctx(True)
    calls = []
    for name in ("sce_forward", "sce_grad"):
        real = getattr(fused.backend.fused, name)
        setattr(fused.backend.fused, name,
                lambda *args, _r=real: (calls.append(1), _r(*args))[1])
    got = OPS[op].kernel(np, ins, a, fused)
    want = OPS[op].kernel(np, ins, a, _ctx(False))
    return got, want, bool(calls)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("float64", 1e-13)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("shape", [(32, 10), (5, 3, 4)])  # (the second: class axis 1 of 3)
def test_the_fused_loss_and_gradient_match_the_reference(shape, reduction, dtype, tol):
    rng = np.random.default_rng(0)
    z = (4 * rng.standard_normal(shape)).astype(dtype)
    t = rng.integers(0, shape[1], (shape[0],) + shape[2:])
    a = {**DEFAULTS, "reduction": reduction}
    got, want, ran = _both("softmax_cross_entropy", [z, t], a)
    assert ran  # (class axis 1 of 3: moved last, a contiguous copy)
    assert np.asarray(got).dtype == np.asarray(want).dtype
    np.testing.assert_allclose(got, want, rtol=tol)
    dy = np.asarray(0.7, dtype)
    got, want, ran = _both("softmax_cross_entropy_grad", [dy, z, t], a)
    assert ran and got.shape == z.shape
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def test_ignored_labels_and_weights_take_the_reference_path():
    rng = np.random.default_rng(1)
    z = rng.standard_normal((6, 4))
    t = rng.integers(0, 4, 6)
    t[2] = -100
    for a in ({**DEFAULTS}, {**DEFAULTS, "weight": [1.0, 2.0, 0.5, 1.0]},
              {**DEFAULTS, "label_smoothing": 0.1}, {**DEFAULTS, "reduction": "none"}):
        got, want, _ = _both("softmax_cross_entropy", [z, t], a)
        np.testing.assert_allclose(got, want, rtol=1e-13)
        got, want, _ = _both("softmax_cross_entropy_grad", [np.ones(np.shape(want)), z, t], a)
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-15)


def test_a_label_out_of_range_is_the_same_error():
    z = np.zeros((3, 4))
    for fused in (True, False):
        with pytest.raises(NetdslError, match="label 7 is out of range for 4 classes"):
            OPS["softmax_cross_entropy"].kernel(np, [z, np.array([0, 7, 1])], DEFAULTS,
                                                 _ctx(fused))
