"""cuDNN through NVIDIA's Python frontend (netdsl.backends.cudnn_frontend) without a GPU:
each convolution's graph description (tensors, strides, padding, stride, dilation, groups),
graphs built once per description and cached, float32 kept off the tensor cores, the
workspace limit, and which path NETDSL_CUDNN takes, against a stand-in for the `cudnn`
package with its signatures (tests/_fake_cudnn_frontend.py). test_cudnn.py runs both paths'
convolutions and a whole step on them; test_gpu.py the real libraries."""
from __future__ import annotations

import sys

import _fake_cudnn_frontend as fake
import numpy as np
import pytest
from _fake_cudnn import need_library

from netdsl.backends import cudnn
from netdsl.backends.cudnn_frontend import ConvGraph, describe, open_chosen

X, W, Y = (2, 4, 7, 6), (6, 2, 3, 3), (2, 6, 4, 3)  # groups 2, stride 2, padding 1
GEOM = (3, 3, 2, 2, 1, 1, 1, 1)


def test_each_kind_describes_its_tensors_and_parameters():
    fwd = describe("forward", "float32", (X, W, Y), GEOM, 2)
    assert fwd == ConvGraph("forward", "float32",
                            (("image", X, (168, 42, 6, 1)), ("weight", W, (18, 9, 3, 1))),
                            ("Y", Y, (72, 12, 3, 1)), (1, 1), (1, 1), (2, 2), (1, 1))
    data = describe("data", "float32", (X, W, Y), GEOM, 2)
    assert [r for r, _, _ in data.inputs] == ["loss", "filter"] and data.output[:2] == (
        "DX", X)
    grad = describe("filter", "float64", (X, W, Y), GEOM, 2)
    assert [r for r, _, _ in grad.inputs] == ["image", "loss"] and grad.output[:2] == (
        "DW", W)
    assert (fwd.compute, grad.compute, fwd.tensor_cores) == ("FLOAT", "DOUBLE", False)
    assert describe("forward", "float16", (X, W, Y), GEOM, 2).tensor_cores
    wide = describe("forward", "float32", (X, W, Y), (3, 3, 1, 2, 0, 2, 3, 1), 2)
    assert (wide.stride, wide.pre_padding, wide.post_padding, wide.dilation) == (
        (1, 2), (0, 2), (0, 2), (3, 1))
    with pytest.raises(cudnn.CudnnError, match="3 groups of 2 channels do not make 4"):
        describe("forward", "float32", (X, W, Y), GEOM, 3)


def test_a_graph_is_built_once_per_description_and_limit():
    conv = fake.convolutions(stream=77)
    x = np.ones(X, np.float32)
    w = np.ones(W, np.float32)
    fake.built.clear()
    for _ in range(3):
        conv.forward(x, w, GEOM, 2, limit=1 << 20)
    assert len(fake.built) == 1 and conv.handle.stream == 77
    g = fake.built[0]
    assert g.io is fake.data_type.FLOAT and g.compute is fake.data_type.FLOAT
    assert g.notes == [fake.numerical_note.TENSOR_CORE]  # no TF32 for float32
    assert g.heuristics == [fake.heur_mode.A, fake.heur_mode.FALLBACK]
    assert [(t.name, t.dim, t.stride) for t in g.tensors[:2]] == [
        ("image", list(X), [168, 42, 6, 1]), ("weight", list(W), [18, 9, 3, 1])]
    conv.forward(x.astype(np.float64), w.astype(np.float64), GEOM, 2, limit=1 << 20)
    conv.forward(x.astype(np.float16), w.astype(np.float16), GEOM, 2, limit=1 << 20)
    assert len(fake.built) == 3 and fake.built[2].notes == []  # f16: the tensor cores
    assert fake.built[1].compute is fake.data_type.DOUBLE


