"""cuDNN's convolutions through ctypes (netdsl.backends.cudnn), run without a GPU against a
stand-in library (tests/data/fake_cudnn.c: cuDNN's prototypes, the convolutions by their
definitions, on host memory): the declarations, the argument order, the descriptors, the
algorithm choice within a workspace limit, and conv2d's kernels taking the cuDNN path on
nodes marked for a GPU, with the same numbers as the columns' path in a whole step.
On a GPU, tests/test_gpu.py runs the real library."""
from __future__ import annotations

import numpy as np
import pytest
from _examples import example_feeds, load
from _fake_cudnn import (
    GEOMETRIES,
    conv_attrs,
    convolutions,
    geometry,
    last_algo,
    last_stream,
    need_library,
)
from _fake_cudnn_frontend import convolutions as frontend_convolutions

from netdsl.backends import cudnn
from netdsl.backends.numpy import NumpyBackend
from netdsl.config import TrainConfig
from netdsl.ir import registry
from netdsl.ir.ops.conv import conv2d_forward, conv2d_grad_input, conv2d_grad_weight
from netdsl.runtime.executor import Executor
from netdsl.runtime.trainer import Trainer
from netdsl.step.graphs import training_graph

registry.load_all()
PATHS = {"ctypes": convolutions, "frontend": frontend_convolutions}  # (the same interface)

def test_the_library_loads_and_says_its_version():
    lib = cudnn.load(["/nonexistent/libcudnn.so.9", need_library()])
    assert lib.version_string == "9.19.0" and lib.path == need_library()
    with pytest.raises(cudnn.CudnnError, match="NETDSL_CUDNN_LIBRARY"):
        cudnn.load(["/nonexistent/libcudnn.so.9"])
    with pytest.raises(cudnn.CudnnError, match="no cuDNN library"):  # not a cuDNN
        cudnn.load([np.__file__])


