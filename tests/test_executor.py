"""The executor (state, accounting, errors), the backends, and the optimizer update nodes
checked against hand-computed SGD and Adam steps."""
from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest

from netdsl.backends import get_backend
from netdsl.errors import CheckpointError, DeviceError, NetdslError, SourceLoc
from netdsl.ir.build import add_op
from netdsl.ir.graph import Graph, Node
from netdsl.ir.types import TensorType
from netdsl.passes.autodiff import autodiff
from netdsl.passes.optimizer import add_optimizer
from netdsl.runtime.executor import Executor


def inp(g, name, shape, dtype="f32", **attrs):
    g.add(Node(name, "input", (), TensorType(shape, dtype),
               {"shape": shape, "dtype": dtype, **attrs}))


def chain(n_layers=3, shape=(4, 8)) -> Graph:
    g = Graph("chain", batch=shape[0])
    inp(g, "x", shape)
    prev = "x"
    for k in range(n_layers):
        add_op(g, f"r{k}", "relu", [prev], {})
        prev = f"r{k}"
    g.outputs = {"output": [prev]}
    return g.verify()


# -- accounting ---------------------------------------------------------------------------
def test_values_are_freed_after_last_use():
    g = chain(3)
    ex = Executor(g, "numpy")
    x = np.ones((4, 8))
    out = ex.run({"x": x})["output"][0]
    assert np.all(out == 1)
    each = 4 * 8 * 4  # f32
    # x, r0, r1, r2 all exist at some point, but never more than two at once
    assert ex.peak_bytes == 2 * each < 4 * each
    assert ex.bytes_current == 0  # no state; outputs belong to the caller


def test_peak_is_exact_for_a_linear_layer():
    g = Graph("lin", batch=2)
    inp(g, "x", (2, 3))
    add_op(g, "fc", "linear", ["x"], {"out_features": 4})
    g.outputs = {"output": ["fc"]}
    ex = Executor(g, "numpy")
    state = (4 * 3 + 4) * 4  # weight and bias, f32
    assert ex.bytes_current == state == ex.peak_bytes
    ex.run({"x": np.ones((2, 3))})
    assert ex.peak_bytes == state + 2 * 3 * 4 + 2 * 4 * 4  # x and the output, together
    assert ex.bytes_current == state
    assert ex.peak_by_device == {0: ex.peak_bytes}
    ex64 = Executor(g, "numpy", dtype="f64")
    ex64.run({"x": np.ones((2, 3))})
    assert ex64.peak_bytes == 2 * ex.peak_bytes


def test_inplace_updates_add_no_bytes():
    g = Graph("reg", batch=2)
    inp(g, "x", (2, 3))
    inp(g, "t", (2, 1))
    add_op(g, "fc", "linear", ["x"], {"out_features": 1, "bias": False})
    add_op(g, "loss", "mse", ["fc", "t"], {})
    g.outputs = {"output": ["fc"], "loss": ["loss"]}
    t = add_optimizer(autodiff(g), "sgd", lr=0.1, momentum=0.9)
    ex = Executor(t, "numpy")
    state = 3 * 4 * 2  # weight and momentum buffer
    assert ex.bytes_current == state
    ex.run({"x": np.ones((2, 3)), "t": np.zeros((2, 1))})
    assert ex.bytes_current == state


# -- errors -------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_check_numerics_names_the_node():
    g = Graph("nan", batch=2)
    inp(g, "x", (2, 2))
    add_op(g, "ok", "relu", ["x"], {})
    add_op(g, "sq", "mul", ["ok", "ok"], {}, loc=SourceLoc("net.net", 4, 9))
    g.outputs = {"output": ["sq"]}
    big = np.full((2, 2), 1e30)  # fine in f32, but its square overflows to inf
    assert np.isinf(Executor(g, "numpy").run({"x": big})["output"][0]).all()
    with pytest.raises(NetdslError) as e:
        Executor(g, "numpy", check_numerics=True).run({"x": big})
    assert "%sq = mul" in str(e.value) and "Inf" in str(e.value)
    assert e.value.loc == SourceLoc("net.net", 4, 9)


