"""cuDNN's convolutions, called through its C library with ctypes.

CuPy 14 dropped its cuDNN module, and cuDNN's Python frontend is a separate install; the
C library is on most GPU machines already (PyTorch's wheels bring it as nvidia-cudnn-*).
This module finds and loads it, declares the few functions a convolution needs (the
"legacy" API, in cuDNN 8 and 9) and runs the three convolutions of a training step -
forward, data gradient, filter gradient - on raw device pointers. It imports no GPU
library: `Convolutions` takes the array module's pointer, stream and allocation functions
(the CuPy backend gives CuPy's; the tests give NumPy's, against a stand-in library built
from C), so the calls, their argument order and the descriptors are tested without a GPU.

Arithmetic: every float32 or float64 convolution is set to CUDNN_FMA_MATH, so float32
stays float32 (cuDNN's default math lets Ampere and later GPUs use TF32 tensor cores, which
round inputs to 10 bits of mantissa; PyTorch's default does). A float16 one (mixed
precision) takes half data with float32 as its convolution's compute type (products
accumulated in f32, cuDNN's "pseudo-half" configuration) and tensor-op math: the tensor
cores, which is what f16 is for; its alpha and beta are floats. An algorithm is chosen
once per geometry, the fastest of cuDNN's heuristics whose workspace fits the bytes the
caller allows (the node's workspace rule, so a storage plan stays exact), or none: the
caller then takes its own path.
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys
from ctypes import POINTER, c_char_p, c_double, c_float, c_int, c_size_t, c_void_p
from dataclasses import dataclass

from netdsl.config import env_switch

ENV = "NETDSL_CUDNN"  # frontend, ctypes or off (0): netdsl.backends.cudnn_frontend.mode
LIBRARY_ENV = "NETDSL_CUDNN_LIBRARY"  # a libcudnn to load instead of searching

# cudnn_graph.h / cudnn_cnn.h constants (stable since cuDNN 7)
# CUDNN_DATA_FLOAT, CUDNN_DATA_DOUBLE, CUDNN_DATA_HALF
_DATA = {"float32": 0, "float64": 1, "float16": 2}
_NCHW = 0  # CUDNN_TENSOR_NCHW
_CROSS_CORRELATION = 1  # CUDNN_CROSS_CORRELATION (what deep learning calls convolution)
_DEFAULT_MATH, _TENSOR_OP_MATH, _FMA_MATH = 0, 1, 3  # cudnnMathType_t
_SUCCESS = 0

FORWARD, DATA, FILTER = "forward", "data", "filter"


class CudnnError(RuntimeError):
    """A cuDNN call failed, or no usable cuDNN library was found."""


class _Perf(ctypes.Structure):
    # cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t: one layout for the three
    _fields_ = [("algo", c_int), ("status", c_int), ("time", c_float), ("memory", c_size_t),
                ("determinism", c_int), ("mathType", c_int), ("reserved", c_int * 3)]


_P = c_void_p
_PP = POINTER(c_void_p)
_SIGNATURES: dict[str, tuple] = {
    "cudnnGetVersion": (c_size_t, []),
    "cudnnGetErrorString": (c_char_p, [c_int]),
    "cudnnCreate": (c_int, [_PP]),
    "cudnnSetStream": (c_int, [_P, _P]),
    "cudnnCreateTensorDescriptor": (c_int, [_PP]),
    # (desc, format, dataType, n, c, h, w)
    "cudnnSetTensor4dDescriptor": (c_int, [_P, c_int, c_int, c_int, c_int, c_int, c_int]),
    "cudnnCreateFilterDescriptor": (c_int, [_PP]),
    # (desc, dataType, format, k, c, h, w): the data type first, unlike the tensor's
    "cudnnSetFilter4dDescriptor": (c_int, [_P, c_int, c_int, c_int, c_int, c_int, c_int]),
    "cudnnCreateConvolutionDescriptor": (c_int, [_PP]),
    # (desc, pad_h, pad_w, u, v, dilation_h, dilation_w, mode, computeType)
    "cudnnSetConvolution2dDescriptor": (c_int, [_P, c_int, c_int, c_int, c_int, c_int,
                                                c_int, c_int, c_int]),
    "cudnnSetConvolutionGroupCount": (c_int, [_P, c_int]),
    "cudnnSetConvolutionMathType": (c_int, [_P, c_int]),
    "cudnnGetConvolutionForwardAlgorithmMaxCount": (c_int, [_P, POINTER(c_int)]),
    "cudnnGetConvolutionBackwardDataAlgorithmMaxCount": (c_int, [_P, POINTER(c_int)]),
    "cudnnGetConvolutionBackwardFilterAlgorithmMaxCount": (c_int, [_P, POINTER(c_int)]),
    # (handle, xDesc, wDesc, convDesc, yDesc, requested, *returned, *perf)
    "cudnnGetConvolutionForwardAlgorithm_v7": (c_int, [_P, _P, _P, _P, _P, c_int,
                                                       POINTER(c_int), POINTER(_Perf)]),
    # (handle, wDesc, dyDesc, convDesc, dxDesc, requested, *returned, *perf)
    "cudnnGetConvolutionBackwardDataAlgorithm_v7": (c_int, [_P, _P, _P, _P, _P, c_int,
                                                            POINTER(c_int), POINTER(_Perf)]),
    # (handle, xDesc, dyDesc, convDesc, dwDesc, requested, *returned, *perf)
    "cudnnGetConvolutionBackwardFilterAlgorithm_v7": (c_int, [_P, _P, _P, _P, _P, c_int,
                                                              POINTER(c_int), POINTER(_Perf)]),
    # workspace sizes: (handle, the same four descriptors in the same order, algo, *size)
    "cudnnGetConvolutionForwardWorkspaceSize": (c_int, [_P, _P, _P, _P, _P, c_int,
                                                        POINTER(c_size_t)]),
    "cudnnGetConvolutionBackwardDataWorkspaceSize": (c_int, [_P, _P, _P, _P, _P, c_int,
                                                             POINTER(c_size_t)]),
    "cudnnGetConvolutionBackwardFilterWorkspaceSize": (c_int, [_P, _P, _P, _P, _P, c_int,
                                                               POINTER(c_size_t)]),
    # (handle, *alpha, xDesc, x, wDesc, w, convDesc, algo, ws, wsBytes, *beta, yDesc, y)
    "cudnnConvolutionForward": (c_int, [_P, _P, _P, _P, _P, _P, _P, c_int, _P, c_size_t,
                                        _P, _P, _P]),
    # (handle, *alpha, wDesc, w, dyDesc, dy, convDesc, algo, ws, wsBytes, *beta, dxDesc, dx)
    "cudnnConvolutionBackwardData": (c_int, [_P, _P, _P, _P, _P, _P, _P, c_int, _P, c_size_t,
                                             _P, _P, _P]),
    # (handle, *alpha, xDesc, x, dyDesc, dy, convDesc, algo, ws, wsBytes, *beta, dwDesc, dw)
    "cudnnConvolutionBackwardFilter": (c_int, [_P, _P, _P, _P, _P, _P, _P, c_int, _P,
                                               c_size_t, _P, _P, _P]),
}


def candidates() -> list[str]:
    """Where a libcudnn may be, most specific first: $NETDSL_CUDNN_LIBRARY, the
    nvidia-cudnn-* wheels' folders (which PyTorch's CUDA wheels install) and torch/lib on
    sys.path, then the loader's own search (LD_LIBRARY_PATH, the system's folders)."""
    env = os.environ.get(LIBRARY_ENV, "").strip()
    if env:
        return [env]
    found = []
    for root in sys.path:
        # nvidia/cudnn/lib (nvidia-cudnn-cu12), or a CUDA 13 wheel's nvidia/cu13/lib
        for pattern in ("nvidia/*/lib/libcudnn.so.*", "torch/lib/libcudnn.so.*"):
            found += sorted(glob.glob(os.path.join(root or ".", pattern)), reverse=True)
    return found + ["libcudnn.so.9", "libcudnn.so.8", "libcudnn.so"]


def load(paths: list[str] | None = None) -> Library:
    """The first of `paths` (default: candidates()) that loads as a cuDNN library."""
    errors = []
    for path in candidates() if paths is None else paths:
        try:
            return Library(path)
        except (OSError, AttributeError) as e:
            errors.append(f"{path}: {e}")
    raise CudnnError("no cuDNN library could be loaded (tried " + "; ".join(errors[-4:])
                     + f"). Install it (e.g. `pip install nvidia-cudnn-cu12`) or set "
                       f"{LIBRARY_ENV} to its path")


def open_convolutions(xp, pointer, stream, device, to_device, to_host
                      ) -> tuple[Convolutions | None, str]:
    """(cuDNN's convolutions on `xp`'s arrays, what was loaded), or (None, why not): off
    by NETDSL_CUDNN=0, no library loads, or the library failed `self_check`. The
    arguments are Convolutions', and the two copies self_check makes."""
    if not env_switch(ENV, True):
        return None, f"off ({ENV}=0)"
    try:
        lib = load()
        conv = Convolutions(lib, xp, pointer, stream, device)
        self_check(conv, to_device, to_host)
    except Exception as e:  # any failure: the caller's own path, and why
        return None, f"not used: {e}"
    return conv, f"cuDNN {lib.version_string} ({lib.path})"


