"""ONNX import of the operators one at a time: netdsl's own exports of the operator cases
of test_onnx_export_ops (and hand-built nodes for forms netdsl does not export) come back
as .net files that give onnxruntime's outputs; the scalar constants are numbers in the
text."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from _examples import example_feeds  # noqa: E402
from _onnx_helpers import calibrated_state  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from test_onnx_export_ops import CASES  # noqa: E402
from test_onnx_import import check_against_onnx  # noqa: E402

import netdsl  # noqa: E402
from netdsl.interop.onnx_export import export_onnx  # noqa: E402
from netdsl.interop.onnx_import import import_onnx  # noqa: E402

# the cases whose export uses only operators the importer takes (groupnorm's Shape-based
# reshape, layernorm over several dims, mish's Softplus ... come back otherwise or not)
ROUND_TRIP = ["conv_same", "conv_asym", "conv_valid_groups", "conv1d", "conv1d_same", "conv3d",
              "conv_transpose2d", "conv_transpose2d_groups", "maxpool_ceil", "maxpool_ceil_pad",
              "avgpool_ceil", "pool_ceil_edge", "avgpool_exclude_pad", "avgpool_exclude_pad_ceil",
              "pool1d", "pool3d", "global_maxpool", "adaptive_even", "pad_constant", "pad_reflect",
              "pad_replicate", "upsample_nearest", "upsample_nearest_size",
              "upsample_bilinear", "upsample_bilinear_scale", "upsample_align",
              "upsample_linear_1d", "upsample_trilinear", "instancenorm", "rmsnorm",
              "activations", "softplus", "prelu", "log_softmax", "arith", "where",
              "reductions", "shapes"]


@pytest.mark.parametrize("name", ROUND_TRIP)
def test_exported_operator_imports_back(name, tmp_path):
    decl, expr = CASES[name]
    net = netdsl.loads(f"network t {{\n  {decl}\n  output {expr}\n}}", file=f"{name}.net")
    g = net.lower(2)
    state = calibrated_state(g, example_feeds(g))
    export_onnx(net.lower(), lambda n: state[n.name], tmp_path / "m.onnx")
    r = import_onnx(tmp_path / "m.onnx", tmp_path / "m.net")
    check_against_onnx(tmp_path / "m.onnx", r, batch=3, seed=1)


def _model(path, nodes, x_shape, inits=(), y_shape=None):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     ["B", *x_shape])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          initializer=[numpy_helper.from_array(np.asarray(v, np.float32), k)
                                       for k, v in inits])
    onnx_path = path / "m.onnx"
    import onnx
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), onnx_path)
    return onnx_path


def _scalar(name, v):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(
        np.array(v, np.float32)))


def test_scalar_constants_are_numbers_in_the_text(tmp_path):
    nodes = [_scalar("one", 1.0), _scalar("two", 2.0), _scalar("half", 0.5),
             helper.make_node("Sub", ["x", "one"], ["a"]),
             helper.make_node("Div", ["two", "a"], ["b"]),
             helper.make_node("Pow", ["b", "two"], ["c"]),
             helper.make_node("Max", ["c", "half"], ["d"]),
             helper.make_node("Greater", ["x", "half"], ["m"]),
             helper.make_node("Where", ["m", "d", "one"], ["y"])]
    path = _model(tmp_path, nodes, [3, 4])
    r = import_onnx(path, tmp_path / "m.net")
    text = r.net_path.read_text()
    assert "- 1.0" in text and "2.0 /" in text and "** 2.0" in text and "max(" in text
    assert "> 0.5" in text and "fill((1,), value=1.0)" in text
    check_against_onnx(path, r)


def test_clip_other_than_relu6_and_hardsigmoid(tmp_path):
    nodes = [_scalar("lo", -0.5), _scalar("hi", 6.0),
             helper.make_node("Clip", ["x", "lo", "hi"], ["a"]),
             helper.make_node("Clip", ["a", "", "hi"], ["b"]),
             helper.make_node("HardSigmoid", ["b"], ["y"], alpha=1 / 6, beta=0.5)]
    path = _model(tmp_path, nodes, [3, 4])
    r = import_onnx(path, tmp_path / "m.net")
    text = r.net_path.read_text()
    assert "clip(x, min=-0.5, max=6.0)" in text and "clip(" in text and "hardsigmoid(" in text
    check_against_onnx(path, r)


def test_asymmetric_pool_pads_become_a_pad(tmp_path):
    nodes = [helper.make_node("MaxPool", ["x"], ["a"], kernel_shape=[3, 3], strides=[2, 2],
                              pads=[0, 1, 1, 0]),
             helper.make_node("AveragePool", ["a"], ["y"], kernel_shape=[2, 2],
                              pads=[1, 0, 0, 1], count_include_pad=1)]
    path = _model(tmp_path, nodes, [2, 9, 8])
    r = import_onnx(path, tmp_path / "m.net")
    assert r.net_path.read_text().count("pad(") == 2
    check_against_onnx(path, r)


def test_instancenorm_and_reductions(tmp_path):
    nodes = [helper.make_node("InstanceNormalization", ["x", "s", "b"], ["a"], epsilon=0.01),
             helper.make_node("ReduceSum", ["a", "axes"], ["c"], keepdims=1),
             helper.make_node("ReduceMax", ["a"], ["d"], axes=[1], keepdims=1),
             helper.make_node("Add", ["c", "d"], ["e"]),
             helper.make_node("LogSoftmax", ["e"], ["y"], axis=2)]
    inits = [("s", [0.5, 2.0]), ("b", [0.1, -0.2]),
             ("axes", np.array([3], np.int64))]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     ["B", 2, 5, 6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          initializer=[numpy_helper.from_array(np.asarray(v), k)
                                       if k == "axes" else
                                       numpy_helper.from_array(np.asarray(v, np.float32), k)
                                       for k, v in inits])
    import onnx
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    r = import_onnx(path, tmp_path / "m.net")
    text = r.net_path.read_text()
    assert "instancenorm(" in text and "sum(" in text and "amax(" in text
    check_against_onnx(path, r)