def test_kernel_errors_name_the_node():
    g = Graph("bad", batch=2)
    inp(g, "x", (2, 3))
    # a node no shape rule would accept; "unchecked" lets it past verify
    g.add(Node("r", "reshape", ("x",), TensorType((7,)), {"shape": (7,)},
               loc=SourceLoc("net.net", 2, 1), meta={"unchecked": True}))
    g.outputs = {"output": ["r"]}
    with pytest.raises(NetdslError) as e:
        Executor(g, "numpy").run({"x": np.zeros((2, 3))})
    assert "%r = reshape(%x)" in str(e.value) and "ValueError" in str(e.value)
    assert e.value.loc.line == 2
    assert isinstance(e.value.__cause__, ValueError)


def test_feed_errors():
    g = chain(1)
    ex = Executor(g, "numpy")
    with pytest.raises(NetdslError, match="input `x` .* was not fed"):
        ex.run({})
    with pytest.raises(NetdslError, match=r"expects shape \(4, 8\).*\(4, 9\)"):
        ex.run({"x": np.zeros((4, 9))})
    unbound = Graph("u", batch="N")
    inp(unbound, "x", ("N", 3))
    with pytest.raises(NetdslError, match="bind it first"):
        Executor(unbound, "numpy")


# -- state ----------------------------------------------------------------------------------
def cnn(batch=4) -> Graph:
    g = Graph("cnn", batch="N")
    inp(g, "x", ("N", 2, 5, 5))
    inp(g, "y", ("N",), "i64")
    add_op(g, "conv", "conv2d", ["x"], {"out_channels": 3, "kernel": 3})
    add_op(g, "bn", "batchnorm", ["conv"], {})
    add_op(g, "act", "relu", ["bn"], {})
    add_op(g, "flat", "flatten", ["act"], {})
    add_op(g, "fc", "linear", ["flat"], {"out_features": 3})
    add_op(g, "loss", "softmax_cross_entropy", ["fc", "y"], {})
    g.outputs = {"output": ["fc"], "loss": ["loss"]}
    return g.verify()


def cnn_feeds(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, 2, 5, 5)), "y": rng.integers(0, 3, n)}


def test_init_is_seeded_and_follows_torch_conventions():
    g = Graph("init", batch=1)
    for name, init, fan_in in (("kn", "kaiming_normal", 50), ("ku", "kaiming_uniform", 50),
                               ("ub", "uniform_fan_in", 50), ("nm", "normal", 1)):
        g.add(Node(name, "param", (), TensorType((400, 50)),
                   {"shape": (400, 50), "init": init, "fan_in": fan_in}))
    a, b = Executor(g, "numpy", seed=1), Executor(g, "numpy", seed=1)
    c = Executor(g, "numpy", seed=2)
    for k in a.state:
        assert np.array_equal(a.state[k], b.state[k]) and not np.array_equal(a.state[k],
                                                                             c.state[k])
    s = a.state
    assert abs(s["kn"].std() - math.sqrt(2 / 50)) < 0.01 and abs(s["nm"].std() - 1) < 0.02
    bound = 1 / math.sqrt(50)  # nn.Linear: kaiming_uniform_(a=sqrt(5)) gives 1/sqrt(fan_in)
    for k in ("ku", "ub"):
        assert s[k].max() <= bound and s[k].min() >= -bound and s[k].max() > 0.95 * bound
    assert s["kn"].dtype == np.float32


