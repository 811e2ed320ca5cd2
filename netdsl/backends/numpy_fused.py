"""Fused CPU kernels for the NumPy backend, compiled by Numba (the optional `fast` extra).

NumPy runs one pass over memory per ufunc and cannot fuse loops; these Numba loops read
each input about once and write each output once. By job:
- numpy_fused_norm: batchnorm (+ relu), layernorm and softmax;
- numpy_fused_activation: float32 GELU (a vectorised rational erf), relu(a + b) and relu's
  gradient (with a gradient sum folded in);
- numpy_fused_optim: the SGD and Adam updates, bit for bit the NumPy kernels;
- numpy_fused_pool: 2-d max pooling's backward;
- numpy_fused_scatter: scatter-adds: rows (the embedding and gather gradients) and a
  strided convolution's col2im;
- numpy_winograd: Winograd F(2x2, 3x3)'s tile transforms (netdsl.ir.ops.conv_winograd);
- numpy_fused_depthwise: depthwise convolutions (groups = channels) as direct loops;
- numpy_fused_attention: multi-head attention over packed q/k/v (the attention_qkv op),
  an (image, head) pair a task, heads read and written in place;
- numpy_fused_gemm: with two or more threads, batches of GEMMs spread over the loops'
  threads, NumPy's own BLAS held to one thread during a step (one pool of threads).

The NumPy kernels in netdsl.ir.ops stay the reference the tests compare these against.
Compiled with `cache=True`: the machine code is kept in `__pycache__` next to each file,
so only the first process after an install pays the compile, and only for the groups of
kernels (KERNEL_GROUPS) in the dtypes its executors load (FusedKernels.load): the ones
their graphs' ops name. Numba and these modules are
imported lazily by `NumpyBackend.fused` (through this one), nowhere else.
"""
from __future__ import annotations

import os
from contextlib import nullcontext

import numba
import numpy as np

from netdsl.backends import numpy_fused_depthwise, numpy_winograd
from netdsl.backends.numpy_fused_activation import (
    add,
    gelu_f32,
    gelu_grad,
    gelu_grad_f32,
    relu_grad,
    window_grad,
)
from netdsl.backends.numpy_fused_attention import (
    attention_grad_tasks,
    attention_probs_tasks,
    attention_tasks,
)
from netdsl.backends.numpy_fused_bf16 import BF16, with_bits
from netdsl.backends.numpy_fused_gemm import PooledGemm, find_numpy_cblas
from netdsl.backends.numpy_fused_loss import sce_forward, sce_grad
from netdsl.backends.numpy_fused_norm import (
    bn_combine,
    bn_forward,
    bn_grad_input,
    bn_grad_stats,
    bn_grad_sums,
    bn_moments,
    bn_normalise,
    ln_forward,
    ln_grad_input,
    ln_grad_weight,
    softmax_grad_rows,
    softmax_rows,
)
from netdsl.backends.numpy_fused_optim import (
    adam_update,
    adam_update_many,
    sgd_update,
    sgd_update_many,
)
from netdsl.backends.numpy_fused_pool import maxpool2d_grad, maxpool2x2, maxpool2x2_grad
from netdsl.backends.numpy_fused_scatter import col2im_add, im2col_rows, scatter_add_rows

# How many MPI ranks share this machine, as MPICH (Hydra) and Open MPI tell each rank.
LOCAL_RANKS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")


