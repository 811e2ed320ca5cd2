"""ONNX import without torch: netdsl's own exports and hand-built ONNX models come back as
readable .net files with their weights, give the same outputs as onnxruntime, and train;
unsupported operators are named. (PyTorch's models: test_onnx_import_torch.py.)"""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from _examples import example_feeds, load  # noqa: E402
from _onnx_helpers import assert_matches, calibrated_state, run_ort  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

import netdsl  # noqa: E402
from netdsl.errors import InteropError  # noqa: E402
from netdsl.interop.onnx_export import export_onnx  # noqa: E402
from netdsl.interop.onnx_import import import_onnx  # noqa: E402
from netdsl.runtime import checkpoint  # noqa: E402
from netdsl.runtime.options import RunOptions  # noqa: E402
from netdsl_cli.app import app  # noqa: E402

runner = CliRunner()


def imported_state(r) -> dict:
    arrays, header = checkpoint.load(r.checkpoint)
    assert header["kind"] == "weights" and header["network"] == r.network
    return arrays


def check_against_onnx(onnx_path, r, batch=2, seed=0):
    net = netdsl.load(r.net_path)
    g = net.lower(batch)
    feeds = example_feeds(g, seed)
    got = run_ort(onnx_path, _rename(onnx_path, feeds))
    assert_matches(got, g, imported_state(r), feeds)
    return net, g, feeds


def _rename(onnx_path, feeds):
    """The .net names its one image input `x`; the ONNX model may call it otherwise."""
    import onnx
    names = [i.name for i in onnx.load(str(onnx_path), load_external_data=False).graph.input]
    return {names[0]: feeds["x"]} if len(names) == 1 else feeds


def train_one_step(net_path, ck):
    net = netdsl.load(net_path)
    before = imported_state_from(ck)
    res = netdsl.api.train(net, RunOptions(steps=1, batch=2, checkpoint=str(ck), resume=True))
    assert res.steps == 1 and np.isfinite(res.final_loss)
    after, header = checkpoint.load(ck)
    assert header["step"] == 1 and "kind" not in header  # now a full training checkpoint
    changed = [k for k in before if not np.array_equal(before[k], after[k])]
    assert len(changed) > len(before) // 2  # the parameters moved


def imported_state_from(ck):
    return checkpoint.load(ck)[0]


# -- netdsl's own exports, imported back (no torch needed) ----------------------------------

@pytest.mark.parametrize("name", ["digits-cnn.net", "digits-mlp.net", "resnet20-cifar.net",
                                  "transformer-tiny.net", "gpt-tiny.net",
                                  pytest.param("unet-small.net", marks=pytest.mark.slow),
                                  pytest.param("densenet121.net", marks=pytest.mark.slow),
                                  pytest.param("resnet50.net", marks=pytest.mark.slow)])
def test_round_trip_of_an_example(name, tmp_path):
    src = load(name)
    g = src.lower(2)
    feeds = example_feeds(g)
    state = calibrated_state(g, feeds)
    export_onnx(src.lower(), lambda n: state[n.name], tmp_path / "m.onnx")
    r = import_onnx(tmp_path / "m.onnx", tmp_path / "back.net")
    back = netdsl.load(r.net_path)
    gb = back.lower(2)
    # the same network: parameter count, output shape, and outputs
    assert sum(n.type.numel() for n in gb.params()) == sum(n.type.numel() for n in g.params())
    assert [gb[o].type for o in gb.outputs["output"]] == [g[o].type for o in g.outputs["output"]]
    if name != "resnet50.net":  # (its import is about the folded size; it runs elsewhere)
        ref = run_ort(tmp_path / "m.onnx", feeds)
        first = g.by_op("input")[0].name  # `x` in the imported network
        assert_matches(ref, gb, imported_state(r), {"x": feeds[first]})
    text = r.net_path.read_text()
    if name == "resnet50.net":  # tens of lines, not thousands
        assert r.lines < 60 and text.count("repeat ") >= 4 and "block residual" in text
    if name == "transformer-tiny.net":  # gelu fused back, split back to slices
        assert "gelu(" in text and "erf" not in text and text.count("slice(") == 3
        assert "parameter((32, 64))" in text
    if name == "densenet121.net":
        assert r.lines < 60 and "repeat 23 {" in text
    if name == "gpt-tiny.net":  # the causal attention's Where comes back as the mask
        assert text.count("softmax(causal_mask(") == 1 and "block residual" in text
    if name == "unet-small.net":
        assert text.count("conv_transpose2d(") == 3 and text.count("concat(") == 3


