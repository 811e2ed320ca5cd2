"""The CuPy backend's CUDA kernels without a GPU: every launch passes what its kernel's
CUDA signature declares, in order (a pointer for each `T*`/`double*`/`long long*`, a
scalar of the declared width otherwise); and the source compiles for Hopper where nvcc is
installed. tests/test_gpu.py checks their numbers against NumPy on a GPU."""
from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from netdsl.backends.cupy_fused import _SOURCE, CudaKernels

SIGNATURES = {
    m.group(1): [p.strip() for p in m.group(2).split(",")]
    for m in re.finditer(r'extern "C" __global__ void (\w+)\(([^)]*)\)', _SOURCE)}


class FakeArray(np.ndarray):
    """Stands for a cupy.ndarray (the kernels' `accepts` asks for the backend's type)."""


class FakeCupy:
    ndarray = FakeArray

    def __init__(self):
        self.launches = []
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
    assert [name for name, *_ in cp.launches] == [
        "bn_forward", "bn_running", "bn_grad_stats", "bn_grad_input", "sgd_update",
        "adam_update"]
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