def test_the_workspace_stays_within_the_limit_and_unsupported_ones_decline():
    conv = fake.convolutions()
    x, dy = np.ones(X), np.ones(Y)
    fake.built.clear()
    conv.grad_weight(dy, x, W, GEOM, 2, limit=fake.WORKSPACE)
    conv.grad_weight(dy, x, W, GEOM, 2, limit=fake.WORKSPACE - 1)
    assert [g.workspace for g in fake.built] == [fake.WORKSPACE, 0]
    assert conv.forward(x, np.ones(W), (3, 3, 2, 2, 1, 1, 0, 1), 2) is None
    assert list(conv.declined.values()) == [
        "cudnnGraphNotSupportedError: no engine supports this convolution"]
    assert conv.forward(x.astype(np.int32), np.ones(W, np.int32), GEOM, 2) is None
    out = np.full(Y, np.nan)  # a planned slot: written in place
    assert conv.forward(x, np.ones(W), GEOM, 2, out=out) is out and np.isfinite(out).all()


def _open(module=fake):
    return open_chosen(np, lambda a: a.ctypes.data, lambda: 0, lambda: 0, np.asarray,
                       np.asarray, module)


def test_netdsl_cudnn_chooses_the_path(monkeypatch):
    monkeypatch.setenv(cudnn.LIBRARY_ENV, need_library())
    monkeypatch.delenv(cudnn.ENV, raising=False)
    conv, status = _open()  # unset: the frontend, which imports and passes its check
    assert type(conv).__name__ == "FrontendConvolutions"
    assert status == "cuDNN 9.19.0 through its Python frontend 1.32.0-fake"
    monkeypatch.setitem(sys.modules, "cudnn", None)  # the package does not import
    conv, status = _open(module=None)  # (so the ctypes path)
    assert type(conv) is cudnn.Convolutions
    assert status.startswith(f"cuDNN 9.19.0 ({need_library()}); not the Python frontend: "
                             "ModuleNotFoundError: ")
    monkeypatch.setenv(cudnn.ENV, "ctypes")
    assert type(_open()[0]) is cudnn.Convolutions
    monkeypatch.setenv(cudnn.ENV, "frontend")
    conv, status = _open(module=None)
    assert conv is None and status.startswith("not used: the Python frontend: Module")
    for off in ("off", "0"):
        monkeypatch.setenv(cudnn.ENV, off)
        assert _open() == (None, f"off (NETDSL_CUDNN={off})")
    monkeypatch.setenv(cudnn.ENV, "fast")
    conv, status = _open()
    assert conv is None and "NETDSL_CUDNN='fast': give one of frontend, ctypes or off" in status


def test_the_check_refuses_a_frontend_that_lets_float32_onto_the_tensor_cores(monkeypatch):
    monkeypatch.setenv(cudnn.ENV, "frontend")
    monkeypatch.setattr(ConvGraph, "tensor_cores", property(lambda self: True))
    conv, status = _open()
    assert conv is None and "forward differs from the definition" in status


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["frontend", "ctypes"])
def test_each_path_loads_and_passes_its_check_on_a_gpu(path, monkeypatch):
    """The CuPy backend's convolutions as NETDSL_CUDNN chooses them, each checked against
    the definitions on the device (open_chosen's self_check) when first asked for."""
    import importlib.util

    from netdsl.backends import get_backend
    from netdsl.errors import DeviceError
    if path == "frontend" and importlib.util.find_spec("cudnn") is None:
        pytest.skip("nvidia-cudnn-frontend is not installed (pip install netdsl[gpu])")
    monkeypatch.setenv(cudnn.ENV, path)
    try:
        gpu = get_backend("cupy", 0)
    except DeviceError as e:
        pytest.skip(f"no usable CuPy GPU: {e.message}")
    dnn = gpu.cudnn
    assert dnn is not None, gpu.cudnn_status
    kind = "FrontendConvolutions" if path == "frontend" else "Convolutions"
    assert type(dnn).__name__ == kind and gpu.cudnn_status.startswith("cuDNN ")
    print(gpu.cudnn_status)  # (which library and path: the device run's log says)