def test_state_dict_round_trip_and_mismatch():
    t = add_optimizer(autodiff(cnn()), "adam").bind(4)
    ex = Executor(t, "numpy", seed=0)
    for _ in range(2):
        ex.run(cnn_feeds(4))
    sd = ex.state_dict()
    assert int(sd["optimizer.step"]) == 2 and "conv.weight.exp_avg" in sd
    fresh = Executor(t, "numpy", seed=5)
    fresh.load_state_dict(sd)
    assert all(np.array_equal(fresh.state_dict()[k], v) for k, v in sd.items())
    a = ex.run(cnn_feeds(4, 1))["loss"][0]
    b = fresh.run(cnn_feeds(4, 1))["loss"][0]
    assert float(a) == float(b)
    bad = dict(sd, **{"fc.weight": np.zeros((1, 1))})
    with pytest.raises(CheckpointError, match="fc.weight"):
        fresh.load_state_dict(bad)
    with pytest.raises(CheckpointError, match="missing"):
        fresh.load_state_dict({"fc.weight": sd["fc.weight"]})


def test_eval_with_a_forward_graph_shares_state():
    g = cnn()
    t = add_optimizer(autodiff(g), "sgd", lr=0.5).bind(4)
    train = Executor(t, "numpy", dtype="f64")
    ev = train.with_graph(g.bind(7))  # another batch size, same parameters
    before = ev.run(cnn_feeds(7), training=False)["output"][0]
    train.run(cnn_feeds(4))
    after = ev.run(cnn_feeds(7), training=False)["output"][0]
    assert not np.allclose(before, after)  # the step is visible through the shared state
    # eval-mode batchnorm uses the running statistics the training step updated
    assert not np.allclose(ev.state["bn.running_mean"], 0)
    # and the training graph itself runs forward-only in eval mode, no labels needed
    out = train.run({"x": cnn_feeds(4)["x"]}, training=False, roles=("output",))
    assert out.keys() == {"output"}


# -- optimizer ----------------------------------------------------------------------------
def regression(n=4):
    """fc(x) with 3 weights and a bias, loss mse against t."""
    g = Graph("reg", batch=n)
    inp(g, "x", (n, 3))
    inp(g, "t", (n, 1))
    add_op(g, "fc", "linear", ["x"], {"out_features": 1})
    add_op(g, "loss", "mse", ["fc", "t"], {})
    g.outputs = {"output": ["fc"], "loss": ["loss"]}
    return g.verify()


def reg_feeds(step):
    rng = np.random.default_rng(step)
    return {"x": rng.standard_normal((4, 3)), "t": rng.standard_normal((4, 1))}


def manual_grads(w, b, feeds):
    x, t = feeds["x"], feeds["t"]
    r = x @ w.T + b - t  # d mean(r^2) = 2 r / n
    return 2 * r.T @ x / r.size, 2 * r.sum(0) / r.size


def run_steps(kind, steps=3, lr_per_step=None, **hyper):
    t = add_optimizer(autodiff(regression()), kind, **hyper)
    ex = Executor(t, "numpy", dtype="f64", seed=0)
    w0, b0 = ex.state["fc.weight"].copy(), ex.state["fc.bias"].copy()
    for s in range(steps):
        feeds = reg_feeds(s)
        if lr_per_step:
            feeds["lr"] = lr_per_step[s]
        ex.run(feeds)
    return ex, w0, b0


@pytest.mark.parametrize("momentum,nesterov,wd", [(0.0, False, 0.0), (0.9, False, 0.01),
                                                  (0.9, True, 0.0)])
def test_sgd_matches_hand_computed_steps(momentum, nesterov, wd):
    lrs = [0.1, 0.05, 0.02]  # fed per step: a schedule without rebuilding the graph
    ex, w, b = run_steps("sgd", lr_per_step=lrs, momentum=momentum, nesterov=nesterov,
                         weight_decay=wd)
    bufs = [np.zeros_like(w), np.zeros_like(b)]
    params = [w, b]
    for s in range(3):
        grads = manual_grads(params[0], params[1], reg_feeds(s))
        for k, gr in enumerate(grads):
            gr = gr + wd * params[k]
            if momentum:
                bufs[k] = gr if s == 0 else momentum * bufs[k] + gr
                gr = gr + momentum * bufs[k] if nesterov else bufs[k]
            params[k] = params[k] - lrs[s] * gr
    assert np.allclose(ex.state["fc.weight"], params[0], rtol=1e-12)
    assert np.allclose(ex.state["fc.bias"], params[1], rtol=1e-12)


