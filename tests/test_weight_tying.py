"""Weight tying: `linear(h, V, bias=false, weight=e.weight)` uses the embedding's table as
the output projection. One parameter, gradients summed over both uses (checked against
PyTorch with `decoder.weight = encoder.weight`, and against finite differences)."""
from __future__ import annotations

import numpy as np
import pytest
from test_errors import fails

import netdsl
from netdsl.passes.autodiff import autodiff
from netdsl.runtime.executor import Executor
from netdsl.runtime.options import RunOptions
from netdsl.runtime.trainer import Trainer

LM = """
network lm {
    input ids: i64[N, 5]
    input y: i64[N, 5]
    e = embedding(ids, 11, 4)
    h = tanh(linear(e, 4))
    logits = linear(h, 11, bias=false, weight=e.weight)
    output logits
    loss softmax_cross_entropy(reshape(logits, (-1, 11)), reshape(y, (-1,)))
}
train { data = synthetic(samples=32, test_samples=0); batch = 8; steps = 3 }
"""


def _graph_and_state(batch=3, seed=0):
    net = netdsl.loads(LM, file="lm.net")
    t = autodiff(net.lower(batch))
    ex = Executor(t, "numpy", dtype="f64", seed=seed)
    rng = np.random.default_rng(seed)
    feeds = {"ids": rng.integers(0, 11, (batch, 5)), "y": rng.integers(0, 11, (batch, 5))}
    return net, t, ex, feeds


def test_one_parameter_two_uses():
    net, t, ex, feeds = _graph_and_state()
    params = [n.name for n in net.graph.nodes if n.op == "param"]
    assert params.count("embedding.weight") == 1 and "linear_1.weight" not in params
    users = [n.name for n in net.graph.nodes if "embedding.weight" in n.inputs]
    assert users == ["embedding", "linear_1"]
    assert net.graph["linear_1"].inputs == ("tanh", "embedding.weight")
    # counted once: 11 * 4 (table) + 4 * 4 + 4 (hidden linear)
    from netdsl.ir.stats import summarize
    assert summarize(net.lower(2)).params == 11 * 4 + 4 * 4 + 4


def test_tied_gradient_matches_pytorch():
    torch = pytest.importorskip("torch")
    net, t, ex, feeds = _graph_and_state()
    res = ex.run(feeds, training=True)
    grads = {t.meta["grad_of"][g]: v for g, v in zip(t.outputs["grads"], res["grads"])}
    enc = torch.nn.Embedding(11, 4).double()
    dec = torch.nn.Linear(4, 11, bias=False).double()
    dec.weight = enc.weight  # PyTorch's weight tying: one Parameter, two modules
    hid = torch.nn.Linear(4, 4).double()
    with torch.no_grad():
        enc.weight.copy_(torch.tensor(ex.state["embedding.weight"]))
        hid.weight.copy_(torch.tensor(ex.state["linear.weight"]))
        hid.bias.copy_(torch.tensor(ex.state["linear.bias"]))
    ids, y = torch.tensor(feeds["ids"]), torch.tensor(feeds["y"])
    logits = dec(torch.tanh(hid(enc(ids))))
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), y.reshape(-1))
    loss.backward()
    np.testing.assert_allclose(res["loss"][0], loss.item(), rtol=1e-10)
    np.testing.assert_allclose(grads["embedding.weight"], enc.weight.grad.numpy(),
                               rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(grads["linear.weight"], hid.weight.grad.numpy(), rtol=1e-8,
                               atol=1e-12)
    # the sum of both uses' contributions, not the output projection's alone
    enc.weight.grad = None
    logits = torch.tanh(hid(enc(ids).detach())) @ enc.weight.T
    torch.nn.functional.cross_entropy(logits.reshape(-1, 11), y.reshape(-1)).backward()
    assert not np.allclose(grads["embedding.weight"], enc.weight.grad.numpy(), atol=1e-8)


def test_tied_gradient_matches_finite_differences():
    net, t, ex, feeds = _graph_and_state()
    res = ex.run(feeds, training=True)
    grads = {t.meta["grad_of"][g]: v for g, v in zip(t.outputs["grads"], res["grads"])}
    w = ex.state["embedding.weight"]
    rng = np.random.default_rng(1)
    for _ in range(6):
        i, j = rng.integers(0, 11), rng.integers(0, 4)
        old = w[i, j]
        w[i, j] = old + 1e-6
        up = float(ex.run(feeds, training=True, roles=("loss",))["loss"][0])
        w[i, j] = old - 1e-6
        down = float(ex.run(feeds, training=True, roles=("loss",))["loss"][0])
        w[i, j] = old
        assert grads["embedding.weight"][i, j] == pytest.approx((up - down) / 2e-6,
                                                                rel=1e-5, abs=1e-9)


def test_a_tied_network_trains():
    net = netdsl.loads(LM, file="lm.net")
    r = Trainer(net.graph, net.train, RunOptions()).fit()
    assert r.steps == 3 and np.isfinite(r.final_loss)


def test_a_free_parameter_can_be_shared_too():
    src = """
network n {
    input x: f32[N, 4]
    w = parameter((4, 4))
    a = linear(x, 4, bias=false, weight=w)
    b = linear(a, 4, bias=false, weight=w)
    output b
}
"""
    g = netdsl.loads(src, file="n.net").graph
    assert g["linear"].inputs[1] == g["linear_1"].inputs[1] == "parameter"


@pytest.mark.parametrize("call,phrase,col", [
    ("linear(h, 7, bias=false, weight=e.weight)",
     "the shared `weight` (embedding.weight) is f32[11, 4], but this call needs a weight of "
     "f32[7, 4]", 39),
    ("linear(h, 11, scale=e.weight)", "linear has no parameter `scale` to share", 28),
    ("linear(h, 11, weight=h)", "linear() has no argument `weight`", 28),
])
def test_tying_mistakes_are_located(call, phrase, col):
    src = LM.replace("linear(h, 11, bias=false, weight=e.weight)", call)
    e = fails(src)
    assert phrase in e.message
    assert (e.loc.line, e.loc.column) == (6, col)
