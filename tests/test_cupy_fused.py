"""The CuPy backend's CUDA kernels without a GPU: every launch passes what its kernel's
CUDA signature declares, in order (a pointer for each `T*`/`double*`/`long long*`, a
scalar of the declared width otherwise); the source compiles for Hopper where nvcc is
installed; and, compiled as C++ for the CPU (a block's threads as threads), every kernel
computes what the Numba loops and the NumPy kernels compute, alone and as a training
step's batchnorms through the executor. tests/test_gpu.py checks their numbers on a GPU."""
from __future__ import annotations

import re
import shutil
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest

from netdsl.backends.cupy_fused import _SOURCE, CudaKernels
from netdsl.backends.numpy import NumpyBackend
from netdsl.ir.ops import optim
from netdsl.parallel.split import SplitSpec, split_step
from netdsl.runtime.executor import Executor

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
    k.bn_moments(x, moments)
    k.bn_normalise(x, moments, w, b, 1e-5, True, 6.0, y)
    k.bn_grad_sums(dy, x, moments, w, b, 1e-5, False, float("inf"), st[:2])
    k.bn_combine(dev((4, c), dtype), np.array([7.0, 3.0]), st[:2])
    k.bn_grad_input(dy, x, st, w, b, True, 6.0, dy, True, y, 0, 40)
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
        "bn_forward", "bn_running", "bn_grad_stats", "bn_grad_input", "bn_moments",
        "bn_normalise", "bn_grad_sums", "bn_combine", "bn_grad_input", "sgd_update",
        "adam_update", "sgd_update_many", "sgd_update_many", "adam_update_many"]
    for name, code, grid, block, args in cp.launches:
        check_args(name, code, args)
        assert block == (256,) and all(g >= 1 for g in grid)
    by_name = {name: grid for name, _, grid, _, _ in cp.launches}
    for name in ("bn_forward", "bn_grad_stats", "bn_moments", "bn_normalise", "bn_grad_sums"):
        assert by_name[name] == (c,), name  # a block a channel
    counts = [args[-1] for name, _, _, _, args in cp.launches if name == "bn_grad_input"]
    assert counts == [n * p, 40.0]  # x's own count, or the one given


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


# -- the kernels, run on the CPU ---------------------------------------------------------------
# A C++ compiler runs the CUDA source as written: a launch starts a block's threads as
# std::threads, which take the blocks in turn; __syncthreads() is a barrier among them (and
# ends each block, so the next one may reuse __shared__ memory, a static here). That
# checks every kernel's indexing and arithmetic (the block reductions, the grouped updates'
# table and walk) against the Numba and NumPy kernels without a GPU; tests/test_gpu.py
# checks them on one.
_SHIM = r"""
#include <barrier>
#include <cmath>
#include <thread>
#include <vector>
using std::pow;
using std::sqrt;
struct Dim3 { unsigned int x, y, z; };
static thread_local Dim3 threadIdx, blockIdx;
static Dim3 blockDim, gridDim;
static std::barrier<>* block_barrier;
#define __global__
#define __device__
#define __shared__ static
#define __syncthreads() block_barrier->arrive_and_wait()
"""

