"""The vectorised erf NumPy uses without SciPy (netdsl/backends/erf.py): against math.erf
element by element, over both branches, their seam, the extremes and non-finite values,
and through gelu's forward and gradient when SciPy is hidden."""
from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from netdsl.backends.erf import erf


def _ref(xs):
    return np.array([math.erf(v) for v in np.asarray(xs, dtype=np.float64)])


def test_float64_matches_math_erf_to_a_few_ulps():
    xs = np.concatenate([np.linspace(-7, 7, 20001),
                         [0.0, -0.0, 2.9999999999, 3.0, 3.0000000001, 1e-300, 5e-324,
                          -1e-8, 40.0, -1e300]])
    got, ref = erf(np, xs), _ref(xs)
    assert np.all(np.abs(got - ref) <= 4e-15 * np.maximum(np.abs(ref), 1e-300))
    assert np.signbit(erf(np, np.array([-0.0])))[0]


def test_non_finite_and_float32():
    out = erf(np, np.array([np.inf, -np.inf, np.nan]))
    assert out[0] == 1.0 and out[1] == -1.0 and np.isnan(out[2])
    x = np.linspace(-5, 5, 1001, dtype=np.float32)
    y = erf(np, x)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, _ref(x).astype(np.float32), rtol=0, atol=1e-7)


def test_backend_uses_it_without_scipy(monkeypatch):
    from netdsl.backends.numpy import NumpyBackend
    monkeypatch.setitem(sys.modules, "scipy.special", None)  # import fails
    be = NumpyBackend()
    assert be._erf is None
    x = np.linspace(-4, 4, 101)
    np.testing.assert_allclose(be.erf(x), _ref(x), rtol=4e-15, atol=0)


@pytest.mark.parametrize("scipy", [True, False])
def test_gelu_with_and_without_scipy(monkeypatch, scipy):
    from netdsl.backends.numpy import NumpyBackend
    from netdsl.ir import registry
    from netdsl.runtime.executor import KernelContext
    if not scipy:
        monkeypatch.setitem(sys.modules, "scipy.special", None)
    ctx = KernelContext(True, NumpyBackend(), "float64")
    x = np.linspace(-6, 6, 97)
    y = registry.OPS["gelu"].kernel(np, [x], {"approximate": "none"}, ctx)
    # 1 + erf cancels for x << 0: erf is good to ~1e-15 absolute there, not relative
    np.testing.assert_allclose(y, 0.5 * x * (1 + _ref(x / math.sqrt(2))), rtol=1e-14,
                               atol=4e-15)
