"""Forward and backward of every operator against PyTorch in float64, plus batchnorm's
running statistics and the optimizers against torch.optim (skipped without torch)."""
from __future__ import annotations

import numpy as np
import pytest
from gradcheck import op_graph, random_feeds, randomise_params
from hypothesis import given, settings
from hypothesis import strategies as st

from netdsl.passes.autodiff import autodiff
from netdsl.passes.optimizer import add_optimizer
from netdsl.runtime.executor import Executor

torch = pytest.importorskip("torch")
F = torch.nn.functional
pytestmark = pytest.mark.torch


def _pool_stride(a):
    return a["stride"] if a["stride"] is not None else a["kernel"]


TORCH = {
    "conv2d": lambda t, a: F.conv2d(t["in0"], t["out.weight"], t.get("out.bias"), a["stride"],
                                    a["padding"], a["dilation"], a["groups"]),
    "maxpool": lambda t, a: F.max_pool2d(t["in0"], a["kernel"], _pool_stride(a), a["padding"]),
    "avgpool": lambda t, a: F.avg_pool2d(t["in0"], a["kernel"], _pool_stride(a), a["padding"],
                                         count_include_pad=True),
    "global_avgpool": lambda t, a: t["in0"].mean((2, 3), keepdim=True),
    "relu": lambda t, a: F.relu(t["in0"]),
    "leaky_relu": lambda t, a: F.leaky_relu(t["in0"], a["slope"]),
    "gelu": lambda t, a: F.gelu(t["in0"]),
    "sigmoid": lambda t, a: torch.sigmoid(t["in0"]),
    "tanh": lambda t, a: torch.tanh(t["in0"]),
    "add": lambda t, a: t["in0"] + t["in1"],
    "sub": lambda t, a: t["in0"] - t["in1"],
    "mul": lambda t, a: t["in0"] * t["in1"],
    "scale": lambda t, a: t["in0"] * a["factor"],
    "mean": lambda t, a: t["in0"].mean(a["axis"], keepdim=a["keepdims"]),
    "softmax": lambda t, a: torch.softmax(t["in0"], a["axis"]),
    "linear": lambda t, a: F.linear(t["in0"], t["out.weight"], t.get("out.bias")),
    "matmul": lambda t, a: torch.matmul(t["in0"], t["in1"]),
    "embedding": lambda t, a: F.embedding(t["in0"], t["out.weight"]),
    "softmax_cross_entropy": lambda t, a: F.cross_entropy(
        t["in0"].reshape(-1, t["in0"].shape[-1]), t["in1"].reshape(-1)),
    "mse": lambda t, a: F.mse_loss(t["in0"], t["in1"]),
    "batchnorm": lambda t, a: F.batch_norm(
        t["in0"], t["out.running_mean"], t["out.running_var"], t.get("out.weight"),
        t.get("out.bias"), training=True, momentum=a["momentum"], eps=a["eps"]),
    "layernorm": lambda t, a: F.layer_norm(t["in0"], t["in0"].shape[-1:], t.get("out.weight"),
                                           t.get("out.bias"), a["eps"]),
    "flatten": lambda t, a: torch.flatten(t["in0"], a["start"]),
    "reshape": lambda t, a: t["in0"].reshape(a["shape"]),
    "permute": lambda t, a: t["in0"].permute(a["dims"]),
    "transpose": lambda t, a: t["in0"].transpose(a["dim0"], a["dim1"]),
    "concat": lambda t, a: torch.cat([t["in0"], t["in1"]], a["axis"]),
    "slice": lambda t, a: t["in0"].narrow(a["axis"], a["start"], a["stop"] - a["start"]),
}