def test_the_search_looks_in_the_env_var_then_the_wheels(monkeypatch, tmp_path):
    monkeypatch.setenv(cudnn.LIBRARY_ENV, "/x/libcudnn.so.9")
    assert cudnn.candidates() == ["/x/libcudnn.so.9"]
    monkeypatch.delenv(cudnn.LIBRARY_ENV)
    lib = tmp_path / "nvidia" / "cudnn" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcudnn.so.9").write_bytes(b"")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = cudnn.candidates()
    assert found[0] == str(lib / "libcudnn.so.9") and found[-1] == "libcudnn.so"


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape,o,a", GEOMETRIES, ids=range(len(GEOMETRIES)))
def test_the_three_convolutions_match_netdsls_kernels(shape, o, a, dtype, path):
    dnn = PATHS[path]()
    a = conv_attrs(o, a)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(dtype)
    w = rng.standard_normal((o, shape[1] // a["groups"], *geometry(a)[:2])).astype(dtype)
    y = conv2d_forward(np, x, w, a)
    dy = rng.standard_normal(y.shape).astype(dtype)
    tol = {"float32": 1e-5, "float64": 1e-12}[dtype]
    got = (dnn.forward(x, w, geometry(a), a["groups"]),
           dnn.grad_input(dy, w, x.shape, geometry(a), a["groups"]),
           dnn.grad_weight(dy, x, w.shape, geometry(a), a["groups"]))
    want = (y, conv2d_grad_input(np, dy, w, x.shape, a), conv2d_grad_weight(np, dy, x, w.shape, a))
    for g, r in zip(got, want, strict=True):
        assert g.dtype == r.dtype and g.shape == r.shape
        np.testing.assert_allclose(g, r, rtol=tol, atol=tol * np.abs(r).max())
    for r, ref in zip(want, cudnn.reference(x, w, dy, geometry(a), a["groups"]), strict=True):
        np.testing.assert_allclose(r, ref, rtol=tol, atol=tol * np.abs(ref).max())


def test_the_algorithm_is_the_fastest_in_fma_math_whose_workspace_fits():
    """The stand-in ranks a tensor-op algorithm first, then one with no FMA form, then
    algorithm 1 (a workspace of x's bytes), then 0 (none); running 2 or 3 would fail."""
    dnn = convolutions(stream=1234)
    x = np.ones((2, 3, 6, 6), np.float32)
    w = np.ones((4, 3, 3, 3), np.float32)
    geom = (3, 3, 1, 1, 1, 1, 1, 1)
    dnn.forward(x, w, geom, 1, limit=x.nbytes)
    assert last_algo() == 1 and last_stream() == 1234
    dnn.forward(x, w, geom, 1, limit=x.nbytes - 1)
    assert last_algo() == 0
    dnn.grad_weight(np.ones((2, 4, 6, 6), np.float32), x, w.shape, geom, 1, limit=0)
    assert last_algo() == 0
    out = np.full((2, 4, 6, 6), np.nan, np.float32)  # the planned slot: written in place
    assert dnn.forward(x, w, geom, 1, out=out) is out and np.isfinite(out).all()


def test_refused_descriptors_decline_and_a_failed_convolution_raises(monkeypatch):
    """Descriptors cuDNN refuses leave the convolution to the caller (None, and why);
    a convolution that fails once chosen is an error naming the call and the status."""
    dnn = convolutions()
    x, w = np.ones((1, 1, 4, 4)), np.ones((1, 1, 3, 3))
    assert dnn.forward(x, w, (3, 3, 1, 1, 0, 0, 0, 0), 1) is None  # dilation 0
    assert list(dnn.declined.values()) == [
        "cudnnSetConvolution2dDescriptor failed: CUDNN_STATUS_BAD_PARAM (status 3)"]
    geom = (3, 3, 1, 1, 0, 0, 1, 1)
    assert dnn.forward(x.astype(np.float16), w.astype(np.float16), geom, 1) is None
    assert dnn.forward(x, w, geom, 1) is not None
    g = next(g for g in dnn._geoms.values() if g is not None)
    monkeypatch.setattr(g, "algorithm", lambda *a: (2, 0))  # tensor-op: not in FMA math
    with pytest.raises(cudnn.CudnnError, match=r"cudnnConvolutionForward failed: "
                                               r"CUDNN_STATUS_NOT_SUPPORTED \(status 9\)"):
        dnn.forward(x, w, geom, 1)


def test_the_self_check_passes_a_working_library_and_fails_a_wrong_one(monkeypatch):
    dnn = convolutions()
    cudnn.self_check(dnn, np.asarray, np.asarray)
    monkeypatch.setattr(dnn, "grad_input", lambda dy, w, shape, *a, **k: np.zeros(shape,
                                                                                  dy.dtype))
    with pytest.raises(cudnn.CudnnError, match="data gradient differs"):
        cudnn.self_check(dnn, np.asarray, np.asarray)
    monkeypatch.undo()
    real = dnn.forward  # declining the grouped case leaves it to the caller...
    monkeypatch.setattr(dnn, "forward", lambda x, w, geom, groups, *a, **k: None
                        if groups > 1 else real(x, w, geom, groups, *a, **k))
    cudnn.self_check(dnn, np.asarray, np.asarray)
    monkeypatch.setattr(dnn, "forward", lambda *a, **k: None)  # ...but not the plain one
    with pytest.raises(cudnn.CudnnError, match="forward found no algorithm for a plain"):
        cudnn.self_check(dnn, np.asarray, np.asarray)


def _open():
    return cudnn.open_convolutions(np, lambda a: a.ctypes.data, lambda: 0, lambda: 0,
                                   np.asarray, np.asarray)


def test_opening_reports_what_it_loaded_or_why_not(monkeypatch, tmp_path):
    """What the CuPy backend's `cudnn` and `cudnn_status` come from (on NumPy here)."""
    monkeypatch.setenv(cudnn.LIBRARY_ENV, need_library())
    conv, status = _open()
    assert conv is not None and status == f"cuDNN 9.19.0 ({need_library()})"
    monkeypatch.setenv(cudnn.ENV, "0")
    assert _open() == (None, "off (NETDSL_CUDNN=0)")
    monkeypatch.delenv(cudnn.ENV)
    monkeypatch.setenv(cudnn.LIBRARY_ENV, str(tmp_path / "libcudnn.so.9"))
    conv, status = _open()
    assert conv is None and status.startswith("not used: no cuDNN library could be loaded")
    monkeypatch.setenv(cudnn.LIBRARY_ENV, need_library())
    real = cudnn.reference  # a library whose every result is off by one
    monkeypatch.setattr(cudnn, "reference", lambda *a: tuple(v + 1 for v in real(*a)))
    conv, status = _open()
    assert conv is None and status.startswith("not used: ") and "differs" in status


NET = """
network dnn_paths {
    input x: f32[N, 3, 12, 12]
    input y: i64[N]
    h = relu(batchnorm(conv2d(x, 8, kernel=3, padding=1)))
    h = conv2d(h, 8, kernel=3, stride=2, padding=(0, 0, 1, 1), groups=2)
    h = conv2d(h, 8, kernel=3, padding=2, dilation=2, groups=8, bias=false)
    h = relu(conv2d(h, 16, kernel=1, bias=false))
    logits = linear(flatten(global_avgpool(h)), 5)
    output logits
    loss softmax_cross_entropy(logits, y)
}
"""


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_a_gpu_step_on_cudnn_gives_the_columns_paths_numbers(dtype, path, monkeypatch):
    """A training step whose convolutions the `device` pass marked for a GPU, with cuDNN
    (the stand-in) and without (the columns' path), in the arena of its storage plan (a
    result of the wrong size, or a workspace outside its rule, would stop it): the same
    loss and updates; every convolution node took the cuDNN path."""
    import netdsl
    net = netdsl.loads(NET)
    step = training_graph(net.lower(4), TrainConfig(), "gpu")
    feeds = example_feeds(step)
    calls = []
    runs = {}
    for use in (False, True):
        be = NumpyBackend()
        if use:
            dnn = PATHS[path]()
            for name in ("forward", "grad_input", "grad_weight"):
                def spy(*args, _f=getattr(dnn, name), _n=name, **kw):
                    out = _f(*args, **kw)
                    calls.append((_n, out is not None))
                    return out
                monkeypatch.setattr(dnn, name, spy)
            be.cudnn = dnn
        ex = Executor(step, be, dtype, arena=True)
        runs[use] = ex.run(feeds, roles=Trainer.ROLES)
    convs = [n for n in step.nodes if n.op.startswith("conv2d")]
    assert len(calls) == len(convs) == 11 and all(ok for _, ok in calls)
    tol = 1e-5 if dtype == "f32" else 1e-12
    for role in Trainer.ROLES:
        for a, b in zip(runs[False][role], runs[True][role], strict=True):
            np.testing.assert_allclose(b, a, rtol=tol, atol=tol)


def test_a_cpu_step_never_asks_for_cudnn():
    net = load("digits-cnn.net")
    step = training_graph(net.lower(2), net.train or TrainConfig(), "cpu")

    class Refuses(NumpyBackend):
        @property
        def cudnn(self):
            raise AssertionError("a CPU step asked for cuDNN")

    Executor(step, Refuses(), "f32").run(example_feeds(step), roles=Trainer.ROLES)
