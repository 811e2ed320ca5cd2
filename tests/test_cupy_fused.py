"""The CuPy backend's CUDA kernels without a GPU: every launch passes what its kernel's
CUDA signature declares, in order (a pointer for each `T*`/`double*`/`long long*`, a
scalar of the declared width otherwise); and the source compiles for Hopper where nvcc is
installed. tests/test_gpu.py checks their numbers against NumPy on a GPU."""
from __future__ import annotations

import re
import shutil
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest

from netdsl.backends.cupy_fused import _SOURCE, CudaKernels
from netdsl.ir.ops import optim

SIGNATURES = {
    m.group(1): [p.strip() for p in m.group(2).split(",")]
    for m in re.finditer(r'extern "C" __global__ void (\w+)\(([^)]*)\)', _SOURCE)}


class FakeArray(np.ndarray):
    """Stands for a cupy.ndarray (the kernels' `accepts` asks for the backend's type)."""

    @property
    def data(self):  # cupy's MemoryPointer: the address as .ptr
        return SimpleNamespace(ptr=self.ctypes.data)


class FakeCupy:
    ndarray = FakeArray

    def __init__(self):
        self.launches = []
        self.uploads = 0
        outer = self

        class RawModule:
            def __init__(self, code, options):
                assert "typedef TYPE" not in code
                self.code = code

            def get_function(self, name):
                def launch(grid, block, args):
                    outer.launches.append((name, self.code, grid, block, args))
                return launch
        self.RawModule = RawModule

    def asarray(self, host):
        self.uploads += 1
        return np.array(host).view(FakeArray)


def dev(shape, dtype=np.float32):
    return np.zeros(shape, dtype).view(FakeArray)


