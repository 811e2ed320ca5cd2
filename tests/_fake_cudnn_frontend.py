"""A stand-in for NVIDIA's cuDNN Python frontend (`import cudnn`, nvidia-cudnn-frontend
1.32) as netdsl.backends.cudnn_frontend calls it, with the real package's signatures
(cudnn/_pygraph.py and cudnn/__init__.py of its wheel):

    create_handle() -> Handle;  set_stream(handle, stream: int)
    pygraph(name="test_graph", io_data_type=None, intermediate_data_type=None,
            compute_data_type=None, handle=None, ...)
    .tensor(dim, stride=None, data_type=None, is_virtual=False, ..., name="")
    .conv_fprop(image, weight, padding, pre_padding, post_padding, stride, dilation,
                convolution_mode, compute_data_type, name)   (keywords; -> Y)
    .conv_dgrad(loss, filter, ...) -> DX;  .conv_wgrad(image, loss, ...) -> DW
    Tensor.set_output / set_data_type / set_dim / set_stride -> the tensor
    .deselect_numeric_notes([numerical_note]); .deselect_workspace_greater_than(int)
    .build([heur_mode]); .get_workspace_size() -> int
    .execute({tensor: pointer}, workspace=None, handle=None)

A graph runs on NumPy arrays' memory (the pointers are their addresses) by the
convolutions' definitions (netdsl.backends.cudnn.reference). Its plans behave as cuDNN's
do in the ways netdsl depends on: a float32 graph whose tensor-core plans are not
deselected runs in TF32 (inputs rounded to 10 bits of mantissa), the gradients' first
plan needs WORKSPACE bytes (the next none), and a zero stride or dilation has no plan
(build raises).
"""
from __future__ import annotations

import ctypes
import enum

import numpy as np

from netdsl.backends.cudnn import reference

__version__ = "1.32.0-fake"
WORKSPACE = 4096  # bytes the data and filter gradients' plans ask for
data_type = enum.Enum("data_type", "FLOAT DOUBLE HALF BFLOAT16 NOT_SET")
heur_mode = enum.Enum("heur_mode", "A B FALLBACK")
numerical_note = enum.Enum("numerical_note", "TENSOR_CORE DOWN_CONVERT_INPUTS")
_NUMPY = {data_type.FLOAT: np.float32, data_type.DOUBLE: np.float64,
          data_type.HALF: np.float16}
built: list = []  # every graph built, for the tests to look at


class cudnnGraphNotSupportedError(RuntimeError):
    pass


def backend_version_string() -> str:
    return "9.19.0"


class Handle:
    stream = None


def create_handle() -> Handle:
    return Handle()


def set_stream(handle, stream):
    if not isinstance(handle, Handle) or type(stream) is not int:
        raise TypeError("set_stream(handle: cudnn.Handle, stream: int)")
    handle.stream = stream


class Tensor:
    def __init__(self, name, dim, stride, data_type):
        self.name, self.dim, self.stride, self.data_type = name, dim, stride, data_type
        self.output = False

    def set_output(self, value: bool):
        self.output = value
        return self

    def set_data_type(self, dtype):
        self.data_type = dtype
        return self

    def set_dim(self, dim):
        self.dim = list(dim)
        return self

    def set_stride(self, stride):
        self.stride = list(stride)
        return self


_CONV_ARGS = {"padding", "pre_padding", "post_padding", "stride", "dilation",
              "convolution_mode", "compute_data_type", "name"}
_OPS = {"conv_fprop": ("image", "weight"), "conv_dgrad": ("loss", "filter"),
        "conv_wgrad": ("image", "loss")}


