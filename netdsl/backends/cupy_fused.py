"""Fused CUDA kernels for the CuPy backend: batchnorm (+ relu), synchronised too, and the
SGD and Adam updates.

Through CuPy's array API, one batchnorm forward is about fifteen launches (sums, deviations,
squares, scales, the relu) and its backward about twenty, each paying CuPy's host-side
dispatch, which takes far longer than the kernel on a small tensor; on a GPU as fast as an
H200 a small network's step is nothing but that overhead (docs/benchmarks.md, "GPU").
Here each of those operators is one launch:

- batchnorm forward: one block a channel; the mean and the variance in two passes over
  the channel (float64 sums), then y, in the same launch;
- batchnorm's backward statistics: the same two passes, then sum(g) and sum(g * (x - mean))
  with the relu mask recomputed (one block a channel);
- a synchronised batchnorm's (netdsl.ir.ops.norm_sync): its local moments, its output
  from the whole batch's, its local backward sums (a block a channel each), and Chan's
  combination of the parts' moments (a thread a channel);
- batchnorm's input gradient (of any count of values a channel, a synchronised one's
  too) and the SGD and Adam updates: one element-wise pass each
  (the optimizers read the learning rate and the step counter on the device: a host
  scalar would wait for the GPU before every parameter's update);
- a group of parameters' updates (netdsl.passes.optimizer.group_updates): one launch for
  all of them, over a table of their addresses.

The methods have the NumPy backend's fused kernels' signatures (netdsl.backends.numpy_fused,
whose Numba loops define the arithmetic: z = (x - mean) * (inv * w) + b in the data's
dtype, the relu mask z > 0 and z < cap, the same order of operations in dx and in SGD);
`threads` is accepted and ignored. Kernels compile on first use per dtype (NVRTC; CuPy
keeps the binaries in its on-disk cache). CuPy reaches this module only as the object the
CuPy backend hands it; it imports nothing from cupy itself.
"""
from __future__ import annotations

import numpy as np