class Library:
    """A loaded libcudnn with the functions above declared; one handle per device."""

    def __init__(self, path: str):
        # global, as PyTorch loads it: cuDNN 9's libcudnn.so is a shim that loads its
        # sub-libraries (libcudnn_cnn, libcudnn_ops...) from its own folder at run time
        self.path = path
        self._lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        for name, (res, args) in _SIGNATURES.items():
            fn = getattr(self._lib, name)  # AttributeError: not a cuDNN 8/9 library
            fn.restype, fn.argtypes = res, args
        self.version = int(self._lib.cudnnGetVersion())
        self._handles: dict[int, c_void_p] = {}

    @property
    def version_string(self) -> str:
        v = self.version  # 8.x: M*1000 + m*100 + p; 9.x: M*10000 + m*100 + p
        major, rest = (v // 10000, v % 10000) if v >= 90000 else (v // 1000, v % 1000)
        return f"{major}.{rest // 100}.{rest % 100}"

    def status(self, name: str, *args) -> int:
        """The status a call returns (0: success)."""
        return int(getattr(self._lib, name)(*args))

    def call(self, name: str, *args) -> None:
        status = self.status(name, *args)
        if status != _SUCCESS:
            raise CudnnError(f"{name} failed: {self.error_string(status)} (status {status})")

    def error_string(self, status: int) -> str:
        s = self._lib.cudnnGetErrorString(status)
        return s.decode() if s else "unknown error"

    def handle(self, device: int, stream: int) -> c_void_p:
        """This device's handle, its work queued on `stream` (a cudaStream_t as an int)."""
        h = self._handles.get(device)
        if h is None:
            h = c_void_p()
            self.call("cudnnCreate", ctypes.byref(h))
            self._handles[device] = h
        self.call("cudnnSetStream", h, c_void_p(stream or None))
        return h

    def _new(self, what: str) -> c_void_p:
        d = c_void_p()
        self.call(f"cudnnCreate{what}Descriptor", ctypes.byref(d))
        return d

    def geometry(self, dtype: str, x: tuple, w: tuple, y: tuple, pads, strides, dilations,
                 groups: int) -> Geometry:
        """The descriptors of one convolution (shapes NCHW, weight [O, C/g, kh, kw])."""
        dt = _DATA[dtype]
        half = dtype == "float16"  # (module docstring: f32 accumulation, tensor cores)
        xd, wd, yd = self._new("Tensor"), self._new("Filter"), self._new("Tensor")
        self.call("cudnnSetTensor4dDescriptor", xd, _NCHW, dt, *map(int, x))
        self.call("cudnnSetFilter4dDescriptor", wd, dt, _NCHW, *map(int, w))
        self.call("cudnnSetTensor4dDescriptor", yd, _NCHW, dt, *map(int, y))
        cd = self._new("Convolution")
        self.call("cudnnSetConvolution2dDescriptor", cd, *map(int, pads), *map(int, strides),
                  *map(int, dilations), _CROSS_CORRELATION, _DATA["float32"] if half else dt)
        self.call("cudnnSetConvolutionGroupCount", cd, int(groups))
        self.call("cudnnSetConvolutionMathType", cd, _TENSOR_OP_MATH if half else _FMA_MATH)
        return Geometry(self, dtype, xd, wd, yd, cd)


# per kind: the name in cuDNN's functions, and the descriptors of its two operands and its
# result, in the order both the algorithm queries and the convolutions take them (with the
# convolution's descriptor between operands and result in the queries)
_KINDS = {
    FORWARD: ("Forward", lambda g: (g.x, g.w, g.y)),  # (x, w) -> y
    DATA: ("BackwardData", lambda g: (g.w, g.y, g.x)),  # (w, dy) -> dx
    FILTER: ("BackwardFilter", lambda g: (g.x, g.y, g.w)),  # (x, dy) -> dw
}


@dataclass
class Geometry:
    """One convolution's descriptors and, per kind and workspace limit, its algorithm."""

    lib: Library
    dtype: str
    x: c_void_p
    w: c_void_p
    y: c_void_p
    conv: c_void_p

    def __post_init__(self):
        self._algos: dict[tuple[str, int], tuple[int, int] | None] = {}

    def algorithm(self, kind: str, handle, limit: int) -> tuple[int, int] | None:
        """(algo, workspace bytes) for `kind`: the first of cuDNN's heuristic ranking that
        runs in FMA math within `limit` bytes, or None if none does."""
        key = (kind, limit)
        if key not in self._algos:
            self._algos[key] = self._choose(kind, handle, limit)
        return self._algos[key]

    def _choose(self, kind: str, handle, limit: int) -> tuple[int, int] | None:
        name, descs = _KINDS[kind]
        a, b, out = descs(self)
        count = c_int()
        self.lib.call(f"cudnnGetConvolution{name}AlgorithmMaxCount", handle,
                      ctypes.byref(count))
        n = max(int(count.value), 1) * 2  # an entry per algorithm and math type
        perf, got = (_Perf * n)(), c_int()
        self.lib.call(f"cudnnGetConvolution{name}Algorithm_v7", handle, a, b, self.conv, out,
                      n, ctypes.byref(got), perf)
        for p in perf[:got.value]:
            if p.status != _SUCCESS or p.mathType not in (_DEFAULT_MATH, _FMA_MATH):
                continue
            size = c_size_t()
            # the workspace of the algorithm in FMA math (the descriptor's): an algorithm
            # that has no FMA form answers with an error here and is passed over
            st = self.lib.status(f"cudnnGetConvolution{name}WorkspaceSize", handle, a, b,
                                 self.conv, out, p.algo, ctypes.byref(size))
            if st == _SUCCESS and size.value <= limit:
                return int(p.algo), int(size.value)
        return None


class ConvolutionCalls:
    """The three convolutions of a training step as conv2d's kernels call them, over a
    path's `_run(kind, dtype, (x, w, y shapes), geom, groups, a, b, out, limit)`: a and b
    the forward's (x, w), the data gradient's (w, dy), the filter gradient's (x, dy)."""

    def forward(self, x, w, geom, groups, out=None, limit=0):
        """y = conv2d(x, w) (cross-correlation), geom = (kh, kw, sh, sw, ph, pw, dh, dw)."""
        kh, kw, sh, sw, ph, pw, dh, dw = geom
        n, _, h, wd = x.shape
        ho = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
        wo = (wd + 2 * pw - dw * (kw - 1) - 1) // sw + 1
        y = (n, w.shape[0], ho, wo)
        return self._run(FORWARD, str(x.dtype), (tuple(x.shape), tuple(w.shape), y), geom,
                         groups, x, w, out, limit)

    def grad_input(self, dy, w, x_shape, geom, groups, out=None, limit=0):
        """dx of conv2d for an input of `x_shape`."""
        return self._run(DATA, str(dy.dtype), (tuple(x_shape), tuple(w.shape),
                                               tuple(dy.shape)), geom, groups, w, dy, out,
                         limit)

    def grad_weight(self, dy, x, w_shape, geom, groups, limit=0):
        """dw of conv2d for a weight of `w_shape`."""
        return self._run(FILTER, str(dy.dtype), (tuple(x.shape), tuple(w_shape),
                                                 tuple(dy.shape)), geom, groups, x, dy, None,
                         limit)


class Convolutions(ConvolutionCalls):
    """cuDNN's convolutions on arrays of one array module: `xp` (CuPy, or NumPy in the
    tests), `pointer(a)` an array's address, `stream()` the current stream, `device()`
    the current device. Each method returns None where cuDNN does not take the
    convolution - no algorithm fits the workspace limit, or its descriptors are refused
    (`declined` says why, per geometry) - and the caller runs its own path."""

    def __init__(self, lib: Library, xp, pointer, stream, device):
        self.lib, self.xp = lib, xp
        self._ptr, self._stream, self._device = pointer, stream, device
        self._geoms: dict[tuple, Geometry | None] = {}
        # why cuDNN left a convolution to the caller: by (dtype, shapes, geom, groups) for
        # refused descriptors, with the kind first where that kind found no algorithm
        self.declined: dict[tuple, str] = {}

    def _geometry(self, key: tuple) -> Geometry | None:
        if key not in self._geoms:
            dtype, (x, w, y), (kh, kw, sh, sw, ph, pw, dh, dw), groups = key
            try:
                self._geoms[key] = self.lib.geometry(dtype, x, w, y, (ph, pw), (sh, sw),
                                                     (dh, dw), groups)
            except CudnnError as e:  # e.g. more elements than its 4-d descriptors take
                self._geoms[key] = None
                self.declined[key] = str(e)
        return self._geoms[key]

    def _run(self, kind, dtype, shapes, geom, groups, a, b, out, limit):
        if dtype not in _DATA:  # (netdsl computes in float32, float64 or float16)
            return None
        key = (dtype, shapes, geom, groups)
        g = self._geometry(key)
        if g is None:
            return None
        h = self.lib.handle(self._device(), self._stream())
        chosen = g.algorithm(kind, h, max(int(limit), 0))
        if chosen is None:
            self.declined[(kind, *key)] = f"no algorithm within {limit} bytes of workspace"
            return None
        algo, ws_bytes = chosen
        xp = self.xp
        x_shape, w_shape, y_shape = shapes
        shape = {FORWARD: y_shape, DATA: x_shape, FILTER: w_shape}[kind]
        if out is None or tuple(out.shape) != shape or not out.flags.c_contiguous:
            out = xp.empty(shape, dtype)
        ws = xp.empty(ws_bytes, xp.uint8) if ws_bytes else None
        scalar = c_double if dtype == "float64" else c_float  # (half: float, as cuDNN wants)
        alpha, beta = scalar(1.0), scalar(0.0)
        a, b = xp.ascontiguousarray(a), xp.ascontiguousarray(b)
        name, descs = _KINDS[kind]
        da, db, dout = descs(g)
        self.lib.call(f"cudnnConvolution{name}", h, ctypes.byref(alpha),
                      da, c_void_p(self._ptr(a)), db, c_void_p(self._ptr(b)), g.conv, algo,
                      c_void_p(self._ptr(ws) if ws is not None else None), ws_bytes,
                      ctypes.byref(beta), dout, c_void_p(self._ptr(out)))
        return out

# self_check's cases: (x shape, out channels, geometry, groups, required). A plain 3x3
# convolution must run; a case cuDNN declines (no algorithm in FMA math, say) only leaves
# that kind of convolution to the caller, but a wrong result in any fails the library.
_CHECKS = (((2, 3, 6, 5), 4, (3, 3, 1, 1, 1, 1, 1, 1), 1, True),
           ((2, 4, 7, 6), 6, (3, 3, 2, 2, 1, 1, 1, 1), 2, False))


def self_check(conv: Convolutions, to_device, to_host) -> None:
    """Raise CudnnError unless the three convolutions give what their definitions give
    (computed here with NumPy) on small cases in float32 and float64 (a plain one, and a
    strided, grouped one): a library that loads but does not work (a mismatched build,
    TF32 forced on by NVIDIA_TF32_OVERRIDE) is caught before a step runs on it."""
    import numpy as np

    rng = np.random.default_rng(0)
    # (float32: FFT and Winograd algorithms err by about 1e-6 of the largest value; TF32
    # products, which FMA math rules out, by about 1e-3)
    for dtype, tol in (("float32", 1e-4), ("float64", 1e-12)):
        for shape, o, geom, groups, required in _CHECKS:
            kh, kw, sh, sw, ph, pw, dh, dw = geom
            x = rng.standard_normal(shape).astype(dtype)
            w = rng.standard_normal((o, shape[1] // groups, kh, kw)).astype(dtype)
            ho = (shape[2] + 2 * ph - dh * (kh - 1) - 1) // sh + 1
            wo = (shape[3] + 2 * pw - dw * (kw - 1) - 1) // sw + 1
            dy = rng.standard_normal((shape[0], o, ho, wo)).astype(dtype)
            ref = reference(x, w, dy, geom, groups)
            got = (conv.forward(to_device(x), to_device(w), geom, groups, limit=1 << 26),
                   conv.grad_input(to_device(dy), to_device(w), x.shape, geom, groups,
                                   limit=1 << 26),
                   conv.grad_weight(to_device(dy), to_device(x), w.shape, geom, groups,
                                    limit=1 << 26))
            for name, g, r in zip(("forward", "data gradient", "filter gradient"), got, ref):
                if g is None:
                    if required:
                        raise CudnnError(f"its {name} found no algorithm for a plain "
                                         f"{dtype} 3x3 convolution")
                    continue
                err = float(np.abs(to_host(g) - r).max() / max(np.abs(r).max(), 1e-30))
                if not err <= tol:  # (NaN fails too)
                    raise CudnnError(f"its {name} differs from the definition by {err:.1e} "
                                     f"(relative) in {dtype}, over the {tol:.0e} allowed")


def reference(x, w, dy, geom, groups):
    """(y, dx, dw): conv2d's forward and, for the output gradient dy, its input and weight
    gradients, by their definitions, a kernel tap at a time, in NumPy."""
    import numpy as np

    kh, kw, sh, sw, ph, pw, dh, dw = geom
    n, c, h, wd = x.shape
    o = w.shape[0]
    ho = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    wo = (wd + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    xp = np.zeros((n, c, h + 2 * ph, wd + 2 * pw), x.dtype)
    xp[:, :, ph:ph + h, pw:pw + wd] = x
    y = np.zeros((n, o, ho, wo), x.dtype)
    dxp, dwt = np.zeros_like(xp), np.zeros_like(w)
    cg, og = c // groups, o // groups
    for p in range(kh):
        for q in range(kw):
            win = (slice(None), slice(None), slice(p * dh, p * dh + sh * (ho - 1) + 1, sh),
                   slice(q * dw, q * dw + sw * (wo - 1) + 1, sw))
            xs = xp[win]
            for g in range(groups):
                ci, oi = slice(g * cg, (g + 1) * cg), slice(g * og, (g + 1) * og)
                y[:, oi] += np.einsum("nchw,oc->nohw", xs[:, ci], w[oi, :, p, q])
                dxp[win][:, ci] += np.einsum("nohw,oc->nchw", dy[:, oi], w[oi, :, p, q])
                dwt[oi, :, p, q] += np.einsum("nohw,nchw->oc", dy[:, oi], xs[:, ci])
    return y, dxp[:, :, ph:ph + h, pw:pw + wd], dwt