CASES = [
    ("conv2d", [(2, 4, 7, 6)], {"out_channels": 6, "kernel": 3, "stride": 2, "padding": 1,
                                "groups": 2}, {}),
    ("conv2d", [(1, 3, 9, 9)], {"out_channels": 2, "kernel": (3, 2), "dilation": 2,
                                "bias": False}, {}),
    ("conv2d", [(2, 3, 4, 4)], {"out_channels": 5, "kernel": 1}, {}),
    ("conv2d", [(1, 4, 5, 5)], {"out_channels": 4, "kernel": 3, "groups": 4, "padding": 2,
                                "stride": (1, 2)}, {}),
    ("maxpool", [(2, 3, 7, 7)], {"kernel": 3, "stride": 2, "padding": 1}, {}),
    ("maxpool", [(1, 2, 4, 6)], {"kernel": 2}, {}),
    ("avgpool", [(2, 3, 7, 7)], {"kernel": 3, "stride": 2, "padding": 1}, {}),
    ("avgpool", [(1, 2, 4, 6)], {"kernel": 2}, {}),
    ("global_avgpool", [(2, 3, 4, 5)], {}, {}),
    ("relu", [(3, 5)], {}, {}), ("leaky_relu", [(3, 5)], {"slope": 0.2}, {}),
    ("gelu", [(3, 5)], {}, {}), ("sigmoid", [(3, 5)], {}, {}), ("tanh", [(3, 5)], {}, {}),
    ("add", [(2, 3, 4), (3, 1)], {}, {}), ("sub", [(4,), (2, 3, 4)], {}, {}),
    ("mul", [(2, 1, 4), (3, 1)], {}, {}), ("scale", [(2, 3)], {"factor": -1.5}, {}),
    ("mean", [(2, 3, 4)], {"axis": 1, "keepdims": True}, {}),
    ("mean", [(2, 3, 4)], {"axis": -1}, {}),
    ("softmax", [(2, 3, 4)], {"axis": 1}, {}),
    ("linear", [(2, 3, 4)], {"out_features": 5}, {}),
    ("linear", [(3, 4)], {"out_features": 2, "bias": False}, {}),
    ("matmul", [(2, 3, 4), (4, 5)], {}, {}), ("matmul", [(2, 1, 3, 4), (3, 4, 2)], {}, {}),
    ("embedding", [(2, 5)], {"num": 4, "dim": 3}, {0: 4}),
    ("softmax_cross_entropy", [(5, 4), (5,)], {}, {1: 4}),
    ("softmax_cross_entropy", [(2, 3, 4), (2, 3)], {}, {1: 4}),
    ("mse", [(3, 4), (3, 4)], {}, {}),
    ("batchnorm", [(4, 3, 2, 3)], {"momentum": 0.3}, {}),
    ("batchnorm", [(5, 3)], {"affine": False}, {}),
    ("layernorm", [(2, 3, 5)], {}, {}), ("layernorm", [(4, 5)], {"affine": False}, {}),
    ("flatten", [(2, 3, 2, 2)], {"start": 2}, {}), ("reshape", [(2, 6)], {"shape": (3, 2, 2)}, {}),
    ("permute", [(2, 3, 4)], {"dims": (2, 0, 1)}, {}),
    ("transpose", [(2, 3, 4)], {"dim0": 0, "dim1": 2}, {}),
    ("concat", [(2, 3, 4), (2, 1, 4)], {"axis": 1}, {}),
    ("slice", [(2, 5, 3)], {"axis": 1, "start": 1, "stop": 4}, {}),
]