_SOURCE = r"""
typedef TYPE T;
#define BLOCK 256

__device__ double block_sum(double v, double* sh) {
    // the sum over the block's BLOCK threads, returned to every thread
    int t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (int s = BLOCK / 2; s > 0; s >>= 1) {
        if (t < s) sh[t] += sh[t + s];
        __syncthreads();
    }
    double r = sh[0];
    __syncthreads();
    return r;
}

// element k (0 <= k < n * p) of channel ch of (n, c, p) data: image k / p, position k % p
__device__ long long at(long long k, int c, int p, int ch) {
    long long i = k / p;
    return (i * c + ch) * p + (k - i * p);
}

// channel ch's mean and biased variance: two passes in float64, the block's threads
// striding over the channel's m values
__device__ void moments_of(const T* x, int c, int p, long long m, int ch, double* sh,
                           double* mean, double* var) {
    double s = 0.0;
    for (long long j = threadIdx.x; j < m; j += BLOCK) s += (double)x[at(j, c, p, ch)];
    double mu = block_sum(s, sh) / (double)m;
    s = 0.0;
    for (long long j = threadIdx.x; j < m; j += BLOCK) {
        double d = (double)x[at(j, c, p, ch)] - mu;
        s += d * d;
    }
    *mean = mu;
    *var = block_sum(s, sh) / (double)m;
}

// a channel's statistics and the affine step's constants in the data's dtype:
// z = (x - mt) * scale + shift, as the forward and backward compute it
struct Channel {
    double mean, var;
    T mt, it, scale, shift, top;
};

__device__ Channel affine(double mean, double var, const T* w, const T* b, int ch,
                          double eps, double cap) {
    Channel k;
    k.mean = mean;
    k.var = var;
    k.mt = (T)mean;
    k.it = (T)(1.0 / sqrt(var + eps));
    k.scale = k.it * w[ch];
    k.shift = b[ch];
    k.top = (T)cap;
    return k;
}

// channel ch's batch statistics and constants (a block a channel)
__device__ Channel channel(const T* x, const T* w, const T* b, int c, int p, long long m,
                           int ch, double eps, double cap, double* sh) {
    double mean, var;
    moments_of(x, c, p, m, ch, sh, &mean, &var);
    return affine(mean, var, w, b, ch, eps, cap);
}

// ... from given float64 moments (mom[ch] the mean, mom[c + ch] the biased variance)
__device__ Channel given(const double* mom, const T* w, const T* b, int c, int ch,
                         double eps, double cap) {
    return affine(mom[ch], mom[c + ch], w, b, ch, eps, cap);
}

__device__ bool passes(T z, int capped, T top) {
    return z > (T)0 && (!capped || z < top);
}

// channel ch's output: z, then the relu (capped) where `relu`
__device__ void normalise(const T* x, T* y, Channel k, int c, int p, long long m, int ch,
                          int relu, int capped) {
    for (long long j = threadIdx.x; j < m; j += BLOCK) {
        long long a = at(j, c, p, ch);
        T z = (x[a] - k.mt) * k.scale + k.shift;
        if (relu) {
            if (!(z > (T)0)) z = (z == z) ? (T)0 : z;  // NaN stays NaN
            if (capped && z > k.top) z = k.top;
        }
        y[a] = z;
    }
}

// channel ch's backward sums: out[ch] = sum(g * x_hat), out[c + ch] = sum(g), g = dy times
// the relu mask where `relu` (recomputed from z as the forward computes it)
__device__ void grad_sums(const T* dy, const T* x, T* out, Channel k, int c, int p,
                          long long m, int ch, int relu, int capped, double* sh) {
    double sg = 0.0, sgd = 0.0;
    for (long long j = threadIdx.x; j < m; j += BLOCK) {
        long long a = at(j, c, p, ch);
        T d = x[a] - k.mt;
        T g = dy[a];
        if (relu && !passes(d * k.scale + k.shift, capped, k.top)) g = (T)0;
        sg += (double)g;
        sgd += (double)(g * d);
    }
    sg = block_sum(sg, sh);
    sgd = block_sum(sgd, sh);
    if (threadIdx.x == 0) {
        out[ch] = (T)(sgd * (double)k.it);
        out[c + ch] = (T)sg;
    }
}

extern "C" __global__ void bn_forward(const T* x, const T* w, const T* b, T* y,
                                      double* mom, int n, int c, int p, double eps,
                                      int relu, int capped, double cap) {
    __shared__ double sh[BLOCK];
    int ch = blockIdx.x;
    long long m = (long long)n * p;
    Channel k = channel(x, w, b, c, p, m, ch, eps, cap, sh);
    normalise(x, y, k, c, p, m, ch, relu, capped);
    if (threadIdx.x == 0) {
        mom[ch] = k.mean;
        mom[c + ch] = k.var;
    }
}

// a synchronised batchnorm's three passes: its local moments, the output with the whole
// batch's (bn_combine's), and its local backward sums (added over the devices)
extern "C" __global__ void bn_moments(const T* x, double* mom, int n, int c, int p) {
    __shared__ double sh[BLOCK];
    int ch = blockIdx.x;
    double mean, var;
    moments_of(x, c, p, (long long)n * p, ch, sh, &mean, &var);
    if (threadIdx.x == 0) {
        mom[ch] = mean;
        mom[c + ch] = var;
    }
}

extern "C" __global__ void bn_normalise(const T* x, const double* mom, const T* w,
                                        const T* b, T* y, int n, int c, int p, double eps,
                                        int relu, int capped, double cap) {
    int ch = blockIdx.x;
    normalise(x, y, given(mom, w, b, c, ch, eps, cap), c, p, (long long)n * p, ch, relu,
              capped);
}

extern "C" __global__ void bn_grad_sums(const T* dy, const T* x, const double* mom,
                                        const T* w, const T* b, T* out, int n, int c, int p,
                                        double eps, int relu, int capped, double cap) {
    __shared__ double sh[BLOCK];
    int ch = blockIdx.x;
    grad_sums(dy, x, out, given(mom, w, b, c, ch, eps, cap), c, p, (long long)n * p, ch,
              relu, capped, sh);
}

// the whole batch's mean and biased variance from its parts' (rows 2k and 2k + 1 of
// parts: part k's, counts[k] values a channel): Chan's combination in float64, a thread a
// channel (element-wise kernels stride over the grid: they hold for any launch shape)
extern "C" __global__ void bn_combine(const T* parts, const double* counts, T* out, int k,
                                      int c) {
    for (int ch = blockIdx.x * blockDim.x + threadIdx.x; ch < c;
         ch += gridDim.x * blockDim.x) {
        double total = 0.0, s = 0.0, v = 0.0;
        for (int q = 0; q < k; q++) {
            total += counts[q];
            s += counts[q] * (double)parts[2 * q * c + ch];
        }
        double mean = s / total;
        for (int q = 0; q < k; q++) {
            double d = (double)parts[2 * q * c + ch] - mean;
            v += counts[q] * ((double)parts[(2 * q + 1) * c + ch] + d * d);
        }
        out[ch] = (T)mean;
        out[c + ch] = (T)(v / total);
    }
}

extern "C" __global__ void bn_running(T* rm, T* rv, const double* mom, int c,
                                      double momentum, double unbias) {
    for (int ch = blockIdx.x * blockDim.x + threadIdx.x; ch < c;
         ch += gridDim.x * blockDim.x) {
        rm[ch] = rm[ch] * (T)(1.0 - momentum) + (T)(momentum * mom[ch]);
        rv[ch] = rv[ch] * (T)(1.0 - momentum) + (T)(momentum * unbias * mom[c + ch]);
    }
}

extern "C" __global__ void bn_grad_stats(const T* dy, const T* x, const T* w, const T* b,
                                         T* out, int n, int c, int p, double eps, int relu,
                                         int capped, double cap) {
    __shared__ double sh[BLOCK];
    int ch = blockIdx.x;
    long long m = (long long)n * p;
    Channel k = channel(x, w, b, c, p, m, ch, eps, cap, sh);
    grad_sums(dy, x, out, k, c, p, m, ch, relu, capped, sh);
    if (threadIdx.x == 0) {
        out[2 * c + ch] = k.mt;
        out[3 * c + ch] = k.it;
    }
}

// dx from the sums (st's rows: sum(g * x_hat), sum(g), the mean, 1/std) of m values a
// channel (a synchronised batchnorm's count every device's; n * p otherwise)
extern "C" __global__ void bn_grad_input(const T* dy, const T* x, const T* st, const T* w,
                                         const T* b, const T* acc, T* dx, int n, int c,
                                         int p, int relu, int capped, double cap,
                                         int accumulate, double m) {
    long long total = (long long)n * c * p;
    T top = (T)cap;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total;
         k += (long long)gridDim.x * blockDim.x) {
        int ch = (int)((k / p) % c);
        double gw = (double)st[ch], sg = (double)st[c + ch];
        T mt = st[2 * c + ch], it = st[3 * c + ch];
        T scale = it * w[ch], shift = b[ch];
        T k_dev = (T)(-(double)it * gw / m), k_sum = (T)(-sg / m);
        T d = x[k] - mt;
        T g = dy[k];
        if (relu && !passes(d * scale + shift, capped, top)) g = (T)0;
        T v = (d * k_dev + k_sum + g) * scale;
        if (accumulate) v += acc[k];
        dx[k] = v;
    }
}

// one parameter element's SGD and Adam steps (the single and the grouped kernels share them)
__device__ void sgd_step(T* p, const T* g, T* buf, long long i, T rate, T momentum,
                         T weight_decay, int nesterov) {
    T gi = g[i];
    if (weight_decay != (T)0) gi = gi + weight_decay * p[i];
    if (momentum != (T)0) {
        T bb = buf[i] * momentum + gi;
        buf[i] = bb;
        gi = nesterov ? gi + momentum * bb : bb;
    }
    p[i] = p[i] - rate * gi;
}

struct AdamScalars {
    T rate, step_size, bc2_sqrt;
};

__device__ AdamScalars adam_scalars(const T* lr, const long long* step, T b1, T b2) {
    AdamScalars s;
    T t = (T)step[0];
    s.rate = lr[0];
    s.step_size = s.rate / ((T)1 - pow(b1, t));
    s.bc2_sqrt = sqrt((T)1 - pow(b2, t));
    return s;
}

__device__ void adam_step(T* p, const T* g, T* m, T* v, long long i, AdamScalars s, T b1,
                          T b2, T eps, T weight_decay, int decoupled) {
    T pi = p[i], gi = g[i];
    if (weight_decay != (T)0) {
        if (decoupled) pi = pi * ((T)1 - s.rate * weight_decay);
        else gi = gi + weight_decay * pi;
    }
    T mi = m[i] * b1 + ((T)1 - b1) * gi;
    T vi = v[i] * b2 + ((T)1 - b2) * (gi * gi);
    m[i] = mi;
    v[i] = vi;
    p[i] = pi - s.step_size * (mi / (sqrt(vi) / s.bc2_sqrt + eps));
}

extern "C" __global__ void sgd_update(T* p, const T* g, T* buf, const T* lr, long long size,
                                      T momentum, T weight_decay, int nesterov) {
    T rate = lr[0];
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < size;
         i += (long long)gridDim.x * blockDim.x)
        sgd_step(p, g, buf, i, rate, momentum, weight_decay, nesterov);
}

extern "C" __global__ void adam_update(T* p, const T* g, T* m, T* v, const T* lr,
                                       const long long* step, long long size, T b1, T b2,
                                       T eps, T weight_decay, int decoupled) {
    AdamScalars s = adam_scalars(lr, step, b1, b2);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < size;
         i += (long long)gridDim.x * blockDim.x)
        adam_step(p, g, m, v, i, s, b1, b2, eps, weight_decay, decoupled);
}

// A group of parameters in one launch. `table` holds, for `count` tensors, `arrays` rows
// of their addresses (parameter, gradient, then the state) and a last row of the ends of
// each in the group's elements (inclusive prefix sums of the sizes): tensor k is elements
// [ends[k-1], ends[k]). A thread finds the tensor of its first element by bisection and
// then moves forward with its grid-stride loop.
__device__ int tensor_of(const long long* ends, int count, long long e) {
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (ends[mid] > e) hi = mid; else lo = mid + 1;
    }
    return lo;
}

#define GROUP_LOOP(arrays, BODY)                                                          \
    const long long* ends = table + (long long)(arrays) * count;                          \
    long long total = ends[count - 1];                                                    \
    long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;                       \
    int k = e < total ? tensor_of(ends, count, e) : 0;                                    \
    for (; e < total; e += (long long)gridDim.x * blockDim.x) {                           \
        while (e >= ends[k]) k++;                                                         \
        long long i = e - (k ? ends[k - 1] : 0);                                          \
        BODY;                                                                             \
    }

#define AT(row, type) ((type)table[(long long)(row) * count + k])

extern "C" __global__ void sgd_update_many(const long long* table, int count, int arrays,
                                           const T* lr, T momentum, T weight_decay,
                                           int nesterov) {
    T rate = lr[0];
    GROUP_LOOP(arrays, sgd_step(AT(0, T*), AT(1, const T*), AT(arrays - 1, T*), i, rate,
                                momentum, weight_decay, nesterov))
}

extern "C" __global__ void adam_update_many(const long long* table, int count,
                                            const T* lr, const long long* step, T b1, T b2,
                                            T eps, T weight_decay, int decoupled) {
    AdamScalars s = adam_scalars(lr, step, b1, b2);
    GROUP_LOOP(4, adam_step(AT(0, T*), AT(1, const T*), AT(2, T*), AT(3, T*), i, s, b1, b2,
                            eps, weight_decay, decoupled))
}
"""