@pytest.mark.parametrize("kind,wd", [("adam", 0.0), ("adam", 0.1), ("adamw", 0.1)])
def test_adam_matches_hand_computed_steps(kind, wd):
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    ex, w, b = run_steps(kind, lr=lr, weight_decay=wd)
    params, m, v = [w, b], [0 * w, 0 * b], [0 * w, 0 * b]
    for s in range(1, 4):
        grads = manual_grads(params[0], params[1], reg_feeds(s - 1))
        for k, gr in enumerate(grads):
            p = params[k]
            if kind == "adamw":
                p = p * (1 - lr * wd)
            else:
                gr = gr + wd * p
            m[k] = b1 * m[k] + (1 - b1) * gr
            v[k] = b2 * v[k] + (1 - b2) * gr * gr
            mhat, vhat = m[k] / (1 - b1 ** s), v[k] / (1 - b2 ** s)
            params[k] = p - lr * mhat / (np.sqrt(vhat) + eps)
    assert int(ex.state["optimizer.step"]) == 3
    assert np.allclose(ex.state["fc.weight"], params[0], rtol=1e-10)
    assert np.allclose(ex.state["fc.bias"], params[1], rtol=1e-10)
    assert np.allclose(ex.state["fc.weight.exp_avg"], m[0], rtol=1e-10)


def test_optimizer_graph_shape():
    t = add_optimizer(autodiff(regression()), "adam")
    states = [n for n in t.by_op("buffer") if n.attrs.get("role") == "optimizer_state"]
    assert {n.name for n in states} == {"optimizer.step", "fc.weight.exp_avg",
                                        "fc.weight.exp_avg_sq", "fc.bias.exp_avg",
                                        "fc.bias.exp_avg_sq"}
    assert t["lr"].op == "input" and t["lr"].type == TensorType(())
    assert [t[u].op for u in t.outputs["updates"]] == ["step_increment", "adam_update",
                                                       "adam_update"]
    with pytest.raises(NetdslError, match="no setting momentum"):
        add_optimizer(autodiff(regression()), "adam", momentum=0.9)
    with pytest.raises(NetdslError, match="run autodiff first"):
        add_optimizer(regression(), "sgd")


def test_training_reduces_the_loss_in_f32_and_f64():
    for dtype, np_dtype in (("f32", np.float32), ("f64", np.float64)):
        t = add_optimizer(autodiff(cnn()), "sgd", lr=0.1, momentum=0.9).bind(8)
        ex = Executor(t, "numpy", dtype=dtype, seed=0)
        losses = []
        for _ in range(15):
            res = ex.run(cnn_feeds(8))
            losses.append(float(res["loss"][0]))
        assert res["loss"][0].dtype == np_dtype and res["grads"][0].dtype == np_dtype
        assert losses[-1] < 0.5 * losses[0]


# -- backends -----------------------------------------------------------------------------
def test_backends():
    b = get_backend("numpy")
    assert b.name == "numpy" and b.device == 0
    host = np.arange(3.0)
    dev = b.asarray(host)
    dev[0] = 9
    assert host[0] == 0 and b.to_host(dev)[0] == 9
    r1, r2 = b.rng(3).random((4,), "float32"), b.rng(3).random((4,), "float32")
    assert np.array_equal(r1, r2) and r1.dtype == np.float32
    with pytest.raises(DeviceError, match="unknown backend"):
        get_backend("tpu")


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed")
def test_cupy_missing_is_a_clear_device_error():
    with pytest.raises(DeviceError, match="needs CuPy.*numpy backend"):
        get_backend("cupy")