def compare_with_torch(op, shapes, attrs, ints, seed=0):
    g = op_graph(op, shapes, attrs, ints)
    t = autodiff(g)
    ex = Executor(t, "numpy", dtype="f64", seed=seed)
    rng = np.random.default_rng(seed)
    randomise_params(ex, rng)
    for name in ex.state:  # positive running variances, as BN keeps them
        if name.endswith("running_var"):
            ex.state[name][...] = rng.uniform(0.5, 2.0, ex.state[name].shape)
    feeds = random_feeds(t, rng)
    tens = {k: torch.tensor(v.copy(), requires_grad=t[k].op == "param")
            for k, v in ex.state.items()}
    tens.update({k: torch.tensor(v) for k, v in feeds.items() if k != "r"})
    res = ex.run(feeds, training=True)
    out = TORCH[op](tens, t["out"].attrs)
    loss = out if out.dim() == 0 else (out * torch.tensor(feeds["r"])).mean()
    loss.backward()
    np.testing.assert_allclose(res["output"][0], out.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(res["loss"][0], loss.detach().numpy(), rtol=1e-10, atol=1e-14)
    for gname, grad in zip(t.outputs["grads"], res["grads"], strict=True):
        p = t.meta["grad_of"][gname]
        np.testing.assert_allclose(grad, tens[p].grad.numpy(), rtol=1e-8, atol=1e-12,
                                   err_msg=f"{op}: gradient of {p}")
    for name, v in ex.state.items():  # batchnorm updates its running statistics in place
        if "running" in name:
            np.testing.assert_allclose(v, tens[name].numpy(), rtol=1e-12, err_msg=name)


@pytest.mark.parametrize("op,shapes,attrs,ints", CASES,
                         ids=[f"{c[0]}-{k}" for k, c in enumerate(CASES)])
def test_op_matches_torch(op, shapes, attrs, ints):
    compare_with_torch(op, shapes, attrs, ints)


def test_every_op_has_a_torch_case():
    from test_ops_grad import COVERED
    # dropout is random; the transfers are copies with no torch op to compare against
    assert COVERED - {"dropout", "to_host", "to_device"} == set(TORCH) == {c[0] for c in CASES}


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 2), st.integers(1, 3), st.integers(1, 2), st.integers(0, 2),
       st.integers(1, 2), st.integers(1, 2), st.integers(0, 3), st.booleans())
def test_conv2d_matches_torch_on_random_geometry(groups, k, s, p, d, cmul, extra, bias):
    eff = d * (k - 1) + 1
    size = max(1, eff - 2 * p) + extra
    compare_with_torch("conv2d", [(2, groups * cmul, size, size + 1)],
                       {"out_channels": groups * 2, "kernel": k, "stride": s, "padding": p,
                        "dilation": d, "groups": groups, "bias": bias}, {})


def regression_graph():
    from test_executor import regression
    return regression()


@pytest.mark.parametrize("kind,hyper,make", [
    ("sgd", {"lr": 0.1}, lambda ps: torch.optim.SGD(ps, lr=0.1)),
    ("sgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)),
    ("sgd", {"lr": 0.05, "momentum": 0.8, "nesterov": True},
     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True)),
    ("adam", {"lr": 0.01, "weight_decay": 0.1},
     lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1)),
    ("adamw", {"lr": 0.01, "weight_decay": 0.1, "beta1": 0.8},
     lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, betas=(0.8, 0.999))),
])
def test_optimizers_match_torch_optim(kind, hyper, make):
    from test_executor import reg_feeds
    t = add_optimizer(autodiff(regression_graph()), kind, **hyper)
    ex = Executor(t, "numpy", dtype="f64", seed=0)
    lin = torch.nn.Linear(3, 1).double()
    with torch.no_grad():
        lin.weight.copy_(torch.tensor(ex.state["fc.weight"]))
        lin.bias.copy_(torch.tensor(ex.state["fc.bias"]))
    opt = make(lin.parameters())
    for step in range(4):
        feeds = reg_feeds(step)
        ex.run(feeds)
        opt.zero_grad()
        F.mse_loss(lin(torch.tensor(feeds["x"])), torch.tensor(feeds["t"])).backward()
        opt.step()
    np.testing.assert_allclose(ex.state["fc.weight"], lin.weight.detach().numpy(), rtol=1e-10)
    np.testing.assert_allclose(ex.state["fc.bias"], lin.bias.detach().numpy(), rtol=1e-10)


# The kernels pick other paths on large maps (a flat-shift weight gradient from 256
# pixels up, a flipped-kernel input gradient at stride 1): cover them explicitly.
@pytest.mark.parametrize("groups,k,s,p,d", [(1, 3, 1, 1, 1), (2, 3, 1, 2, 2), (1, 5, 1, 0, 1),
                                            (2, 3, 2, 1, 1), (1, 1, 1, 0, 1), (1, 3, 1, 4, 1)])
def test_conv2d_matches_torch_on_large_maps(groups, k, s, p, d):
    compare_with_torch("conv2d", [(2, 2 * groups, 20, 18)],
                       {"out_channels": 2 * groups, "kernel": k, "stride": s, "padding": p,
                        "dilation": d, "groups": groups, "bias": True}, {})
