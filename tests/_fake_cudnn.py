"""tests/data/fake_cudnn.c built into a library (once per process), and cuDNN's
convolutions (netdsl.backends.cudnn) on NumPy arrays through it: the ctypes calls run
without a GPU."""
from __future__ import annotations

import atexit
import ctypes
import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

SOURCE = Path(__file__).parent / "data" / "fake_cudnn.c"


@functools.cache
def library() -> str | None:
    """The stand-in library's path, or None where there is no C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    folder = tempfile.mkdtemp(prefix="netdsl-fake-cudnn-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # (the process's own copy)
    out = Path(folder) / "libfakecudnn.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(SOURCE)], check=True)
    return str(out)


def need_library() -> str:
    path = library()
    if path is None:
        pytest.skip("no C compiler to build the stand-in cuDNN library")
    return path


def convolutions(stream: int = 0):
    """netdsl.backends.cudnn.Convolutions on NumPy arrays, through the stand-in."""
    from netdsl.backends import cudnn
    lib = cudnn.load([need_library()])
    return cudnn.Convolutions(lib, np, lambda a: a.ctypes.data, lambda: stream, lambda: 0)


def last_algo() -> int:
    """The algorithm of the stand-in's last convolution."""
    return ctypes.CDLL(need_library()).fake_last_algo()


def last_stream() -> int:
    fn = ctypes.CDLL(need_library()).fake_last_stream
    fn.restype = ctypes.c_void_p
    return fn() or 0


GEOMETRIES = [  # (x shape, out channels, attrs)
    ((2, 4, 7, 6), 6, {"kernel": 3, "stride": 2, "padding": 1, "groups": 2}),
    ((3, 3, 8, 8), 5, {"kernel": 3, "padding": 2, "dilation": 2}),
    ((2, 6, 5, 5), 6, {"kernel": 3, "padding": 1, "groups": 6}),  # depthwise
    ((2, 4, 5, 5), 3, {"kernel": 1}),  # pointwise
    ((2, 3, 9, 7), 4, {"kernel": (3, 2), "stride": (1, 2), "padding": (1, 0)}),
]


def conv_attrs(o, a) -> dict:
    """conv2d's attributes: `a` over the defaults."""
    return {"out_channels": o, "kernel": 1, "stride": 1, "padding": 0, "dilation": 1,
            "groups": 1, **a}


def geometry(a) -> tuple:
    """(kh, kw, sh, sw, ph, pw, dh, dw) of conv2d attributes."""
    from netdsl.ir.ops._util import pair
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = (pair(a[k]) for k in
                                              ("kernel", "stride", "padding", "dilation"))
    return (kh, kw, sh, sw, ph, pw, dh, dw)
