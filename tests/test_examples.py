"""Every example loads, and the models with published sizes have exactly those sizes.

The reference figures: torchvision's resnet50 / resnet152 / vgg16 / densenet121 (their
model cards), He et al.'s CIFAR pre-activation ResNet-164 / ResNet-1001 and ResNet-20
with projection shortcuts (the common re-implementations), and the hand counts written in
each example's header. tests/test_torch_counts.py rebuilds the same models in PyTorch.
"""
import pytest
from _examples import EXAMPLES, load, n_params

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