def test_not_an_onnx_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00garbage")
    res = runner.invoke(app, ["import", str(bad), "-o", str(tmp_path / "m.net")])
    assert res.exit_code == 1 and "not a readable ONNX model" in res.output
    with pytest.raises(InteropError, match="does not exist"):
        import_onnx(tmp_path / "missing.onnx", tmp_path / "m.net")


def _tiny_model(path, ops):
    """x [N, 4] through a Gemm, then the given single-input ONNX ops (by op type)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    w = numpy_helper.from_array(np.ones((3, 4), np.float32), "w")
    nodes = [helper.make_node("Gemm", ["x", "w"], ["v0"], name="fc", transB=1)]
    for k, op in enumerate(ops):
        nodes.append(helper.make_node(op, [f"v{k}"], [f"v{k + 1}"], name=f"n{k}_{op.lower()}"))
    g = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                        ["B", 4])],
                          [helper.make_tensor_value_info(f"v{len(ops)}", TensorProto.FLOAT,
                                                         ["B", 3])], initializer=[w])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)


def test_every_unsupported_node_is_named_in_one_error(tmp_path):
    _tiny_model(tmp_path / "m.onnx", ["Relu", "Hardmax", "Softsign", "Hardmax", "Sigmoid"])
    res = runner.invoke(app, ["import", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.net"),
                              "--json"])
    assert res.exit_code == 1
    msg = json.loads(res.stdout)["errors"][0]["message"]
    assert "Hardmax (2 nodes: n1_hardmax, n3_hardmax)" in msg
    assert "Softsign (node: n2_softsign)" in msg and "Relu" not in msg
    assert list(tmp_path.iterdir()) == [tmp_path / "m.onnx"]


def test_import_then_train_from_the_cli(tmp_path):
    _tiny_model(tmp_path / "m.onnx", ["Relu", "Sigmoid"])
    res = runner.invoke(app, ["import", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.net")])
    assert res.exit_code == 0, res.output
    assert "train it: netdsl run" in res.stdout
    text = (tmp_path / "m.net").read_text()
    assert "input x: f32[N, 4]" in text and "sigmoid(relu(linear(x, 3, bias=false)))" in text
    import shutil
    shutil.copytree(tmp_path / "m.ckpt", tmp_path / "m64.ckpt")
    # the imported weights evaluate as they are (no training step: `step` is null)
    res = runner.invoke(app, ["eval", str(tmp_path / "m.net"), "--checkpoint",
                              str(tmp_path / "m.ckpt"), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["step"] is None
    res = runner.invoke(app, ["run", str(tmp_path / "m.net"), "--checkpoint",
                              str(tmp_path / "m.ckpt"), "--resume", "--steps", "2", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["steps"] == 2
    # float32 weights start a float64 run too (a weights checkpoint fixes no dtype)
    res = runner.invoke(app, ["run", str(tmp_path / "m.net"), "--checkpoint",
                              str(tmp_path / "m64.ckpt"), "--resume", "--steps", "1",
                              "--dtype", "f64", "--json"])
    assert res.exit_code == 0, res.output


def test_a_reimport_replaces_neither_training_nor_edits(tmp_path):
    """Re-importing over the files of an import is fine; over a checkpoint a run has
    trained in, or a .net file the user edited, it is refused (exit 1, nothing written)
    unless --overwrite."""
    _tiny_model(tmp_path / "m.onnx", ["Relu"])
    args = ["import", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.net")]
    assert runner.invoke(app, args).exit_code == 0
    assert runner.invoke(app, args).exit_code == 0  # the same files again
    res = runner.invoke(app, ["run", str(tmp_path / "m.net"), "--checkpoint",
                              str(tmp_path / "m.ckpt"), "--resume", "--steps", "2"])
    assert res.exit_code == 0, res.output
    trained = (tmp_path / "m.ckpt" / "checkpoint.npz").read_bytes()
    res = runner.invoke(app, args)
    assert res.exit_code == 1
    assert (f"--checkpoint {tmp_path / 'm.ckpt'} already holds a training checkpoint (network "
            "`m`, step 2); give --overwrite") in " ".join(res.output.split())
    assert (tmp_path / "m.ckpt" / "checkpoint.npz").read_bytes() == trained
    net = tmp_path / "m.net"
    net.write_text(net.read_text().replace("batch     = 8", "batch     = 4"))
    res = runner.invoke(app, [*args, "--checkpoint", str(tmp_path / "fresh")])
    assert res.exit_code == 1 and "m.net already exists and is not what this import" in \
        " ".join(res.output.split())
    assert "batch     = 4" in net.read_text() and not (tmp_path / "fresh").exists()
    assert runner.invoke(app, [*args, "--overwrite"]).exit_code == 0
    assert "batch     = 8" in net.read_text()
    assert checkpoint.load(tmp_path / "m.ckpt")[1]["kind"] == "weights"


def test_weights_checkpoint_of_another_network_is_refused(tmp_path):
    _tiny_model(tmp_path / "m.onnx", ["Relu"])
    import_onnx(tmp_path / "m.onnx", tmp_path / "m.net", tmp_path / "ck")
    res = runner.invoke(app, ["run", "examples/digits-mlp.net", "--checkpoint",
                              str(tmp_path / "ck"), "--resume", "--steps", "1"])
    assert res.exit_code == 1 and "belongs to network `m`" in res.output


def test_import_says_which_extra_to_install(tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "onnx", None)  # `import onnx` raises ImportError
    res = runner.invoke(app, ["import", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.net"),
                              "--json"])
    assert res.exit_code == 1
    assert "pip install 'netdsl[onnx]'" in json.loads(res.stdout)["errors"][0]["message"]


def test_file_names_become_valid_network_names(tmp_path):
    _tiny_model(tmp_path / "m.onnx", ["Relu"])
    r = import_onnx(tmp_path / "m.onnx", tmp_path / "network.net")
    assert r.network == "network_"
    r = import_onnx(tmp_path / "m.onnx", tmp_path / "3-layer net.net")
    assert r.network == "net_3_layer_net"
    assert netdsl.load(r.net_path).name == "net_3_layer_net"


def test_two_inputs_two_outputs_no_loss_and_back_out(tmp_path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    w = numpy_helper.from_array(np.random.default_rng(0).random((5, 4), np.float32), "w")
    nodes = [helper.make_node("Add", ["a", "b"], ["s"], name="sum"),
             helper.make_node("Gemm", ["s", "w"], ["o1"], name="fc", transB=1),
             helper.make_node("Relu", ["o1"], ["o2"], name="act"),
             helper.make_node("Sigmoid", ["s"], ["o3"], name="sig")]
    vi = lambda n, d: helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", d])  # noqa: E731
    g = helper.make_graph(nodes, "multi", [vi("a", 4), vi("b", 4)], [vi("o2", 5), vi("o3", 4)],
                          initializer=[w])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]),
              tmp_path / "m.onnx")
    res = runner.invoke(app, ["import", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.net")])
    assert res.exit_code == 0 and "no loss was added" in res.stdout
    text = (tmp_path / "m.net").read_text()
    assert "input in_a: f32[N, 4]" in text and "output out, out2" in text and "loss" not in text
    res = runner.invoke(app, ["export", str(tmp_path / "m.net"), "--onnx", str(tmp_path / "b.onnx"),
                              "--weights", str(tmp_path / "m.ckpt")])
    assert res.exit_code == 0, res.output
    rng = np.random.default_rng(1)
    feeds = {"a": rng.standard_normal((3, 4)), "b": rng.standard_normal((3, 4))}
    want = run_ort(tmp_path / "m.onnx", feeds)
    got = run_ort(tmp_path / "b.onnx", {"in_a": feeds["a"], "in_b": feeds["b"]})
    for x, y in zip(got, want):
        assert np.abs(x - y).max() <= 1e-6 * np.abs(y).max()


def test_split_becomes_slices(tmp_path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    sizes = numpy_helper.from_array(np.array([2, 4], np.int64), "sizes")
    nodes = [helper.make_node("Split", ["x", "sizes"], ["p", "q"], name="split", axis=1),
             helper.make_node("Tanh", ["p"], ["tp"], name="t"),
             helper.make_node("Concat", ["q", "tp"], ["y"], name="cat", axis=1)]
    g = helper.make_graph(nodes, "sp", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                      ["B", 6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 6])],
                          initializer=[sizes])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]),
              tmp_path / "m.onnx")
    r = import_onnx(tmp_path / "m.onnx", tmp_path / "m.net")
    text = r.net_path.read_text()
    assert "slice(x, 1, 0, 2)" in text and "slice(x, 1, 2, 6)" in text
    g2 = netdsl.load(r.net_path).lower(3)
    feeds = {"x": np.random.default_rng(0).standard_normal((3, 6))}
    assert_matches(run_ort(tmp_path / "m.onnx", feeds), g2, {}, feeds)
