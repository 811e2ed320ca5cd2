"""Spatial (attribute) parallelism: the image height cut into strips with halo exchange
(netdsl/parallel/spatial.py). The equivalence gate on a ResNet, a VGG and a network of
every window shape; which nodes are cut; the gate naming a wrong strip; the strips over
MPI equal to one process; the command line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_split import NETS, runner, setup

from netdsl import api
from netdsl.errors import SplitError
from netdsl.parallel.split import SplitSpec, split_step
from netdsl.runtime.data import Loader, make_dataset
from netdsl.runtime.gate import verify_split
from netdsl_cli.app import app

ROOT = Path(__file__).resolve().parent.parent
MIX = ROOT / "tests" / "nets" / "spatial-mix.net"


def load(path: Path, batch: int):
    """A network, its optimizer and one batch of its file's data."""
    net = api.load(path)
    data = make_dataset(net.graph, net.train.data, 0)
    feeds = dict(zip(data.input_names, Loader(data.train, batch, 0).next(), strict=True))
    return net, net.train.optimizer.model_dump(), feeds


@pytest.mark.parametrize("data, ways", [(1, 2), (1, 4), (2, 2)])
@pytest.mark.parametrize("name", ["resnet20", "vgg", "unet"])
def test_spatial_split_equals_single_device_step(name, data, ways):
    """Alone, and as a hybrid with data parallelism (replica r's strip k on device
    r * ways + k; the VGG's dropout draws each replica's rows of the batch's mask). The
    U-Net is cut whole but for its loss (transposed convolutions, channel concat of the
    skips)."""
    batch = 2 if name == "unet" else 8  # 64 x 64 images: two are enough
    net, opt, feeds = (load(ROOT / "examples" / "unet-small.net", batch) if name == "unet"
                       else setup(name))
    r = verify_split(net.graph, batch, SplitSpec(data=data, spatial=ways), opt, feeds)
    assert r.ok and r.reference == "single-device step"
    assert max(r.loss_rel, r.grad_rel, r.state_rel) <= 1e-9
    assert len(r.comm_bytes) == data * ways and all(v > 0 for v in r.comm_bytes.values())


@pytest.mark.parametrize("ways", [2, 3, 4])
def test_every_window_shape_is_cut_right(ways):
    """Strided, padded, "same", dilated and asymmetric convolutions, padded max and
    average pooling, strided and dilated transposed convolutions, an odd height cut
    unevenly; the nodes that cannot be cut (a ceil-mode
    pool, average pooling that does not count its padding, values lower than the strip
    count) run whole on device 0 and the trunk is cut again after them."""
    net, opt, feeds = load(MIX, 4)
    r = verify_split(net.graph, 4, SplitSpec(spatial=ways), opt, feeds)
    assert r.ok, (r.worst, r.grad_rel, r.first_divergence)
    assert max(r.loss_rel, r.grad_rel, r.state_rel) <= 1e-9
    g = split_step(net.graph, 4, SplitSpec(spatial=ways), opt)
    assert g.meta["spatial_layers"] == [  # (batchnorm + relu fused: the relu's name)
        "conv2d", "relu", "maxpool", "conv2d_1", "conv2d_2", "prelu", "concat",
        "avgpool", "conv2d_3", "sigmoid", "conv_transpose2d", "conv_transpose2d_1"]
    fused = g["relu@s0@d0"]
    assert fused.op == "sync_batchnorm" and fused.attrs["relu"]
    # the stem's strips: 19 output rows cut evenly, each reading its 7x7 windows' rows
    stem = [g[f"conv2d@s{d}@d{d}"] for d in range(ways)]
    assert sum(n.type.shape[2] for n in stem) == 19
    assert max(n.type.shape[2] for n in stem) - min(n.type.shape[2] for n in stem) <= 1
    assert stem[0].attrs["padding"][0] == 3 and stem[-1].attrs["padding"][2] >= 0
    assert all(n.attrs["padding"][0] == 0 for n in stem[1:])


def test_the_gate_names_a_wrong_strip():
    net, opt, feeds = setup("resnet20")
    spec = SplitSpec(spatial=2)
    g = split_step(net.graph, 8, spec, opt)
    victim = next(n for n in g.nodes if n.op == "conv2d" and n.device == 1
                  and "basic_stage[1]" in n.name and n.attrs["padding"][2] == 1)
    top, left, bottom, right = victim.attrs["padding"]
    # the last strip's windows one row too high: same shape, the wrong rows
    victim.attrs["padding"] = (top + 1, left, bottom - 1, right)
    r = verify_split(net.graph, 8, spec, opt, feeds, split=g)
    assert not r.ok
    assert r.first_divergence.startswith(f"%{victim.meta['origin']} (conv2d) at ")


def test_a_network_without_images_cannot_be_cut_by_height():
    net, opt, _ = setup("transformer")
    with pytest.raises(SplitError, match="split by height"):
        split_step(net.graph, 8, SplitSpec(spatial=2), opt)
    with pytest.raises(SplitError, match="always synchronises batchnorm"):
        split_step(setup("vgg")[0].graph, 8, SplitSpec(spatial=2, bn="local"), opt)
    r = runner.invoke(app, ["split", str(NETS["transformer"]), "--devices", "2",
                            "--strategy", "spatial"])
    assert r.exit_code == 3 and "split by height" in r.output and "Traceback" not in r.output


def test_split_command_spatial_json_and_the_files_declaration():
    r = runner.invoke(app, ["split", str(MIX), "--batch", "4", "--verify", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["strategy"] == "spatial" and d["devices"] == 4 and d["verify"]["ok"]
    assert len(d["per_device"]) == 4 and all(p["comm_bytes"] > 0 for p in d["per_device"])
    # every device holds the trunk's parameters; device 0 the head's too
    params = [p["params"] for p in d["per_device"]]
    assert params[0] > params[1] == params[2] == params[3]


def test_run_spatial_on_logical_devices_equals_one_device(tmp_path):
    net = str(ROOT / "examples" / "digits-cnn.net")
    out = {}
    for key, extra in (("one", []), ("two", ["--devices", "2", "--split", "spatial"])):
        log = tmp_path / f"{key}.jsonl"
        r = runner.invoke(app, ["run", net, "--steps", "3", "--eval-samples", "0", "--log",
                                str(log), "--json", *extra])
        assert r.exit_code == 0, r.output
        out[key] = [json.loads(x)["loss"] for x in log.read_text().splitlines()]
    assert out["two"] == pytest.approx(out["one"], rel=1e-5)
