"""The counter-based random numbers a recorded GPU step draws from
(netdsl.backends.counter_rng): NumPy's reference against the integer definition, their
range and spread, one stream per (seed, node) and step, and the CUDA kernel's source built
from the same constants. The kernel itself runs in test_gpu-style GPU tests only."""
from __future__ import annotations

import re

import numpy as np
import pytest

from netdsl.backends import counter_rng as rng


def test_the_numpy_mix_is_the_integer_definition():
    z = np.array([0, 1, 12345, 2**63, 2**64 - 1], np.uint64)
    assert [int(v) for v in rng._mix(z)] == [rng._mix_int(int(v)) for v in z]
    # splitmix64's published first outputs from state 0 (z += golden before mixing)
    assert rng._mix_int(0) == 0xE220A8397B1DCDAF


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
def test_draws_are_in_range_on_the_grid_and_evenly_spread(dtype):
    u = rng.uniform(rng.base(7, 99), 3, (200, 500), dtype)
    assert u.dtype == dtype and u.shape == (200, 500)
    assert 0.0 <= u.min() and u.max() < 1.0
    k = u.astype(np.float64) * 2.0 ** rng.BITS[dtype]
    np.testing.assert_array_equal(k, np.floor(k))  # multiples of 2^-bits: exact
    counts = np.histogram(u, bins=20, range=(0, 1))[0]
    chi2 = float(((counts - u.size / 20) ** 2 / (u.size / 20)).sum())
    assert chi2 < 45  # 19 degrees of freedom: p < 0.001 beyond 43.8


def test_each_seed_node_and_step_has_its_own_draws():
    a = rng.uniform(rng.base(1, 5), 0, (1000,), "float64")
    np.testing.assert_array_equal(a, rng.uniform(rng.base(1, 5), 0, (1000,), "float64"))
    for other in (rng.uniform(rng.base(2, 5), 0, (1000,), "float64"),
                  rng.uniform(rng.base(1, 6), 0, (1000,), "float64"),
                  rng.uniform(rng.base(1, 5), 1, (1000,), "float64")):
        assert abs(np.corrcoef(a, other)[0, 1]) < 0.1 and not np.array_equal(a, other)
    # a longer draw begins with the shorter one (element i depends on i alone)
    np.testing.assert_array_equal(rng.uniform(rng.base(1, 5), 0, (10,), "float64"), a[:10])


def test_the_generator_reads_the_step_when_it_draws():
    step = np.zeros(1, np.int64)
    g = rng.DeviceRNG(np, None, 4, 8, step)
    first = g.random((6,), "float32")
    step.fill(9)
    np.testing.assert_array_equal(g.random((6,), "float32"),
                                  rng.uniform(rng.base(4, 8), 9, (6,), "float32"))
    assert not np.array_equal(first, g.random((6,), "float32"))


def test_the_kernel_source_uses_the_reference_constants():
    consts = [int(c, 16) for c in re.findall(r"0x[0-9a-f]+", rng.KERNEL["preamble"])]
    assert consts == [rng._GOLDEN, rng._M1, rng._M2]
    shifts = [int(c) for c in re.findall(r">> (\d+)", rng.KERNEL["preamble"])]
    assert shifts == [30, 27, 31]
    op = rng.KERNEL["operation"]
    assert "netdsl_mix(netdsl_mix(stream ^ s) + (unsigned long long)i)" in op
    assert "step[0]" in op and rng.KERNEL["in_params"].startswith("raw int64 step")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
def test_the_cuda_kernel_draws_what_numpy_draws(dtype):
    from netdsl.backends import get_backend
    from netdsl.errors import DeviceError
    try:
        gpu = get_backend("cupy", 0)
    except DeviceError as e:
        pytest.skip(f"no usable CuPy GPU: {e.message}")
    step = gpu.asarray(np.array([5], np.int64))
    got = gpu.to_host(gpu.device_rng(3, 11, step).random((64, 33), dtype))
    np.testing.assert_array_equal(got, rng.uniform(rng.base(3, 11), 5, (64, 33), dtype))
