"""Every example loads, and the models with published sizes have exactly those sizes.

The reference figures: torchvision's resnet50 / resnet152 / vgg16 / densenet121 (their
model cards), He et al.'s CIFAR pre-activation ResNet-164 / ResNet-1001 and ResNet-20
with projection shortcuts (the common re-implementations), and the hand counts written in
each example's header. tests/test_torch_counts.py rebuilds the same models in PyTorch.
"""
import pytest
from _examples import EXAMPLES, ROOT, load, n_params

PARAMS = {
    "resnet50.net": 25_557_032,
    "resnet152.net": 60_192_808,
    "resnet2504.net": 922_870_056,
    "resnet164-cifar.net": 1_703_258,
    "resnet1001-cifar.net": 10_327_706,
    "resnet20-cifar.net": 272_474,        # projection (1x1 conv + BN) shortcuts
    "vgg16.net": 138_357_544,
    "densenet121.net": 7_978_856,
    "digits-mlp.net": 9_610,              # 64*128+128 + 128*10+10
    "digits-cnn.net": 9_978,              # 144 + 32 + 4,608 + 64 + 5,130
    "transformer-tiny.net": 119_178,      # 16,384 + 2,048 + 2 x 49,984 + 128 + 650
    "mobilenet_v2.net": 3_504_872,        # torchvision mobilenet_v2
    "squeezenet1_1.net": 1_235_496,       # torchvision squeezenet1_1
    "unet-small.net": 482_466,            # the sum in the example's header
    "gpt-tiny.net": 110_400,              # 4,096 + 2,048 + 2 x 49,984 + 128 + 4,160
    # 6,291,456 + 49,152 + 12 x 7,087,872 + 1,536 + 6,299,648
    "gpt-100m.net": 97_696_256,
    # 16,777,216 + 2,097,152 + 20 x 50,358,272 + 4,096 + 16,785,408
    "gpt-1b.net": 1_042_829_312,
}

CONVS = {
    "resnet2504.net": 2_507,
    "resnet50.net": 53,
    "resnet152.net": 155,
    "resnet164-cifar.net": 166,           # 1 + 3 x 18 x 3 + 3 projections
    "resnet1001-cifar.net": 1_003,
    "resnet20-cifar.net": 21,
    "vgg16.net": 13,
    "densenet121.net": 120,
}


def test_every_model_with_a_figure_is_an_example():
    names = {p.name for p in EXAMPLES}
    assert set(PARAMS) <= names
    assert set(CONVS) <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_loads(path):
    net = load(path.name)
    g = net.graph
    assert g.batch == "N"
    assert g.output("output"), "every example declares an output"
    assert g.output("loss"), "every example declares a loss"
    assert net.train is not None, "every example has a train section"


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_parameter_count(name):
    assert n_params(load(name).graph) == PARAMS[name]


@pytest.mark.parametrize("name", sorted(CONVS))
def test_conv_count(name):
    assert len(load(name).graph.by_op("conv2d")) == CONVS[name]


def test_shapes_of_the_heads():
    assert str(load("resnet164-cifar.net").graph.output()[0].type) == "f32[N, 10]"
    g = load("vgg16.net").graph
    flat = g.by_op("flatten")[0]
    assert str(flat.type) == "f32[N, 25088]"                       # 512 x 7 x 7
    assert str(load("densenet121.net").graph.by_op("linear")[0].type) == "f32[N, 1000]"
    assert len(load("vgg16.net").graph.by_op("dropout")) == 2
    assert len(load("densenet121.net").graph.by_op("concat")) == 6 + 12 + 24 + 16


def test_digits_inputs_match_the_data():
    cnn, mlp = load("digits-cnn.net"), load("digits-mlp.net")
    assert str(cnn.graph["x"].type) == "f32[N, 1, 8, 8]" and cnn.train.data.image
    assert str(mlp.graph["x"].type) == "f32[N, 64]" and not mlp.train.data.image
    for net in (cnn, mlp):
        assert net.train.data.kind == "digits"
        assert net.train.epochs or net.train.steps


def test_transformer_tiny():
    net = load("transformer-tiny.net")
    g = net.graph
    assert str(g["tokens"].type) == "i64[N, 32]"
    assert len(g.by_op("softmax")) == 2 and len(g.by_op("matmul")) == 4
    assert str(g.by_op("softmax")[0].type) == "f32[N, 4, 32, 32]"   # heads x T x T
    assert net.train.optimizer.kind == "adamw"


def test_resnet2504_parses_checks_and_lowers():
    """The flagship end to end (timing is bench/bench_frontend.py's job)."""
    net = load("resnet2504.net")
    g = net.lower(batch=16).verify()
    assert g.batch == 16
    assert len(g.by_op("conv2d")) == 2_507
    assert n_params(g) == 922_870_056
    assert str(g.output()[0].type) == "f32[16, 1000]"


def test_gpt_tiny_learns_the_synthetic_next_token_task():
    """The causal decoder learns the built-in next-token task: from about log(64) = 4.16
    to well under that within a dozen small steps."""
    import numpy as np

    from netdsl.runtime.options import RunOptions
    from netdsl.runtime.trainer import Trainer
    net = load("gpt-tiny.net")
    train = net.train.model_copy(update={"data": net.train.data.model_copy(
        update={"samples": 128, "test_samples": 0})})
    r = Trainer(net.graph, train, RunOptions(steps=12, batch=4)).fit()
    first, last = np.mean(r.losses[:3]), np.mean(r.losses[-3:])
    assert first > 3.5 and last < 0.6 * first, (first, last)


def test_unet_blocks_train_on_dense_labels(tmp_path):
    """unet-small's blocks on 16x16 images (the example's 64x64 is too slow for a unit
    test): per-pixel labels (synthetic: a fixed projection of each pixel's channels) flow
    through the [N, classes, H, W] scores (classes at dim 1), and a few steps lower the
    loss."""
    import numpy as np

    import netdsl
    from netdsl.runtime.options import RunOptions
    from netdsl.runtime.trainer import Trainer
    src = (ROOT / "examples" / "unet-small.net").read_text()
    src = src.replace("64, 64]", "16, 16]").replace("depth=3", "depth=2")
    p = tmp_path / "unet16.net"
    p.write_text(src)
    net = netdsl.load(p)
    assert net.graph.output("output")[0].type.shape == ("N", 2, 16, 16)
    train = net.train.model_copy(update={"data": net.train.data.model_copy(
        update={"samples": 16, "test_samples": 4})})
    r = Trainer(net.graph, train, RunOptions(steps=6, batch=2)).fit()
    assert np.isfinite(r.losses).all() and np.mean(r.losses[-2:]) < np.mean(r.losses[:2])
    assert r.test_accuracy is not None  # measured per pixel


def test_synthetic_next_token_data_is_the_shifted_sequence():
    from netdsl.runtime.data import make_dataset
    net = load("gpt-tiny.net")
    x, y = make_dataset(net.graph, net.train.data, 0).train.arrays
    assert x.shape == y.shape == (512, 32) and 0 <= x.min() and x.max() < 64
    assert (y[:, :-1] == x[:, 1:]).all()
    # a fixed successor table: each token is always followed by the same one
    nxt = {}
    for a, b in zip(x.reshape(-1), y.reshape(-1)):
        assert nxt.setdefault(int(a), int(b)) == b
