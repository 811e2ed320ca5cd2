"""The stdlib ResNets' zero_init_residual: a 2,504-layer ResNet (resnet2504's depth, blocks
[6, 32, 790, 6], with tiny widths to stay cheap) evaluated right after initialisation
gives finite logits with it, and overflows without it (the problem it solves)."""
from __future__ import annotations

import numpy as np
import pytest

import netdsl
from netdsl.runtime.executor import Executor

DEEP = """
import resnet
network deep {
    input x: f32[N, 3, 32, 32]
    h = resnet.stem(x, 4)
    h = resnet.stage(h, width=1, blocks=6,              zero_init_residual=Z)
    h = resnet.stage(h, width=2, blocks=32,  stride=2,  zero_init_residual=Z)
    h = resnet.stage(h, width=2, blocks=790, stride=2,  zero_init_residual=Z)
    h = resnet.stage(h, width=4, blocks=6,   stride=2,  zero_init_residual=Z)
    output resnet.head(h, 10)
}
"""


def _eval_logits(zero_init: bool) -> np.ndarray:
    net = netdsl.loads(DEEP.replace("Z", str(zero_init).lower()), file="deep.net")
    g = net.lower(batch=2)
    convs = g.by_op("conv2d")
    projections = [n for n in convs if "shortcut" in n.name]
    # 3 x 834 block convolutions + the stem + the classifier, as resnet2504 counts them
    assert len(convs) - len(projections) + len(g.by_op("linear")) == 2504
    ex = Executor(g, "numpy", dtype="f32", seed=0)
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    with np.errstate(all="ignore"):
        return ex.run({"x": x}, training=False, roles=("output",))["output"][0]


def test_a_2504_layer_resnet_is_finite_at_initialisation_with_zero_init_residual():
    logits = _eval_logits(True)
    assert logits.shape == (2, 10) and np.isfinite(logits).all()
    assert np.abs(logits).max() < 1e3


@pytest.mark.slow
def test_without_it_the_activations_overflow():
    assert not np.isfinite(_eval_logits(False)).all()


def test_resnet2504_turns_it_on():
    g = netdsl.load("examples/resnet2504.net").graph
    last_bns = [n for n in g.by_op("batchnorm") if n.attrs["zero_init"]]
    assert len(last_bns) == 6 + 32 + 790 + 6  # one per residual block
    assert all(g[f"{n.name}.weight"].attrs["init"] == "zeros" for n in last_bns)
