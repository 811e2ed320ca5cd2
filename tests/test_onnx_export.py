"""ONNX export: every example passes onnx.checker's full check; the ones small enough to run
quickly give the same outputs in onnxruntime as netdsl's evaluation-mode forward on the
same weights (float32, relative error <= 1e-5, or for deep networks as close to the float64
reference as netdsl's own float32 run: see `assert_matches`)."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
import onnx  # noqa: E402
from _examples import ROOT, example_feeds, load  # noqa: E402
from _onnx_helpers import (  # noqa: E402
    assert_matches,
    calibrated_state,
    netdsl_forward,
    rel_err,
    run_ort,
)
from typer.testing import CliRunner  # noqa: E402

import netdsl  # noqa: E402
from netdsl.errors import InteropError  # noqa: E402
from netdsl.interop import onnx_export_ops  # noqa: E402
from netdsl.interop.onnx_export import export_onnx  # noqa: E402
from netdsl.interop.weights import seeded  # noqa: E402
from netdsl_cli.app import app  # noqa: E402

runner = CliRunner()
EXAMPLES_DIR = ROOT / "examples"

# run in onnxruntime and compared (batch 2)
COMPARED = ["digits-cnn.net", "digits-mlp.net", "transformer-tiny.net", "resnet20-cifar.net",
            "gpt-tiny.net", "unet-small.net", "mobilenet_v2.net", "squeezenet1_1.net",
            pytest.param("resnet164-cifar.net", marks=pytest.mark.slow),
            pytest.param("resnet1001-cifar.net", marks=pytest.mark.slow),
            pytest.param("densenet121.net", marks=pytest.mark.slow),
            pytest.param("resnet50.net", marks=pytest.mark.slow)]
QUICK = {p for p in COMPARED if isinstance(p, str)} - {"unet-small.net"}  # 4 s a batch
# compared at a smaller input resolution than the example's 224x224, which keeps the test
# quick; SqueezeNet's 70 makes its ceil_mode pools add partial windows
RESOLUTION = {"mobilenet_v2.net": 64, "squeezenet1_1.net": 70}
# too big to run quickly on a CPU: exported (zero weights, which the check does not read,
# in an external data file as resnet2504's 3.7 GB must be) and checked only
CHECKED = ["mobilenet_v2.net", "squeezenet1_1.net",
           pytest.param("resnet152.net", marks=pytest.mark.slow),
           pytest.param("vgg16.net", marks=pytest.mark.slow),
           pytest.param("resnet2504.net", marks=pytest.mark.slow),
           pytest.param("gpt-100m.net", marks=pytest.mark.slow)]
# examples built from another's operators, only bigger: exporting the other covers them
# (gpt-1b's 4.2 GB of weights on a CI disk would check nothing gpt-100m does not)
SAME_OPERATORS = {"gpt-1b.net": "gpt-100m.net"}


def test_every_example_is_covered():
    from _examples import EXAMPLES
    listed = {p if isinstance(p, str) else p.values[0] for p in COMPARED + CHECKED}
    assert set(SAME_OPERATORS.values()) <= listed
    assert listed | set(SAME_OPERATORS) == {p.name for p in EXAMPLES}


def load_at(name: str) -> netdsl.Network:
    """The example, with its 224x224 input at RESOLUTION[name] where that is given."""
    if name not in RESOLUTION:
        return load(name)
    path = EXAMPLES_DIR / name
    r = RESOLUTION[name]
    text = path.read_text().replace("224, 224]", f"{r}, {r}]")
    assert f"{r}, {r}]" in text
    return netdsl.loads(text, file=str(path))


@pytest.mark.parametrize("name", COMPARED)
def test_example_matches_onnxruntime(name, tmp_path):
    net = load_at(name)
    g = net.lower(2)
    feeds = example_feeds(g)
    state = calibrated_state(g, feeds)
    path = tmp_path / "m.onnx"
    r = export_onnx(net.lower(), lambda n: state[n.name], path)  # symbolic batch
    assert r.batch == "N" and r.data_path is None
    model = onnx.load(path)
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"
    onnx.checker.check_model(model, full_check=True)
    assert_matches(run_ort(path, feeds), g, state, feeds)
    if name not in QUICK:
        return
    # another batch size through the same symbolic model
    g3 = net.lower(3)
    feeds3 = example_feeds(g3, seed=1)
    assert_matches(run_ort(path, feeds3), g3, state, feeds3)


@pytest.mark.parametrize("name", CHECKED)
def test_big_example_exports_and_checks(name, tmp_path):
    net = load(name)
    zeros = lambda n: np.zeros(n.type.shape, np.float32)  # noqa: E731
    path = tmp_path / "m.onnx"
    r = export_onnx(net.lower(), zeros, path, external=True)  # no 0.5-3.7 GB protobuf
    onnx.checker.check_model(str(path), full_check=True)
    assert r.weights == sum(n.type.numel() for n in net.lower().nodes
                            if n.op in ("param", "buffer"))
    # all but the small tensors (biases, BN statistics), which stay inline (a GPT's
    # smallest, its 768-wide norms, go out too)
    assert r.data_path is not None
    assert 0.99 * r.weight_bytes < r.data_path.stat().st_size <= r.weight_bytes


def test_blocks_are_local_functions(tmp_path):
    net = load("resnet20-cifar.net")
    r = export_onnx(net.lower(), seeded(0), tmp_path / "m.onnx")
    model = onnx.load(tmp_path / "m.onnx")
    main = [(n.name, n.op_type, n.domain) for n in model.graph.node]
    assert [m[0] for m in main] == ["cifar_stem", "basic_stage", "basic_stage[1]",
                                    "basic_stage[2]", "head"]
    assert {m[2] for m in main} == {"netdsl.blocks"}
    funcs = {f.name: f for f in model.functions}
    assert r.functions == len(funcs)
    # one function per distinct body: widths live in the weights' shapes, so the basic
    # blocks have two bodies (identity or projection shortcut), the stages two (the first
    # without a projection)
    assert sorted(funcs) == ["basic", "basic_2", "basic_stage", "basic_stage_2", "cifar_stem",
                             "head", "shortcut"]
    assert [m[1] for m in main] == ["cifar_stem", "basic_stage", "basic_stage_2",
                                    "basic_stage_2", "head"]
    stage2 = funcs["basic_stage_2"]
    assert [(n.name, n.op_type) for n in stage2.node] == [
        ("basic", "basic_2"), ("basic[1]", "basic"), ("basic[2]", "basic")]
    assert [n.name for n in funcs["basic_2"].node] == [
        "conv2d", "batchnorm", "relu", "conv2d_1", "batchnorm_1", "shortcut", "add", "relu_1"]
    conv = next(n for n in funcs["cifar_stem"].node if n.name == "conv2d")
    assert "resnet.net" in conv.doc_string  # the netdsl node's source location


def test_flat_export_keeps_the_blocks_in_node_names(tmp_path):
    net = load("resnet20-cifar.net")
    g = net.lower(2)
    feeds = example_feeds(g)
    state = calibrated_state(g, feeds)
    r = export_onnx(net.lower(), lambda n: state[n.name], tmp_path / "m.onnx", flat=True)
    model = onnx.load(tmp_path / "m.onnx")
    assert r.functions == 0 and not model.functions
    names = [n.name for n in model.graph.node]
    assert "basic_stage[1].basic[2].conv2d_1" in names and "head.linear" in names
    assert_matches(run_ort(tmp_path / "m.onnx", feeds), g, state, feeds)


def test_fixed_batch(tmp_path):
    net = load("digits-cnn.net")
    r = export_onnx(net.lower(), seeded(0), tmp_path / "m.onnx", batch=4)
    assert r.batch == 4
    model = onnx.load(tmp_path / "m.onnx")
    dims = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [4, 1, 8, 8]
    out = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    assert out == [4, 10]


def test_forced_external_data_runs(tmp_path):
    net = load("digits-mlp.net")
    g = net.lower(2)
    feeds = example_feeds(g)
    state = calibrated_state(g, feeds)
    r = export_onnx(net.lower(), lambda n: state[n.name], tmp_path / "m.onnx", external=True)
    assert r.data_path == tmp_path / "m.onnx.data" and r.data_path.stat().st_size > 30_000
    a, b = run_ort(tmp_path / "m.onnx", feeds)[0], netdsl_forward(g, state, feeds)[0]
    assert rel_err(a, b) <= 1e-5


def test_unsupported_operator_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.delitem(onnx_export_ops.EXPORTERS, "relu")
    with pytest.raises(InteropError) as e:
        export_onnx(load("resnet20-cifar.net").lower(), seeded(0), tmp_path / "m.onnx")
    assert "`relu` (cifar_stem.relu, basic_stage.basic.relu, basic_stage.basic.relu_1 ...)" \
        in e.value.message
    assert not (tmp_path / "m.onnx").exists()


def test_network_without_output_is_an_error(tmp_path):
    net = netdsl.loads("network n { input x: f32[N, 4]\n input y: f32[N, 2]\n"
                       " loss mse(linear(x, 2), y) }")
    with pytest.raises(InteropError, match="declares no `output`"):
        export_onnx(net.lower(), seeded(0), tmp_path / "m.onnx")


# -- the command --------------------------------------------------------------------------------

def test_cli_export_with_checkpoint_weights(tmp_path):
    from netdsl.runtime import checkpoint
    ck = tmp_path / "ck"
    res = runner.invoke(app, ["run", "examples/digits-mlp.net", "--steps", "2", "--checkpoint",
                              str(ck), "--json"])
    assert res.exit_code == 0, res.output
    out = tmp_path / "m.onnx"
    res = runner.invoke(app, ["export", "examples/digits-mlp.net", "--onnx", str(out),
                              "--weights", str(ck), "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["network"] == "digits_mlp" and info["batch"] == "N" and info["weights"] == 9610
    arrays, _ = checkpoint.load(ck)
    g = load("digits-mlp.net").lower(5)
    feeds = example_feeds(g)
    state = {k: v for k, v in arrays.items() if k in g}
    assert rel_err(run_ort(out, feeds)[0], netdsl_forward(g, state, feeds)[0]) <= 1e-5
    # trained weights, not the initial ones
    init = seeded(0)(g["mlp.linear.weight"])
    assert not np.allclose(state["mlp.linear.weight"], init)


def test_cli_export_errors(tmp_path):
    out = tmp_path / "m.onnx"
    res = runner.invoke(app, ["export", "examples/digits-mlp.net", "--onnx", str(out),
                              "--weights", str(tmp_path / "nope")])
    assert res.exit_code == 1 and "no checkpoint" in res.output and not out.exists()
    res = runner.invoke(app, ["export", "examples/digits-mlp.net", "--onnx", str(out),
                              "--batch", "0"])
    assert res.exit_code == 1 and "positive integer or `dynamic`" in res.output
    res = runner.invoke(app, ["export", "examples/digits-mlp.net", "--onnx", str(out), "-b", "3"])
    assert res.exit_code == 0 and "batch 3" in res.stdout


def test_cli_says_which_extra_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)  # `import onnx` raises ImportError
    res = runner.invoke(app, ["export", "examples/digits-mlp.net", "--onnx",
                              str(tmp_path / "m.onnx")])
    assert res.exit_code == 1
    assert "pip install 'netdsl[onnx]'" in res.output


def test_docs_list_every_mapped_operator():
    """docs/onnx.md's two operator tables name exactly the export and import tables' keys."""
    import re
    from pathlib import Path

    from netdsl.interop.onnx_import_ops import IMPORTERS
    text = (Path(__file__).resolve().parents[1] / "docs" / "onnx.md").read_text()
    export_part, import_part = text.split("## Import", 1)
    rows = lambda part: [ln.split("|")[1] for ln in part.splitlines()  # noqa: E731
                         if ln.startswith("| ") and not ln.startswith("| netdsl")
                         and not ln.startswith("| ONNX")]
    exported = {op for cell in rows(export_part) for op in re.findall(r"`(\w+)`", cell)}
    assert exported == set(onnx_export_ops.EXPORTERS)
    imported = {op for cell in rows(import_part) for op in re.findall(r"\b([A-Z]\w+)", cell)}
    assert imported == set(IMPORTERS) | {"Constant"}


def test_every_forward_operator_has_an_export_or_a_reason():
    """A new operator needs a line in EXPORTERS (or, for a loss, in NOT_EXPORTED)."""
    from netdsl.ir import registry
    forward = {name for name, op in registry.load_all().items() if op.callable_from_language}
    unmapped = forward - set(onnx_export_ops.EXPORTERS) - set(onnx_export_ops.NOT_EXPORTED)
    assert not unmapped, f"operators with no ONNX export: {sorted(unmapped)}"


def test_dropout_is_the_identity_in_the_export(tmp_path):
    net = netdsl.loads("network d { input x: f32[N, 4]\n"
                       " output dropout(linear(x, 4), 0.5) * dropout_mask(x, 0.3) }")
    g = net.lower(3)
    feeds = example_feeds(g)
    state = calibrated_state(g, feeds)
    export_onnx(net.lower(), lambda n: state[n.name], tmp_path / "m.onnx")
    assert_matches(run_ort(tmp_path / "m.onnx", feeds), g, state, feeds)


def test_fused_batchnorm_relu_and_add_relu_export_as_two_nodes(tmp_path):
    """The fuse pass's batchnorm_relu becomes BatchNormalization + Relu, and add_relu Add +
    Relu, with the outputs of the unfused network."""
    from netdsl.passes.fuse import fuse
    net = load("resnet20-cifar.net")
    g = net.lower(2)
    feeds = example_feeds(g)
    state = calibrated_state(g, feeds)
    fused = fuse(net.lower(), enabled=True)
    assert fused.by_op("batchnorm_relu") and fused.by_op("add_relu")
    export_onnx(fused, lambda n: state[n.name], tmp_path / "m.onnx")
    model = onnx.load(tmp_path / "m.onnx")
    ops = [n.op_type for body in [model.graph, *model.functions] for n in body.node]
    assert "BatchNormalization" in ops and "Relu" in ops and "Add" in ops
    assert_matches(run_ort(tmp_path / "m.onnx", feeds), g, state, feeds)


@pytest.mark.parametrize("example", ["resnet164-cifar", "transformer-tiny"])
def test_products_with_a_residual_export_as_the_layer_and_an_add(tmp_path, example):
    """The fuse pass's conv2d_add and linear_add become Conv (or the linear's MatMul) +
    Add, with the outputs of the unfused network."""
    from netdsl.passes.fuse import fuse
    net = load(f"{example}.net")
    g = net.lower(2)
    feeds = example_feeds(g)
    state = calibrated_state(g, feeds)
    fused = fuse(net.lower(), enabled=True)
    assert fused.by_op("conv2d_add" if example.startswith("resnet") else "linear_add")
    export_onnx(fused, lambda n: state[n.name], tmp_path / "m.onnx")
    model = onnx.load(tmp_path / "m.onnx")
    ops = [n.op_type for body in [model.graph, *model.functions] for n in body.node]
    assert "Add" in ops and ("Conv" in ops or "MatMul" in ops)
    assert_matches(run_ort(tmp_path / "m.onnx", feeds), g, state, feeds)


def test_fused_batchnorm_relu6_exports_as_batchnorm_and_clip(tmp_path):
    """batchnorm_relu with a cap (the fuse pass's relu6(batchnorm(x))) becomes
    BatchNormalization + Clip(0, 6), with the outputs of the unfused network."""
    from netdsl.passes.fuse import fuse
    net = netdsl.loads("network m { input x: f32[N, 3, 6, 6]\n"
                       " h = relu6(batchnorm(conv2d(x, 4, kernel=3, padding=1, bias=false)))\n"
                       " output linear(flatten(h), 3) }")
    g = net.lower(2)
    feeds = example_feeds(g)
    state = calibrated_state(g, feeds)
    fused = fuse(net.lower(), enabled=True)
    assert [n.attrs["cap"] for n in fused.by_op("batchnorm_relu")] == [6.0]
    export_onnx(fused, lambda n: state[n.name], tmp_path / "m.onnx")
    ops = [n.op_type for n in onnx.load(tmp_path / "m.onnx").graph.node]
    assert "BatchNormalization" in ops and "Clip" in ops and "Relu" not in ops
    assert_matches(run_ort(tmp_path / "m.onnx", feeds), g, state, feeds)