def check_args(name, code, args):
    params = SIGNATURES[name]
    assert len(args) == len(params), (name, len(args), params)
    t = "float" if "typedef float T;" in code else "double"
    for arg, param in zip(args, params, strict=True):
        kind = param.rsplit(" ", 1)[0].replace("const ", "")
        if kind.endswith("*"):
            assert isinstance(arg, FakeArray), (name, param, type(arg))
            want = {"T*": t, "double*": "double", "long long*": "int64"}[kind]
            assert arg.dtype == np.dtype({"float": np.float32, "double": np.float64,
                                          "int64": np.int64}[want]), (name, param, arg.dtype)
        else:
            want = {"int": np.int32, "long long": np.int64, "double": np.float64,
                    "T": np.float32 if t == "float" else np.float64}[kind]
            assert type(arg) is want, (name, param, type(arg))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_launch_passes_what_its_signature_declares(dtype):
    cp = FakeCupy()
    k = CudaKernels(cp)
    n, c, p = 2, 3, 5
    x, y, dy = dev((n, c, p), dtype), dev((n, c, p), dtype), dev((n, c, p), dtype)
    w, b, rm, rv = (dev((c,), dtype) for _ in range(4))
    assert k.accepts(x, w) and not k.accepts(np.zeros(3, dtype))
    moments = dev((2, c), np.float64)
    st = dev((4, c), dtype)
    k.bn_forward(x, w, b, 1e-5, True, 6.0, y, moments)
    k.bn_running(rm, rv, moments, 0.1, n * p)
    k.bn_grad_stats(dy, x, w, b, 1e-5, True, float("inf"), st)
    k.bn_grad_input(dy, x, st, w, b, False, float("inf"), y, False, y)
    pv, gv, bufv = dev((7,), dtype), dev((7,), dtype), dev((7,), dtype)
    lr = dev((), dtype)
    k.sgd_update(pv, gv, bufv, lr, 0.9, 1e-4, False)
    k.adam_update_device(pv, gv, bufv, dev((7,), dtype), lr, dev((), np.int64), 0.9, 0.999,
                         1e-8, 0.01, True)
    group = [[dev((s,), dtype) for s in (7, 3)] for _ in range(4)]
    k.sgd_update_many(*group[:3], lr, 0.9, 1e-4, True)
    k.sgd_update_many(group[0], group[1], group[0], lr, 0.0, 0.0, False)
    k.adam_update_many_device(*group, lr, dev((), np.int64), 0.9, 0.999, 1e-8, 0.01, True)
    assert [name for name, *_ in cp.launches] == [
        "bn_forward", "bn_running", "bn_grad_stats", "bn_grad_input", "sgd_update",
        "adam_update", "sgd_update_many", "sgd_update_many", "adam_update_many"]
    for name, code, grid, block, args in cp.launches:
        check_args(name, code, args)
        assert block == (256,) and all(g >= 1 for g in grid)
    by_name = {name: grid for name, _, grid, _, _ in cp.launches}
    assert by_name["bn_forward"] == by_name["bn_grad_stats"] == (c,)  # a block a channel


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
@pytest.mark.parametrize("ctype", ["float", "double"])
def test_the_source_compiles_for_hopper(ctype, tmp_path):
    src = tmp_path / "k.cu"
    src.write_text(_SOURCE.replace("TYPE", ctype, 1))
    r = subprocess.run(["nvcc", "--std=c++14", "-arch=sm_90", "-ptx", str(src), "-o",
                        str(tmp_path / "k.ptx")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    entries = re.findall(r"\.entry (\w+)", (tmp_path / "k.ptx").read_text())
    assert set(entries) == set(SIGNATURES)


# -- the grouped updates' kernels, run on the CPU ----------------------------------------------
# The update kernels use no shared memory and no barriers, so a C++ compiler can run them
# as written: one call per (block, thread), in turn. That checks the grouped kernels'
# indexing (the table, the bisection, the grid-stride walk across tensors) against the
# single-tensor kernels without a GPU; tests/test_gpu.py checks the numbers on one.
_SHIM = r"""
#include <cmath>
using std::pow;
using std::sqrt;
struct Dim3 { unsigned int x, y, z; };
static Dim3 threadIdx, blockIdx, blockDim, gridDim;
#define __global__
#define __device__
#define __shared__ static
#define __syncthreads() do {} while (0)
"""

_LAUNCH = r"""
#define LAUNCH(name, params, args)                                                       \
    extern "C" void run_##name(int grid, int block, params) {                             \
        gridDim.x = grid; blockDim.x = block;                                             \
        for (int b = 0; b < grid; b++)                                                    \
            for (int t = 0; t < block; t++) {                                             \
                blockIdx.x = b; threadIdx.x = t;                                          \
                name args;                                                                \
            }                                                                             \
    }
#define P(...) __VA_ARGS__
LAUNCH(sgd_update, P(T* p, const T* g, T* buf, const T* lr, long long size, T momentum,
                     T wd, int nesterov), (p, g, buf, lr, size, momentum, wd, nesterov))
LAUNCH(sgd_update_many, P(const long long* table, int count, int arrays, const T* lr,
                          T momentum, T wd, int nesterov),
       (table, count, arrays, lr, momentum, wd, nesterov))
LAUNCH(adam_update, P(T* p, const T* g, T* m, T* v, const T* lr, const long long* step,
                      long long size, T b1, T b2, T eps, T wd, int decoupled),
       (p, g, m, v, lr, step, size, b1, b2, eps, wd, decoupled))
LAUNCH(adam_update_many, P(const long long* table, int count, const T* lr,
                           const long long* step, T b1, T b2, T eps, T wd, int decoupled),
       (table, count, lr, step, b1, b2, eps, wd, decoupled))
"""


@pytest.fixture(scope="module")
def cpu_kernels(tmp_path_factory):
    """The CUDA source's update kernels compiled for the CPU, float and double."""
    import ctypes
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    libs = {}
    for ctype, dt in (("float", np.float32), ("double", np.float64)):
        d = tmp_path_factory.mktemp(ctype)
        src = d / "k.cpp"
        src.write_text(_SHIM + _SOURCE.replace("TYPE", ctype, 1) + _LAUNCH)
        # no contraction into FMAs: the same roundings as the element-wise NumPy code
        r = subprocess.run([cxx, "-O1", "-ffp-contract=off", "-shared", "-fPIC", str(src),
                            "-o", str(d / "k.so")], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        libs[np.dtype(dt)] = ctypes.CDLL(str(d / "k.so"))
    return libs


class CpuLaunches:
    """CudaKernels' `cupy` on the CPU: RawModule functions run the compiled kernels, device
    arrays are NumPy arrays, and CudaKernels' grid and block are used as they are."""

    def __init__(self, libs):
        self.libs = libs
        self.ndarray = FakeArray
        outer = self

        class RawModule:
            def __init__(self, code, options):
                self.dtype = np.dtype(np.float32 if "typedef float T;" in code else np.float64)

            def get_function(self, name):
                fn = getattr(outer.libs[self.dtype], f"run_{name}")

                def launch(grid, block, args):
                    fn(*_c_args(grid[0], block[0], args, self.dtype))
                return launch
        self.RawModule = RawModule

    @staticmethod
    def asarray(host):
        return np.ascontiguousarray(host).view(FakeArray)


def _c_args(grid, block, args, dtype):
    import ctypes
    real = ctypes.c_float if dtype == np.float32 else ctypes.c_double
    out = [ctypes.c_int(grid), ctypes.c_int(block)]
    for a in args:
        if isinstance(a, np.ndarray):
            out.append(ctypes.c_void_p(a.ctypes.data))
        elif isinstance(a, np.int32):
            out.append(ctypes.c_int(int(a)))
        elif isinstance(a, np.int64):
            out.append(ctypes.c_longlong(int(a)))
        else:
            assert type(a) is dtype.type, type(a)
            out.append(real(float(a)))
    return out


def _group(rng, dtype, sizes, n_state):
    return [[rng.standard_normal(s).astype(dtype).view(FakeArray) for s in sizes]
            for _ in range(2 + n_state)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("momentum,nesterov,wd", [(0.0, False, 0.0), (0.9, True, 1e-4)])
def test_grouped_sgd_kernel_is_the_single_one_on_each_tensor(cpu_kernels, dtype, momentum,
                                                             nesterov, wd):
    k = CudaKernels(CpuLaunches(cpu_kernels))
    rng = np.random.default_rng(3)
    # sizes around the block (256) and the grid's stride, one of a single element
    sizes = [7, 256, 1, 300, 1000, 3]
    n_state = 1 if momentum else 0
    lr = np.array(0.05, dtype).view(FakeArray)
    one = _group(rng, dtype, sizes, n_state)
    many = [[x.copy() for x in row] for row in one]
    for _step in range(2):  # the momentum buffer carries over
        for j in range(len(sizes)):
            buf = one[2][j] if momentum else one[0][j]
            k.sgd_update(one[0][j], one[1][j], buf, lr, momentum, wd, nesterov)
        k.sgd_update_many(many[0], many[1], many[2] if momentum else many[0], lr, momentum,
                          wd, nesterov)
    for a, b in zip(sum(one, []), sum(many, []), strict=True):
        assert np.array_equal(a, b)
    # and the NumPy reference kernel (netdsl.ir.ops.optim, no fused kernels: ctx None)
    ref = [[np.asarray(x) for x in row] for row in _group(np.random.default_rng(3), dtype,
                                                          sizes, n_state)]
    a = {"momentum": momentum, "nesterov": nesterov, "weight_decay": wd}
    for _step in range(2):
        for j in range(len(sizes)):
            optim._sgd(np, [ref[0][j], ref[1][j], np.asarray(lr)] +
                       ([ref[2][j]] if momentum else []), a, None)
    for a_, b in zip(sum(ref, []), sum(one, []), strict=True):
        np.testing.assert_allclose(b, a_, rtol=1e-6 if dtype == np.float32 else 1e-15)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("wd,decoupled", [(0.0, False), (0.01, True)])
def test_grouped_adam_kernel_is_the_single_one_on_each_tensor(cpu_kernels, dtype, wd,
                                                              decoupled):
    k = CudaKernels(CpuLaunches(cpu_kernels))
    rng = np.random.default_rng(4)
    sizes = [5, 513, 64, 1, 2000]
    lr = np.array(1e-3, dtype).view(FakeArray)
    one = _group(rng, dtype, sizes, 2)
    for x in one[3]:  # exp_avg_sq is never negative
        x[...] = np.abs(x)
    many = [[x.copy() for x in row] for row in one]
    for step in (1, 2, 3):
        t = np.array(step, np.int64).view(FakeArray)
        for j in range(len(sizes)):
            k.adam_update_device(one[0][j], one[1][j], one[2][j], one[3][j], lr, t, 0.9,
                                 0.999, 1e-8, wd, decoupled)
        k.adam_update_many_device(*many, lr, t, 0.9, 0.999, 1e-8, wd, decoupled)
    for a, b in zip(sum(one, []), sum(many, []), strict=True):
        assert np.array_equal(a, b)


def test_a_groups_table_is_uploaded_once_for_the_same_arrays():
    cp = FakeCupy()
    k = CudaKernels(cp)
    ps, gs = [dev((3,)), dev((5,))], [dev((3,)), dev((5,))]
    lr = dev(())
    for _ in range(3):
        k.sgd_update_many(ps, gs, ps, lr, 0.0, 0.0, False)
    assert cp.uploads == 1 and len(cp.launches) == 3
    table = cp.launches[0][4][0]
    assert table.tolist() == [p.data.ptr for p in ps] + [g.data.ptr for g in gs] + [3, 8]
    k.sgd_update_many(ps, [dev((3,)), dev((5,))], ps, lr, 0.0, 0.0, False)  # new gradients
    assert cp.uploads == 2
