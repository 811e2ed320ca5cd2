"""cuDNN's convolutions through NVIDIA's Python frontend (`nvidia-cudnn-frontend`, imported
as `cudnn`, here only and lazily): the same three convolutions and the same interface as
`netdsl.backends.cudnn.Convolutions` (the ctypes path), so the CuPy backend takes either.

Each convolution is described once per (kind, dtype, shapes, geometry, groups) - its
tensors in NCHW with their strides, its padding, stride and dilation - and built into a
cuDNN graph (`cudnn.pygraph`: validate, the heuristics' plans, the first that builds
within the workspace limit); the graph is cached by that description and executed with
CuPy's device pointers, on CuPy's current stream, with a workspace taken from CuPy's pool.
Arithmetic as on the ctypes path: float32 and float64 exclude the plans cuDNN notes as
using tensor cores (TF32 would round the inputs to 10 bits of mantissa); float16 computes
in float32 on the tensor cores.

NETDSL_CUDNN chooses: `frontend` (this module), `ctypes` (netdsl.backends.cudnn), `off` or
0 (neither: the columns' path); unset, this module where it imports and passes its check,
else the ctypes path. Both stay until a device run compares them (docs/gpu.md).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from netdsl.backends import cudnn as ctypes_path
from netdsl.backends.cudnn import DATA, ENV, FILTER, FORWARD, CudnnError

MODES = ("frontend", "ctypes", "off")  # NETDSL_CUDNN (ENV)
_DTYPES = {"float32": "FLOAT", "float64": "DOUBLE", "float16": "HALF"}  # cudnn.data_type
_HEURISTICS = ("A", "FALLBACK")  # cudnn.heur_mode, in the order tried


def mode() -> str:
    """NETDSL_CUDNN as one of MODES, or "auto" where it is unset (or 1, on, ...)."""
    v = os.environ.get(ENV, "").strip().lower()
    if v in ("0", "false", "no", "off"):
        return "off"
    if v in ("", "1", "true", "yes", "on", "auto"):
        return "auto"
    if v not in MODES:
        raise CudnnError(f"{ENV}={v!r}: give one of frontend, ctypes or off (or leave it "
                         "unset: the frontend where it imports, else ctypes)")
    return v


def _row_major(dims: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for d in reversed(dims):
        out.append(step)
        step *= d
    return tuple(reversed(out))


@dataclass(frozen=True)
class ConvGraph:
    """One convolution as cuDNN's graph takes it: its two inputs and its output as (role,
    dims, strides), each the frontend's keyword for it, and its parameters; the cache key."""

    kind: str
    dtype: str
    inputs: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]
    output: tuple[str, tuple[int, ...], tuple[int, ...]]
    pre_padding: tuple[int, int]
    post_padding: tuple[int, int]
    stride: tuple[int, int]
    dilation: tuple[int, int]

    @property
    def tensor_cores(self) -> bool:
        return self.dtype == "float16"

    @property
    def compute(self) -> str:
        return "DOUBLE" if self.dtype == "float64" else "FLOAT"


def describe(kind: str, dtype: str, shapes, geom, groups: int) -> ConvGraph:
    """The graph of convolution `kind` for x, w, y of `shapes` (NCHW, OIHW with I the
    channels of one group: cuDNN reads the groups from C / I), geom = (kh, kw, sh, sw, ph,
    pw, dh, dw) as netdsl's kernels give it."""
    x, w, y = (tuple(int(d) for d in s) for s in shapes)
    if x[1] != w[1] * groups:
        raise CudnnError(f"{groups} groups of {w[1]} channels do not make {x[1]}")
    _, _, sh, sw, ph, pw, dh, dw = geom
    t = {"x": x, "w": w, "y": y}
    roles = {FORWARD: (("image", "x"), ("weight", "w"), ("Y", "y")),
             DATA: (("loss", "y"), ("filter", "w"), ("DX", "x")),
             FILTER: (("image", "x"), ("loss", "y"), ("DW", "w"))}[kind]
    (ra, a), (rb, b), (ro, o) = roles
    return ConvGraph(kind, dtype, ((ra, t[a], _row_major(t[a])), (rb, t[b], _row_major(t[b]))),
                     (ro, t[o], _row_major(t[o])), (ph, pw), (ph, pw), (sh, sw), (dh, dw))