_LAUNCH = r"""
#define LAUNCH(name, params, args)                                                       \
    extern "C" void run_##name(int grid_, int block_, params) {                           \
        gridDim.x = grid_; blockDim.x = block_;                                           \
        std::barrier<> bar_(block_);                                                      \
        block_barrier = &bar_;                                                            \
        std::vector<std::thread> threads_;                                                \
        for (int t_ = 0; t_ < block_; t_++)                                               \
            threads_.emplace_back([=] {                                                   \
                threadIdx.x = t_;                                                         \
                for (int b_ = 0; b_ < grid_; b_++) {                                      \
                    blockIdx.x = b_;                                                      \
                    name args;                                                            \
                    __syncthreads();                                                      \
                }                                                                         \
            });                                                                           \
        for (auto& th_ : threads_) th_.join();                                            \
    }
#define P(...) __VA_ARGS__
#define RELU int relu, int capped, double cap
LAUNCH(bn_forward, P(const T* x, const T* w, const T* b, T* y, double* mom, int n, int c,
                     int p, double eps, RELU),
       (x, w, b, y, mom, n, c, p, eps, relu, capped, cap))
LAUNCH(bn_moments, P(const T* x, double* mom, int n, int c, int p), (x, mom, n, c, p))
LAUNCH(bn_normalise, P(const T* x, const double* mom, const T* w, const T* b, T* y, int n,
                       int c, int p, double eps, RELU),
       (x, mom, w, b, y, n, c, p, eps, relu, capped, cap))
LAUNCH(bn_grad_sums, P(const T* dy, const T* x, const double* mom, const T* w, const T* b,
                       T* out, int n, int c, int p, double eps, RELU),
       (dy, x, mom, w, b, out, n, c, p, eps, relu, capped, cap))
LAUNCH(bn_combine, P(const T* parts, const double* counts, T* out, int k, int c),
       (parts, counts, out, k, c))
LAUNCH(bn_running, P(T* rm, T* rv, const double* mom, int c, double momentum,
                     double unbias), (rm, rv, mom, c, momentum, unbias))
LAUNCH(bn_grad_stats, P(const T* dy, const T* x, const T* w, const T* b, T* out, int n,
                        int c, int p, double eps, RELU),
       (dy, x, w, b, out, n, c, p, eps, relu, capped, cap))
LAUNCH(bn_grad_input, P(const T* dy, const T* x, const T* st, const T* w, const T* b,
                        const T* acc, T* dx, int n, int c, int p, RELU, int accumulate,
                        double count),
       (dy, x, st, w, b, acc, dx, n, c, p, relu, capped, cap, accumulate, count))
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


# A block's threads on the CPU: the kernels are written for any power of two (BLOCK), and
# 32 threads a launch start and meet at barriers eight times quicker than 256. The
# element-wise kernels stride over their grid, so they cover their elements with any
# block; a block-a-channel kernel's channels are of fewer and of more values than 32 in
# the tests below.
CPU_BLOCK = 32


@pytest.fixture(scope="module")
def cpu_kernels(tmp_path_factory):
    """The CUDA source's kernels compiled for the CPU, float and double."""
    import ctypes
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    libs = {}
    for ctype, dt in (("float", np.float32), ("double", np.float64)):
        d = tmp_path_factory.mktemp(ctype)
        src = d / "k.cpp"
        source = _SOURCE.replace("TYPE", ctype, 1).replace(
            "#define BLOCK 256", f"#define BLOCK {CPU_BLOCK}", 1)
        src.write_text(_SHIM + source + _LAUNCH)
        # no contraction into FMAs: the same roundings as the element-wise NumPy code
        r = subprocess.run([cxx, "-std=c++20", "-pthread", "-O1", "-ffp-contract=off",
                            "-shared", "-fPIC", str(src),
                            "-o", str(d / "k.so")], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        libs[np.dtype(dt)] = ctypes.CDLL(str(d / "k.so"))
    return libs


class CpuLaunches:
    """CudaKernels' `cupy` on the CPU: RawModule functions run the compiled kernels, device
    arrays are NumPy arrays, and CudaKernels' grid and block are used as they are."""

    def __init__(self, libs, ndarray=FakeArray):
        self.libs = libs
        self.ndarray = ndarray  # (np.ndarray: an executor's own arrays are "on the device")
        outer = self

        class RawModule:
            def __init__(self, code, options):
                self.dtype = np.dtype(np.float32 if "typedef float T;" in code else np.float64)

            def get_function(self, name):
                fn = getattr(outer.libs[self.dtype], f"run_{name}")

                def launch(grid, block, args):
                    assert block[0] == 256  # (CudaKernels' blocks; a CPU_BLOCK here)
                    fn(*_c_args(grid[0], CPU_BLOCK, args, self.dtype))
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
        elif isinstance(a, np.float64):  # a `double` (or a T of a double kernel)
            out.append(ctypes.c_double(float(a)))
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


def test_bn_combine_uploads_each_counts_once():
    cp = FakeCupy()
    k = CudaKernels(cp)
    parts, out = dev((4, 3)), dev((2, 3))
    for _ in range(3):
        k.bn_combine(parts, np.array([8.0, 8.0]), out)
    assert cp.uploads == 1 and len(cp.launches) == 3
    assert cp.launches[0][4][1].tolist() == [8.0, 8.0]
    k.bn_combine(parts, np.array([5.0, 3.0]), out)  # another split's parts
    assert cp.uploads == 2


# -- the batchnorm kernels, run on the CPU, against the Numba loops --------------------------------
# Both define the same arithmetic (the module docstrings): the CUDA kernels sum in float64
# in two passes, the Numba loops in the data's dtype by blocks over data shifted by a
# sample, so float64 agrees to rounding and float32 to float32's.
def _bn_case(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    c = shape[1]
    x = (rng.standard_normal(shape) * 1.5 + rng.standard_normal((1, c, 1)) * 3).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    w = (1 + 0.5 * rng.standard_normal(c)).astype(dtype)
    b = (0.3 * rng.standard_normal(c)).astype(dtype)
    return x, dy, w, b


def _on_device(*arrays):
    return [np.ascontiguousarray(a).view(FakeArray) for a in arrays]


def _close(got, want, dtype, what):
    want = np.asarray(want)
    tol = 2e-6 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(np.asarray(got), want, rtol=tol,
                               atol=tol * max(float(np.abs(want).max()), 1.0), err_msg=what)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("relu,cap", [(False, np.inf), (True, np.inf), (True, 1.0)])
# a channel of fewer values than a block's threads, and of more (strided loops)
@pytest.mark.parametrize("shape", [(3, 4, 9), (5, 3, 70)])
def test_cuda_batchnorm_kernels_are_the_numba_ones(cpu_kernels, dtype, relu, cap, shape):
    from netdsl.backends import numpy_fused_norm as nb
    cuda = CudaKernels(CpuLaunches(cpu_kernels))
    x, dy, w, b = _bn_case(dtype, shape)
    acc = np.random.default_rng(9).standard_normal(shape).astype(dtype)
    c, eps = shape[1], 1e-5
    X, DY, W, B, ACC = _on_device(x, dy, w, b, acc)

    def both(name, cuda_args, numba_args, outs):
        """Runs `name` on both; `outs`: indices of the output arrays in the arguments."""
        ours = [_on_device(a)[0] if isinstance(a, np.ndarray) else a for a in cuda_args]
        getattr(cuda, name)(*ours)
        getattr(nb, name)(*numba_args)
        for i in outs:
            _close(ours[i], numba_args[i], dtype, f"{name} argument {i}")
        return [numba_args[i] for i in outs]

    y, mom = np.empty_like(x), np.empty((2, c))
    both("bn_forward", [X, W, B, eps, relu, cap, y.copy(), mom.copy()],
         [x, w, b, eps, relu, cap, y, mom, 2], (6, 7))
    [mom] = both("bn_moments", [X, mom.copy()], [x, np.empty((2, c)), 2], (1,))
    # the moments of the whole batch (bn_combine's), not these data's own
    whole = mom * np.array([[1.1], [0.8]])
    both("bn_normalise", [X, whole, W, B, eps, relu, cap, y.copy()],
         [x, whole, w, b, eps, relu, cap, y, 2], (7,))
    sums = np.empty((2, c), dtype)
    both("bn_grad_sums", [DY, X, whole, W, B, eps, relu, cap, sums.copy()],
         [dy, x, whole, w, b, eps, relu, cap, sums, 2], (8,))
    st = np.empty((4, c), dtype)
    [st] = both("bn_grad_stats", [DY, X, W, B, eps, relu, cap, st.copy()],
                [dy, x, w, b, eps, relu, cap, st, 2], (7,))
    for accumulate, count in ((False, 0), (True, 0), (False, 7 * x.size // c)):
        dx = np.empty_like(x)
        both("bn_grad_input",
             [DY, X, st, W, B, relu, cap, ACC if accumulate else dx.copy(), accumulate,
              dx.copy(), 0, count],
             [dy, x, st, w, b, relu, cap, acc if accumulate else dx, accumulate, dx, 2,
              count], (9,))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cuda_bn_combine_and_running_update_are_the_reference(cpu_kernels, dtype):
    from netdsl.backends import numpy_fused_norm as nb
    from netdsl.ir.ops.norm import update_running
    cuda = CudaKernels(CpuLaunches(cpu_kernels))
    rng = np.random.default_rng(5)
    c = 300  # more channels than a block's threads: two blocks
    parts = np.empty((6, c), dtype)  # three parts' (mean, biased variance) rows
    parts[0::2] = 1000 + rng.standard_normal((3, c))  # far from zero: Chan's terms matter
    parts[1::2] = rng.uniform(0.5, 2.0, (3, c))
    counts = np.array([40.0, 40.0, 24.0])
    want, got = np.empty((2, c), dtype), np.empty((2, c), dtype).view(FakeArray)
    nb.bn_combine(parts, counts, want)
    cuda.bn_combine(*_on_device(parts), counts, got)
    _close(got, want, dtype, "bn_combine")
    # the running statistics from float64 moments: as the NumPy rule
    rm, rv = rng.standard_normal(c).astype(dtype), rng.uniform(1, 2, c).astype(dtype)
    mom = want.astype(np.float64)
    RM, RV = _on_device(rm, rv)
    cuda.bn_running(RM, RV, *_on_device(mom), 0.1, 104)
    update_running(rm, rv, mom[0], mom[1], 0.1, 104)
    _close(RM, rm, dtype, "running mean")
    _close(RV, rv, dtype, "running var")


# -- a whole split step through the executor on the CUDA kernels ---------------------------------
class CudaKernelsOnTheCpu(NumpyBackend):
    """The NumPy backend with the CUDA kernels (compiled for the CPU) as its `cuda_fused`
    and no Numba loops: every op that asks for fused_kernels(..., cuda=True) runs the CUDA
    source, as on a GPU, the others their NumPy code."""

    def __init__(self, libs):
        super().__init__()
        self._fused = None
        self.cuda_fused = CudaKernels(CpuLaunches(libs, ndarray=np.ndarray))


@pytest.mark.parametrize("spec", [SplitSpec(), SplitSpec(data=2), SplitSpec(data=3),
                                  SplitSpec(data=2, microbatches=2)],
                         ids=["one device", "data2", "data3", "data2-micro2"])
def test_a_step_on_the_cuda_kernels_is_the_numpy_step(cpu_kernels, spec, monkeypatch):
    """A training step (batchnorm, + relu, + relu6, without affine, over [N, C]) on one
    device and split over data replicas (synchronised batchnorm; parts of unequal size;
    micro-batches, each alone and the running statistics deferred), its batchnorms on the
    CUDA kernels: the NumPy step's loss, gradients and running statistics in float64."""
    from test_syncbn import NET, OPT, feeds

    from netdsl import api
    backend = CudaKernelsOnTheCpu(cpu_kernels)
    called = []
    for name in ("bn_forward", "bn_moments", "bn_combine", "bn_normalise", "bn_grad_sums",
                 "bn_grad_stats", "bn_grad_input", "bn_running"):
        def spy(*args, _f=getattr(backend.cuda_fused, name), _n=name):
            called.append(_n)
            return _f(*args)
        monkeypatch.setattr(backend.cuda_fused, name, spy)
    net = api.loads(NET, file="sbn.net")
    g = split_step(net.graph, 7, spec, OPT, device="gpu")
    # (one device's batchnorm moves its running statistics itself: no state_updates)
    roles = tuple(r for r in ("loss", "grads", "state_updates") if r in g.outputs)
    reference = NumpyBackend()
    reference._fused = None  # the NumPy kernels: the reference of both kinds of loops
    want = Executor(g, reference, dtype="f64", seed=0)
    got = Executor(g, backend, dtype="f64", seed=0)
    a = want.run(feeds(7), training=True, roles=roles, step=0)
    b = got.run(feeds(7), training=True, roles=roles, step=0)
    for role in ("loss", "grads"):
        for x, y in zip(a[role], b[role], strict=True):
            np.testing.assert_allclose(y, x, rtol=1e-10, atol=1e-12, err_msg=role)
    sa, sb = want.state_dict(), got.state_dict()
    for k in sa:
        np.testing.assert_allclose(sb[k], sa[k], rtol=1e-10, atol=1e-12, err_msg=k)
    layers = 4 * max(spec.data, 1) * max(spec.microbatches, 1)
    sync = spec.data > 1
    assert called.count("bn_grad_input") == layers
    assert called.count("bn_normalise" if sync else "bn_forward") == layers
    assert called.count("bn_grad_sums" if sync else "bn_grad_stats") == layers
    assert called.count("bn_running") == 4 * max(spec.data, 1)  # once a step each