def thread_count() -> int:
    """The threads the loops run on: as the BLAS is told (OMP_NUM_THREADS or
    OPENBLAS_NUM_THREADS, what `--threads` sets in the benchmarks), else Numba's default
    (NUMBA_NUM_THREADS, or the cores) shared out among the MPI ranks on this machine
    (`mpiexec -n 2` on two cores: one each, not two ranks of two threads spinning against
    each other), never more than Numba's pool."""
    pool = numba.config.NUMBA_NUM_THREADS
    for key in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        v = os.environ.get(key, "").strip()
        if v.isdigit() and int(v) > 0:
            return min(int(v), pool)
    for key in LOCAL_RANKS:
        v = os.environ.get(key, "").strip()
        if v.isdigit() and int(v) > 1:
            return max(1, pool // int(v))
    return pool


# Numba's parallel loops run on libgomp, whose idle threads spin ("active" waits) by
# default. OpenBLAS's threads spin between GEMMs too, and where both pools run the two
# take the cores from each other, which makes a step on as many threads as cores several
# times slower than with passive waits (bench/bench_step.py --threads 2;
# docs/benchmarks.md). Passive waits are only needed there: where the GEMMs go on the
# loops' threads (numpy_fused_gemm) NumPy's BLAS has one thread during a step, and
# libgomp's threads spin for SPIN_COUNT turns before they sleep, which beats passive waits
# (a wake-up at every parallel loop). The spin is short because two processes on the same
# cores spin against each other, and a long spin makes both much slower. Alone on the
# machine, longer spins spare the small networks a wake-up at most parallel loops:
# GOMP_SPINCOUNT=100000 in the environment gives that (docs/training.md,
# docs/benchmarks.md). libgomp reads these
# when Numba loads it, the first time the loops' threads are set; a policy or spin count
# the user set stands.
WAIT_POLICY = ("OMP_WAIT_POLICY", "PASSIVE")
SPIN_COUNT = ("GOMP_SPINCOUNT", "10000")


def passive_waits() -> None:
    os.environ.setdefault(*WAIT_POLICY)


def short_spins() -> None:
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault(*SPIN_COUNT)


class FusedKernels:
    """What kernels see as `ctx.backend.fused`: the compiled loops, for float32 and
    float64 C-contiguous arrays (callers fall back to the NumPy reference otherwise), and
    bf16 ones for the loops that read it themselves (numpy_fused_bf16: batchnorm's and
    relu's; an op's kernel gets bf16 only where its OpDef.reads_reduced says "numba")."""

    bn_forward = staticmethod(with_bits(bn_forward))
    bn_grad_stats = staticmethod(with_bits(bn_grad_stats))
    bn_grad_input = staticmethod(with_bits(bn_grad_input))
    bn_moments = staticmethod(bn_moments)  # a synchronised batchnorm's (ir/ops/norm_sync.py)
    bn_normalise = staticmethod(bn_normalise)
    bn_grad_sums = staticmethod(bn_grad_sums)
    bn_combine = staticmethod(bn_combine)
    ln_forward = staticmethod(ln_forward)
    ln_grad_input = staticmethod(ln_grad_input)
    ln_grad_weight = staticmethod(ln_grad_weight)
    softmax_rows = staticmethod(softmax_rows)
    softmax_grad_rows = staticmethod(softmax_grad_rows)
    sgd_update = staticmethod(sgd_update)
    adam_update = staticmethod(adam_update)
    sgd_update_many = staticmethod(sgd_update_many)  # a group of parameters in one call
    adam_update_many = staticmethod(adam_update_many)
    maxpool2d_grad = staticmethod(maxpool2d_grad)
    maxpool2x2 = staticmethod(maxpool2x2)
    maxpool2x2_grad = staticmethod(maxpool2x2_grad)
    sce_forward = staticmethod(sce_forward)  # softmax cross-entropy, the plain case
    sce_grad = staticmethod(sce_grad)
    add = staticmethod(with_bits(add))  # a + b, or relu(a + b)
    relu_grad = staticmethod(with_bits(relu_grad))
    window_grad = staticmethod(window_grad)  # relu6's and clip's gradients
    scatter_add_rows = staticmethod(scatter_add_rows)
    col2im_add = staticmethod(col2im_add)
    im2col_rows = staticmethod(im2col_rows)
    winograd = numpy_winograd  # F(2x2, 3x3) tile transforms (netdsl.ir.ops.conv_winograd)
    depthwise = numpy_fused_depthwise  # direct depthwise convolutions (groups = channels)

    def __init__(self):
        self.threads = thread_count()
        self.cblas = find_numpy_cblas()  # None: NumPy links another BLAS
        pooled = self.cblas is not None and self.threads > 1
        if pooled:
            short_spins()
        else:
            passive_waits()
        numba.set_num_threads(self.threads)
        # None: NumPy's matmul (its BLAS's own threads) runs every product
        self.gemm = PooledGemm(self.cblas, self.threads) if pooled else None
        # the stride-1 convolutions' image-a-task kernels run on one thread too: their
        # weight gradient sums differently from the other paths, and a step's numbers
        # must not depend on the thread count (tests/test_mpi.py)
        self.convs = None if self.cblas is None else \
            self.gemm or PooledGemm(self.cblas, self.threads)
        # the attention kernels' "no kept probabilities": an empty [N, heads, T, T]
        self._no_probs = {np.dtype(dt): np.empty((0, 0, 0, 0), dt)
                          for dt in (np.float32, np.float64)}
        self.loaded: set[tuple[str, np.dtype]] = set()  # (group, dtype) called once so far

    def load(self, groups, dtypes=(np.float32, np.float64)) -> None:
        """Load (on a machine's first run, compile) the kernels of `groups` (names in
        KERNEL_GROUPS, as the ops that call them declare: OpDef.extra["fused_kernels"]) for
        `dtypes`, by a call on tiny arrays: each compiled signature is loaded from Numba's
        cache, or compiled, on its first call, and none may happen inside a measured step
        (its time, its tracemalloc peak). The executor loads what its graph's ops use, so a
        run compiles what it runs: a float32 ResNet neither the float64 kernels nor the
        depthwise, attention or layernorm ones, a fraction of the time that compiling every
        kernel takes."""
        for group in groups:
            for dt in dtypes:
                key = (group, np.dtype(dt))
                if np.dtype(dt) == BF16:  # (the groups whose loops read bf16 bits)
                    warm = BF16_GROUPS.get(group)
                    if warm is not None and key not in self.loaded:
                        warm(self)
                        self.loaded.add(key)
                elif key not in self.loaded:
                    KERNEL_GROUPS[group](self, np.dtype(dt).type)
                    self.loaded.add(key)

    @staticmethod
    def gelu(x):
        """x * Phi(x) for float32 x (None for other dtypes: they take the exact erf)."""
        if x.dtype != np.float32:
            return None
        y = np.empty_like(x)
        gelu_f32(x.reshape(-1), y.reshape(-1))
        return y

    @staticmethod
    def gelu_grad(dy, x):
        """GELU's dx for float32 (None for other dtypes)."""
        if x.dtype != np.float32 or dy.dtype != np.float32:
            return None
        return gelu_grad(dy, x)

    def matmul(self, a, b, out=None, accumulate=False, bias=None, residual=None):
        """a @ b (+ bias along its rows, + a residual of the result's shape) on the loops'
        threads (numpy_fused_gemm.PooledGemm), or None where it runs as NumPy's matmul. On
        one thread only the products cut into blocks (numpy_fused_gemm.product_blocks) go
        there, and those with a residual (each block's share added while in cache, where
        NumPy's matmul and an add make two more passes over memory); the others are
        NumPy's own call."""
        if self.gemm is not None:
            return self.gemm(a, b, out, accumulate, bias, residual=residual)
        if self.convs is not None:
            return self.convs(a, b, out, accumulate, bias, blocked_only=residual is None,
                              residual=residual)
        return None

    def shifted_matmul(self, a, b, offsets, n):
        """A convolution's flat shift in one parallel call
        (numpy_fused_gemm.PooledGemm.shifted), or None."""
        if self.gemm is None:
            return None
        return self.gemm.shifted(a, b, np.asarray(offsets, dtype=np.int64), n)

    def shifted_conv(self, x, wt, kh, kw, ph, pw, dh, dw, out=None):
        """A stride-1 convolution by the flat shift with an image a task
        (numpy_fused_gemm.PooledGemm.conv), or None."""
        if self.convs is None:
            return None
        return self.convs.conv(x, wt, kh, kw, ph, pw, dh, dw, out)

    def shifted_conv_grad_weight(self, dy, x, kh, kw, ph, pw, dh, dw, budget):
        """A stride-1 convolution's weight gradient, an image a task, within `budget`
        elements of scratch (numpy_fused_gemm.PooledGemm.conv_grad_weight), or None."""
        if self.convs is None:
            return None
        return self.convs.conv_grad_weight(dy, x, kh, kw, ph, pw, dh, dw, budget)

    def _attention_blas(self, *arrays):
        """cblas_?gemm's address for the attention kernels, or None where they do not take
        these arrays: no NumPy OpenBLAS found, not inside a step's `running` block (where
        that BLAS is held to one thread), or not of one float dtype and C-contiguous."""
        arrays = [a for a in arrays if a is not None]
        if self.convs is None or not self.cblas.held or not self.accepts(*arrays) \
                or len({a.dtype for a in arrays}) != 1:
            return None
        return self.cblas.gemm[arrays[0].dtype]

    @staticmethod
    def _slot(out, shape, dtype):
        """The planned slot where it is C-contiguous and of the dtype, else a new array."""
        if out is None or not out.flags.c_contiguous or out.dtype != dtype:
            return np.empty(shape, dtype)
        return out

    def attention(self, qkv, heads, scale, causal, out=None, p=None):
        """attention_qkv's forward, [N, T, D] from qkv [N, T, 3D] (and the kept
        probabilities p), or None (numpy_fused_attention.attention_tasks)."""
        fn = self._attention_blas(qkv, p)
        if fn is None:
            return None
        n, t, d3 = qkv.shape
        out = self._slot(out, (n, t, d3 // 3), qkv.dtype)
        t_ = qkv.dtype.type
        attention_tasks(fn, t_(1), t_(scale), qkv, heads, causal,
                        self._no_probs[qkv.dtype] if p is None else p, out, self.threads)
        return out

    def attention_probs(self, qkv, heads, scale, causal, out=None):
        """attention_qkv_probs, [N, heads, T, T] from qkv [N, T, 3D], or None
        (numpy_fused_attention.attention_probs_tasks)."""
        fn = self._attention_blas(qkv)
        if fn is None:
            return None
        n, t, _ = qkv.shape
        out = self._slot(out, (n, heads, t, t), qkv.dtype)
        attention_probs_tasks(fn, qkv.dtype.type(scale), qkv, heads, causal, out,
                              self.threads)
        return out

    def attention_grad(self, gy, qkv, heads, scale, causal, out=None, p=None):
        """attention_qkv_grad's dqkv from gy [N, T, D] and qkv [N, T, 3D] (and the kept
        probabilities p), or None (numpy_fused_attention.attention_grad_tasks)."""
        fn = self._attention_blas(gy, qkv, p)
        if fn is None:
            return None
        out = self._slot(out, qkv.shape, qkv.dtype)
        t_ = qkv.dtype.type
        attention_grad_tasks(fn, t_(1), t_(scale), gy, qkv, heads, causal,
                             self._no_probs[qkv.dtype] if p is None else p, out,
                             self.threads)
        return out

    def running(self):
        """Held around each run of a graph: NumPy's BLAS at one thread while the GEMMs
        share the loops' threads, else at no more than the loops' threads (one for each
        of two MPI ranks on two cores: thread_count)."""
        if self.cblas is None:
            return nullcontext()
        return self.cblas.limit(1 if self.gemm is not None else self.threads)

    @staticmethod
    def accepts(*arrays) -> bool:
        return all(isinstance(a, np.ndarray) and a.dtype in (np.float32, np.float64, BF16)
                   and a.flags.c_contiguous and a.size > 0 for a in arrays)

    def __repr__(self) -> str:
        gemm = ", GEMMs on them" if self.gemm is not None else ""
        return f"FusedKernels(numba {numba.__version__}, {self.threads} threads{gemm})"


# -- loading by group: one call per compiled signature, on tiny arrays (FusedKernels.load) ----
def _warm_gemm(f: FusedKernels, dt) -> None:
    if f.convs is not None:
        f.convs.warm_up(dt)


def _warm_attention(f: FusedKernels, dt) -> None:
    if f.convs is None:
        return
    qkv, fn, one = np.ones((1, 2, 3), dt), f.cblas.gemm[np.dtype(dt)], dt(1)
    gy, p = np.ones((1, 2, 1), dt), np.empty((1, 1, 2, 2), dt)
    attention_probs_tasks(fn, one, qkv, 1, False, p, 1)
    for kept in (f._no_probs[np.dtype(dt)], p):
        attention_tasks(fn, one, one, qkv, 1, False, kept, gy.copy(), 1)
        attention_grad_tasks(fn, one, one, gy, qkv, 1, False, kept, np.empty_like(qkv), 1)


def _warm_batchnorm(f: FusedKernels, dt) -> None:
    x = np.ones((1, 1, 2), dt)
    w, st, y = np.ones(1, dt), np.ones((4, 1), dt), np.empty_like(x)
    bn_forward(x, w, w, 1e-5, True, np.inf, y, np.empty((2, 1)), 1)
    bn_grad_stats(x, x, w, w, 1e-5, True, np.inf, st, 1)
    bn_grad_input(x, x, st, w, w, True, np.inf, x, True, y, 1)
    # a synchronised batchnorm's (one signature each; bn_grad_input's with its count)
    moments = np.empty((2, 1))
    bn_moments(x, moments, 1)
    bn_normalise(x, moments, w, w, 1e-5, True, np.inf, y, 1)
    bn_grad_sums(x, x, moments, w, w, 1e-5, True, np.inf, st[:2].copy(), 1)
    bn_grad_input(x, x, st, w, w, True, np.inf, x, True, y, 1, 4)
    bn_combine(st, np.ones(2), st[:2].copy())


def _warm_layernorm(f: FusedKernels, dt) -> None:
    r2, d1 = np.ones((1, 2), dt), np.ones(2, dt)
    ln_forward(r2, d1, d1, 1e-5, r2.copy())
    ln_grad_input(r2, r2, d1, 1e-5, r2.copy())
    ln_grad_weight(r2, r2, 1e-5, np.zeros(2))


def _warm_softmax(f: FusedKernels, dt) -> None:
    r2 = np.ones((1, 2), dt)
    softmax_rows(r2, r2.copy())
    softmax_grad_rows(r2, r2, r2.copy())


def _warm_loss(f: FusedKernels, dt) -> None:
    r2, labels = np.ones((1, 2), dt), np.zeros(1, np.int64)
    sce_forward(r2, labels, -100)
    sce_grad(r2, labels, -100, 1.0, r2.copy())


def _warm_optimizer(f: FusedKernels, dt) -> None:
    d1 = np.ones(2, dt)
    sgd_update(d1, d1, d1.copy(), dt(0), dt(0), dt(0), False)
    adam_update(d1, d1, d1.copy(), d1.copy(), *(dt(1),) * 9)


def _warm_pool(f: FusedKernels, dt) -> None:
    q = np.ones((1, 1, 2, 2), dt)
    maxpool2d_grad(q, q, 1, 1, 1, 1, 0, 0, q.copy())
    maxpool2x2_grad(q[:, :, :1, :1].copy(), q, q.copy())
    maxpool2x2(q, q[:, :, :1, :1].copy())


def _warm_scatter(f: FusedKernels, dt) -> None:
    r2 = np.ones((1, 2), dt)
    scatter_add_rows(r2.copy(), np.zeros(1, np.int64), r2)


def _warm_im2col(f: FusedKernels, dt) -> None:
    q = np.ones((1, 1, 2, 2), dt)
    col2im_add(np.zeros((1, 2, 2), dt), np.ones((1, 1, 1, 1, 1), dt), 1, 1, 1, 1)
    im2col_rows(q, 1, 1, 1, 1, 0, 0, 1, 1, np.empty((1, 4), dt))


def _warm_elementwise(f: FusedKernels, dt) -> None:
    d1 = np.ones(2, dt)
    add(d1, d1, False, d1.copy())
    relu_grad(d1, d1, d1, True, d1.copy())
    window_grad(d1, d1, dt(0), dt(6), dt(1), False, d1.copy())


def _warm_gelu(f: FusedKernels, dt) -> None:
    if dt is np.float32:  # (other dtypes take the exact erf)
        v = np.ones(2, np.float32)
        gelu_f32(v, v.copy())
        gelu_grad_f32(v, v, v.copy())


def _warm_winograd(f: FusedKernels, dt) -> None:
    t = np.ones((1, 1, 2, 2), dt)
    # the tile matrices are strided views (conv_winograd._tile_matrices): a different
    # Numba type from a C-contiguous array, so loaded as one
    tiles = np.empty((16, 2), dt)[:, :1].reshape(16, 1, 1)
    numpy_winograd.input_tiles(t, 1, 1, 0, 1, 1, 1, tiles)
    numpy_winograd.output_tiles(tiles, 0, 1, 1, 1, t)
    numpy_winograd.output_tiles_adjoint(t, 0, 1, 1, 1, tiles)


def _warm_depthwise(f: FusedKernels, dt) -> None:
    t, w1 = np.ones((1, 1, 2, 2), dt), np.ones((1, 1, 1, 1), dt)
    geom = (1, 1, 1, 1, 0, 0, 1, 1)
    # (a budget that holds a task, so that each call reaches its loops)
    numpy_fused_depthwise.conv(t, w1, geom, 1, 64)
    numpy_fused_depthwise.grad_input(t, w1, t.shape, geom, 1, 64)
    # (two outputs a channel: the scatter loops, not the forward's on dy)
    numpy_fused_depthwise.grad_input(np.ones((1, 2, 2, 2), dt), np.ones((2, 1, 1, 1), dt),
                                     t.shape, geom, 1, 64)
    numpy_fused_depthwise.grad_weight(t, t, w1.shape, geom, 1, 64)


def _warm_batchnorm_bf16(f: FusedKernels) -> None:
    x, w, st = np.ones((1, 1, 2), BF16), np.ones(1, np.float32), np.ones((4, 1), np.float32)
    f.bn_forward(x, w, w, 1e-5, True, np.inf, x.copy(), np.empty((2, 1)), 1)
    f.bn_grad_stats(x, x, w, w, 1e-5, True, np.inf, st, 1)
    f.bn_grad_input(x, x, st, w, w, True, np.inf, x, True, x.copy(), 1)


def _warm_elementwise_bf16(f: FusedKernels) -> None:
    d1 = np.ones(2, BF16)
    f.add(d1, d1, True, d1.copy())
    f.relu_grad(d1, d1, d1, True, d1.copy())


# the groups with loops that read bf16 (numpy_fused_bf16), loaded for a graph that has it
BF16_GROUPS = {"batchnorm": _warm_batchnorm_bf16, "elementwise": _warm_elementwise_bf16}

# the groups an op names in OpDef.extra["fused_kernels"] (netdsl.ir.registry.OpDef.fused_groups)
KERNEL_GROUPS = {
    "gemm": _warm_gemm, "attention": _warm_attention, "batchnorm": _warm_batchnorm,
    "layernorm": _warm_layernorm, "softmax": _warm_softmax, "loss": _warm_loss,
    "optimizer": _warm_optimizer, "pool": _warm_pool, "scatter": _warm_scatter,
    "im2col": _warm_im2col, "elementwise": _warm_elementwise, "gelu": _warm_gelu,
    "winograd": _warm_winograd, "depthwise": _warm_depthwise,
}