_BLOCK = 256  # the source's BLOCK: threads a block (a power of two)
_CTYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}


def _relu_args(relu, cap):
    """The kernels' relu, capped and cap arguments (cap: inf for none, as the Numba loops')."""
    return (np.int32(relu), np.int32(cap < np.inf),
            np.float64(min(cap, np.finfo(np.float64).max)))


class CudaKernels:
    """The CuPy backend's fused kernels (module docstring); `cupy` is the module."""

    threads = 0  # the Numba kernels' thread count: nothing to set on a GPU
    # optim.py passes the learning rate as the device array it is (a host scalar would
    # read it back from the GPU before every update)
    scalars_on_device = True

    def __init__(self, cupy):
        self._cupy = cupy
        self._modules: dict[np.dtype, object] = {}
        # (name, dtype) -> kernel: RawModule.get_function looks the name up in the module
        # at every call, and a step makes a call per launch
        self._functions: dict[tuple[str, np.dtype], object] = {}
        self._uploads: dict[tuple, object] = {}  # small host arrays on the device (_upload)

    def accepts(self, *arrays) -> bool:
        cp = self._cupy
        return all(isinstance(a, cp.ndarray) and a.dtype in _CTYPES
                   and a.flags.c_contiguous and a.size > 0 for a in arrays)

    def _kernel(self, name: str, dtype):
        fn = self._functions.get((name, dtype))
        if fn is None:
            dt = np.dtype(dtype)
            mod = self._modules.get(dt)
            if mod is None:
                mod = self._cupy.RawModule(code=_SOURCE.replace("TYPE", _CTYPES[dt], 1),
                                           options=("--std=c++14",))
                self._modules[dt] = mod
            fn = self._functions[(name, dtype)] = mod.get_function(name)
        return fn

    @staticmethod
    def _grid(total: int) -> int:
        return max(1, min((total + _BLOCK - 1) // _BLOCK, 65535))

    # -- batchnorm -----------------------------------------------------------------------
    def _per_channel(self, name, x3, arrays, eps, relu, cap):
        """A launch of one block a channel of the (N, C, P) x3."""
        n, c, p = x3.shape
        self._kernel(name, x3.dtype)(
            (c,), (_BLOCK,), (*arrays, np.int32(n), np.int32(c), np.int32(p),
                              np.float64(eps), *_relu_args(relu, cap)))

    def bn_forward(self, x3, w, b, eps, relu, cap, y3, moments, threads=0):
        self._per_channel("bn_forward", x3, (x3, w, b, y3, moments), eps, relu, cap)

    def bn_moments(self, x3, moments, threads=0):
        """The mean and biased variance (float64 rows of `moments`) of each channel."""
        n, c, p = x3.shape
        self._kernel("bn_moments", x3.dtype)(
            (c,), (_BLOCK,), (x3, moments, np.int32(n), np.int32(c), np.int32(p)))

    def bn_normalise(self, x3, moments, w, b, eps, relu, cap, y3, threads=0):
        """bn_forward's output with the given float64 moments."""
        self._per_channel("bn_normalise", x3, (x3, moments, w, b, y3), eps, relu, cap)

    def bn_grad_sums(self, dy3, x3, moments, w, b, eps, relu, cap, out, threads=0):
        """bn_grad_stats' first two rows with the given float64 moments."""
        self._per_channel("bn_grad_sums", x3, (dy3, x3, moments, w, b, out), eps, relu, cap)

    def bn_combine(self, parts, counts, out):
        """The mean and biased variance (out's rows) of a batch from its parts' (parts' row
        pairs; counts, a host array, the values a channel of each): Chan's combination.
        The counts go up once per distinct counts (a capture cannot record an upload)."""
        c = parts.shape[1]
        host = np.asarray(counts, dtype=np.float64)
        self._kernel("bn_combine", parts.dtype)(
            (self._grid(c),), (_BLOCK,), (parts, self._upload(("counts", *host.tolist()), host),
                                          out, np.int32(host.size), np.int32(c)))

    def bn_running(self, rm, rv, moments, momentum, count):
        """The running statistics' update in place (PyTorch's: the unbiased variance)."""
        c = rm.shape[0]
        self._kernel("bn_running", rm.dtype)(
            (self._grid(c),), (_BLOCK,), (rm, rv, moments, np.int32(c), np.float64(momentum),
                                          np.float64(count / max(count - 1, 1))))

    def bn_grad_stats(self, dy3, x3, w, b, eps, relu, cap, out, threads=0):
        self._per_channel("bn_grad_stats", x3, (dy3, x3, w, b, out), eps, relu, cap)

    def bn_grad_input(self, dy3, x3, st, w, b, relu, cap, acc3, accumulate, dx3, threads=0,
                      count=0):
        """dx from st's rows of `count` values a channel (0: x3's own, n * p)."""
        n, c, p = x3.shape
        self._kernel("bn_grad_input", x3.dtype)(
            (self._grid(n * c * p),), (_BLOCK,),
            (dy3, x3, st, w, b, acc3, dx3, np.int32(n), np.int32(c), np.int32(p),
             *_relu_args(relu, cap), np.int32(accumulate),
             np.float64(count if count > 0 else n * p)))

    # -- optimizer -----------------------------------------------------------------------
    def sgd_update(self, p, g, buf, lr, momentum, weight_decay, nesterov):
        """In place on 1-d p (and buf with momentum); lr a one-element device array of p's
        dtype, the other scalars host numbers."""
        t = p.dtype.type
        self._kernel("sgd_update", p.dtype)(
            (self._grid(p.size),), (_BLOCK,),
            (p, g, buf, lr, np.int64(p.size), t(momentum), t(weight_decay),
             np.int32(nesterov)))

    def adam_update_device(self, p, g, m, v, lr, step, b1, b2, eps, weight_decay, decoupled):
        """Adam / AdamW in place on 1-d p, m and v, as the NumPy kernel computes it; lr (p's
        dtype) and the step counter (int64, already incremented) stay one-element device
        arrays, the bias corrections are computed from them on the device."""
        t = p.dtype.type
        self._kernel("adam_update", p.dtype)(
            (self._grid(p.size),), (_BLOCK,),
            (p, g, m, v, lr, step, np.int64(p.size), t(b1), t(b2), t(eps), t(weight_decay),
             np.int32(decoupled)))

    # -- a group of parameters, one launch ------------------------------------------------
    def _upload(self, key: tuple, host):
        """`host` as a device array, kept for the last few keys seen (with an arena the
        grouped updates' addresses repeat every step, so their table goes up once; a
        replayed CUDA graph needs that: a host copy cannot be recorded)."""
        dev = self._uploads.get(key)
        if dev is None:
            dev = self._cupy.asarray(host)
            if len(self._uploads) >= 16:
                self._uploads.pop(next(iter(self._uploads)))
            self._uploads[key] = dev
        return dev

    def _table(self, rows):
        """The grouped kernels' table (the source's GROUP_LOOP): each row's addresses, then
        the ends of the tensors, as one int64 device array."""
        sizes = np.cumsum([x.size for x in rows[0]], dtype=np.int64)
        key = (*(x.data.ptr for r in rows for x in r), *sizes.tolist())
        return self._upload(("table", *key), np.array(key, dtype=np.int64)), int(sizes[-1])

    def sgd_update_many(self, ps, gs, bufs, lr, momentum, weight_decay, nesterov):
        """sgd_update on each (p, g, buf), 1-d, in one launch (bufs is ps without momentum:
        then not read)."""
        t = ps[0].dtype.type
        rows = (ps, gs, bufs) if bufs is not ps else (ps, gs)
        table, total = self._table(rows)
        self._kernel("sgd_update_many", ps[0].dtype)(
            (self._grid(total),), (_BLOCK,),
            (table, np.int32(len(ps)), np.int32(len(rows)), lr, t(momentum), t(weight_decay),
             np.int32(nesterov)))

    def adam_update_many_device(self, ps, gs, ms, vs, lr, step, b1, b2, eps, weight_decay,
                                decoupled):
        """adam_update_device on each (p, g, m, v), 1-d, in one launch."""
        t = ps[0].dtype.type
        table, total = self._table((ps, gs, ms, vs))
        self._kernel("adam_update_many", ps[0].dtype)(
            (self._grid(total),), (_BLOCK,),
            (table, np.int32(len(ps)), lr, step, t(b1), t(b2), t(eps), t(weight_decay),
             np.int32(decoupled)))

    def __repr__(self) -> str:
        return "CudaKernels(batchnorm, synchronised batchnorm, sgd, adam)"