class pygraph:
    def __init__(self, name="test_graph", io_data_type=None, intermediate_data_type=None,
                 compute_data_type=None, handle=None, *args, **kwargs):
        self.io, self.compute, self.handle = io_data_type, compute_data_type, handle
        self.tensors, self.op, self.notes, self.limit = [], None, [], None
        self.heuristics = self.workspace = None

    def tensor(self, dim, stride=None, data_type=None, is_virtual=False,
               is_pass_by_value=False, ragged_offset=None, reordering_type=None, name="",
               uid=None, **kwargs):
        if not all(type(d) is int for d in list(dim) + list(stride or ())):
            raise TypeError("dims and strides are ints")
        t = Tensor(name, list(dim), list(stride) if stride else None, data_type)
        self.tensors.append(t)
        return t

    def _conv(self, op, kw):
        a, b = _OPS[op]
        unknown = set(kw) - _CONV_ARGS - {a, b}
        if unknown or a not in kw or b not in kw:
            raise TypeError(f"{op}() takes {a}, {b} and {sorted(_CONV_ARGS)}; got {sorted(kw)}")
        self.op = (op, kw)
        out = Tensor(kw.get("name", op) + "::out", None, None, self.io)
        self.tensors.append(out)
        return out

    def conv_fprop(self, **kw):
        return self._conv("conv_fprop", kw)

    def conv_dgrad(self, **kw):
        return self._conv("conv_dgrad", kw)

    def conv_wgrad(self, **kw):
        return self._conv("conv_wgrad", kw)

    def deselect_numeric_notes(self, notes):
        self.notes += list(notes)
        return self

    def deselect_workspace_greater_than(self, workspace_limit):
        if type(workspace_limit) is not int:
            raise TypeError("workspace_limit is an int")
        self.limit = workspace_limit
        return self

    def build(self, heuristics=None, ctx=None):
        if not all(isinstance(h, heur_mode) for h in heuristics or ()):
            raise TypeError("heuristics are cudnn.heur_mode values")
        if 0 in self.op[1]["dilation"] or 0 in self.op[1]["stride"]:
            raise cudnnGraphNotSupportedError("no engine supports this convolution")
        # the gradients' first plan needs WORKSPACE bytes, their next none
        need = 0 if self.op[0] == "conv_fprop" else WORKSPACE
        if self.limit is not None and need > self.limit:
            need = 0
        self.heuristics, self.workspace = heuristics, need
        built.append(self)

    def get_workspace_size(self, handle=None, *args):
        if self.workspace is None:
            raise RuntimeError("Call build() first")
        return self.workspace

    def execute(self, tensor_dict, workspace=None, handle=None, *args):
        if self.workspace and type(workspace) is not int:
            raise TypeError(f"a plan needing {self.workspace} bytes got workspace {workspace}")
        if set(tensor_dict) != set(self.tensors):
            raise ValueError("the variant pack names every tensor of the graph")
        op, kw = self.op
        a, b = (self._array(tensor_dict, kw[k]) for k in _OPS[op])
        out = next(t for t in self.tensors if t.output)
        tf32 = (self.io is data_type.FLOAT and numerical_note.TENSOR_CORE not in self.notes)
        if tf32:  # (10 bits of mantissa, as the tensor cores read float32)
            a, b = (np.asarray(v.view(np.uint32) & 0xFFFFE000).view(np.float32)
                    for v in (a, b))
        x, w, dy = {"conv_fprop": (a, b, None), "conv_dgrad": (None, b, a),
                    "conv_wgrad": (a, None, b)}[op]
        shape = tuple(out.dim)
        x = np.zeros(shape, a.dtype) if x is None else x  # (dx's, dw's shapes: the graph's)
        w = np.zeros(shape, a.dtype) if w is None else w
        dy = np.zeros(shape, a.dtype) if dy is None else dy
        (ph, pw), (sh, sw), (dh, dw) = kw["pre_padding"], kw["stride"], kw["dilation"]
        if list(kw["post_padding"]) != [ph, pw]:
            raise ValueError("this stand-in computes symmetric padding only")
        geom = (w.shape[2], w.shape[3], sh, sw, ph, pw, dh, dw)
        kind = list(_OPS).index(op)
        self._array(tensor_dict, out)[...] = reference(x, w, dy, geom,
                                                       x.shape[1] // w.shape[1])[kind]

    def _array(self, tensor_dict, t):
        ptr = tensor_dict[t]
        if type(ptr) is not int:
            raise TypeError(f"tensor {t.name}: a device pointer (int), not {type(ptr)}")
        dt = np.dtype(_NUMPY[t.data_type])
        n = int(np.prod(t.dim))
        raw = (ctypes.c_byte * (n * dt.itemsize)).from_address(ptr)
        return np.ctypeslib.as_array(raw).view(dt).reshape(t.dim)


def convolutions(stream: int = 0):
    """netdsl.backends.cudnn_frontend.FrontendConvolutions on NumPy arrays, through this
    stand-in (imported as the module it stands in for)."""
    import sys

    from netdsl.backends.cudnn_frontend import FrontendConvolutions
    return FrontendConvolutions(sys.modules[__name__], np, lambda a: a.ctypes.data,
                                lambda: stream)