class FrontendConvolutions(ctypes_path.ConvolutionCalls):
    """cuDNN's convolutions on `xp`'s arrays through the frontend module `cudnn` (the
    package, or a stand-in in the tests): `pointer(a)` an array's address, `stream()` the
    current stream's. Methods as Convolutions': None where cuDNN takes no plan within
    `limit` bytes of workspace (`declined` says why, per description)."""

    def __init__(self, cudnn, xp, pointer, stream):
        self.cudnn, self.xp, self._ptr, self._stream = cudnn, xp, pointer, stream
        self.handle = cudnn.create_handle()  # (on the current device: the backend's)
        self._graphs: dict[tuple, tuple | None] = {}  # (description, limit) -> built
        self.declined: dict[ConvGraph, str] = {}

    def built(self, desc: ConvGraph, limit: int):
        """(graph, input tensors, output tensor, workspace bytes) for `desc`, built on its
        first call with this limit; None where no plan fits it."""
        key = (desc, limit)
        if key not in self._graphs:
            try:
                self._graphs[key] = self._build(desc, limit)
            except Exception as e:  # not supported, no plan within the limit: declined
                self._graphs[key] = None
                self.declined[desc] = f"{type(e).__name__}: {e}"
        return self._graphs[key]

    def _build(self, desc: ConvGraph, limit: int):
        dn = self.cudnn
        dt, ct = getattr(dn.data_type, _DTYPES[desc.dtype]), getattr(dn.data_type, desc.compute)
        g = dn.pygraph(io_data_type=dt, intermediate_data_type=ct, compute_data_type=ct,
                       handle=self.handle)
        ins = [g.tensor(dim=list(d), stride=list(s), data_type=dt, name=role)
               for role, d, s in desc.inputs]
        op = {FORWARD: g.conv_fprop, DATA: g.conv_dgrad, FILTER: g.conv_wgrad}[desc.kind]
        (ra, _, _), (rb, _, _) = desc.inputs
        out = op(**{ra: ins[0], rb: ins[1]}, pre_padding=list(desc.pre_padding),
                 post_padding=list(desc.post_padding), stride=list(desc.stride),
                 dilation=list(desc.dilation), compute_data_type=ct, name=desc.kind)
        _, od, os_ = desc.output
        out.set_output(True).set_data_type(dt).set_dim(list(od)).set_stride(list(os_))
        if not desc.tensor_cores:
            g.deselect_numeric_notes([dn.numerical_note.TENSOR_CORE])
        g.deselect_workspace_greater_than(int(limit))
        g.build([getattr(dn.heur_mode, h) for h in _HEURISTICS])
        return g, ins, out, int(g.get_workspace_size())

    def _run(self, kind, dtype, shapes, geom, groups, a, b, out, limit):
        if dtype not in _DTYPES:
            return None
        try:
            desc = describe(kind, dtype, shapes, geom, groups)
        except CudnnError:
            return None
        got = self.built(desc, max(int(limit), 0))
        if got is None:
            return None
        g, ins, out_t, ws_bytes = got
        xp = self.xp
        shape = desc.output[1]
        if out is None or tuple(out.shape) != shape or not out.flags.c_contiguous:
            out = xp.empty(shape, dtype)
        if kind == DATA:  # (ConvolutionCalls gives (w, dy); the graph reads dy first)
            a, b = b, a
        a, b = xp.ascontiguousarray(a), xp.ascontiguousarray(b)
        ws = xp.empty(ws_bytes, xp.uint8) if ws_bytes else None  # (from CuPy's pool)
        self.cudnn.set_stream(self.handle, self._stream())
        g.execute({ins[0]: self._ptr(a), ins[1]: self._ptr(b), out_t: self._ptr(out)},
                  self._ptr(ws) if ws is not None else None, handle=self.handle)
        return out


def open_frontend(xp, pointer, stream, to_device, to_host, module=None):
    """(FrontendConvolutions, what was loaded) or (None, why not): the frontend does not
    import, or fails `self_check` (the ctypes path's check: the three convolutions against
    their definitions). `module`: a stand-in for `cudnn` (tests)."""
    try:
        if module is None:
            import cudnn as module
        conv = FrontendConvolutions(module, xp, pointer, stream)
        ctypes_path.self_check(conv, to_device, to_host)
    except Exception as e:  # any failure: the caller's next path, and why
        return None, f"the Python frontend: {type(e).__name__}: {e}"
    version = getattr(module, "__version__", "?")
    backend = getattr(module, "backend_version_string", lambda: "?")()
    return conv, f"cuDNN {backend} through its Python frontend {version}"


def open_chosen(xp, pointer, stream, device, to_device, to_host, module=None):
    """(convolutions, what was loaded) or (None, why not), as NETDSL_CUDNN chooses (`mode`):
    the frontend, the ctypes path (`cudnn.open_convolutions`, whose arguments these are),
    or neither; unset, the frontend where it imports and passes its check, else the
    ctypes path, whose status then says why the frontend was not taken."""
    try:
        chosen = mode()
    except CudnnError as e:
        return None, f"not used: {e}"
    if chosen == "off":
        return None, f"off ({ENV}={os.environ[ENV]})"
    why = ""
    if chosen in ("auto", "frontend"):
        conv, status = open_frontend(xp, pointer, stream, to_device, to_host, module)
        if conv is not None or chosen == "frontend":
            return conv, status if conv is not None else f"not used: {status}"
        why = f"; not {status}"
    conv, status = ctypes_path.open_convolutions(xp, pointer, stream, device, to_device, to_host)
    return conv, status + why
