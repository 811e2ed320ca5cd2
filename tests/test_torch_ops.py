"""Forward and backward of every operator against PyTorch in float64, plus batchnorm's
running statistics and the optimizers against torch.optim (skipped without torch)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from _op_cases import OP_CASES
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


def _heads(qkv, a):
    n, t, d3 = qkv.shape
    return qkv.view(n, t, 3, a["heads"], d3 // 3 // a["heads"]).permute(2, 0, 3, 1, 4)


def _attention_qkv(t, a):
    """torch.nn.MultiheadAttention's core on its packed in_proj result [N, T, 3D] (with
    p, the probabilities given: P v)."""
    qkv = t["in0"]
    q, k, v = _heads(qkv, a)
    if "in1" in t:
        y = t["in1"] @ v
    else:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=a["causal"], scale=a["scale"])
    return y.transpose(1, 2).reshape(qkv.shape[0], qkv.shape[1], -1)


def _attention_qkv_probs(qkv, a):
    q, k, _ = _heads(qkv, a)
    s = q @ k.transpose(-1, -2) * (a["scale"] or q.shape[-1] ** -0.5)
    if a["causal"]:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -torch.inf)
    return torch.softmax(s, -1)


TORCH = {
    "conv2d": lambda t, a: _conv(F.conv2d, 2, t, a),
    "conv2d_add": lambda t, a: _conv(F.conv2d, 2, t, a) + t["in1"],
    "conv1d": lambda t, a: _conv(F.conv1d, 1, t, a),
    "conv3d": lambda t, a: _conv(F.conv3d, 3, t, a),
    "conv_transpose2d": lambda t, a: F.conv_transpose2d(
        t["in0"], t["out.weight"], t.get("out.bias"), a["stride"], a["padding"],
        a["output_padding"], a["groups"], a["dilation"]),
    "maxpool": lambda t, a: F.max_pool2d(t["in0"], a["kernel"], _pool_stride(a), a["padding"],
                                         ceil_mode=a["ceil_mode"]),
    "avgpool": lambda t, a: F.avg_pool2d(t["in0"], a["kernel"], _pool_stride(a), a["padding"],
                                         ceil_mode=a["ceil_mode"],
                                         count_include_pad=a["count_include_pad"]),
    "maxpool1d": lambda t, a: F.max_pool1d(t["in0"], a["kernel"], _pool_stride(a),
                                           a["padding"], ceil_mode=a["ceil_mode"]),
    "avgpool1d": lambda t, a: F.avg_pool1d(t["in0"], a["kernel"], _pool_stride(a),
                                           a["padding"], ceil_mode=a["ceil_mode"],
                                           count_include_pad=a["count_include_pad"]),
    "maxpool3d": lambda t, a: F.max_pool3d(t["in0"], _nd(a["kernel"]), _nd(_pool_stride(a)),
                                           _nd(a["padding"]), ceil_mode=a["ceil_mode"]),
    "avgpool3d": lambda t, a: F.avg_pool3d(t["in0"], _nd(a["kernel"]), _nd(_pool_stride(a)),
                                           _nd(a["padding"]), ceil_mode=a["ceil_mode"],
                                           count_include_pad=a["count_include_pad"]),
    "global_maxpool": lambda t, a: t["in0"].amax(tuple(range(2, t["in0"].dim())), keepdim=True),
    "adaptive_avgpool": lambda t, a: _adaptive(F.adaptive_avg_pool1d, F.adaptive_avg_pool2d,
                                               F.adaptive_avg_pool3d, t["in0"],
                                               a["output_size"]),
    "adaptive_maxpool": lambda t, a: _adaptive(F.adaptive_max_pool1d, F.adaptive_max_pool2d,
                                               F.adaptive_max_pool3d, t["in0"],
                                               a["output_size"]),
    "global_avgpool": lambda t, a: t["in0"].mean(tuple(range(2, t["in0"].dim())), keepdim=True),
    "relu": lambda t, a: F.relu(t["in0"]),
    "leaky_relu": lambda t, a: F.leaky_relu(t["in0"], a["slope"]),
    "gelu": lambda t, a: F.gelu(t["in0"], approximate=a["approximate"]),
    "sigmoid": lambda t, a: torch.sigmoid(t["in0"]),
    "tanh": lambda t, a: torch.tanh(t["in0"]),
    "add": lambda t, a: t["in0"] + t["in1"],
    "sub": lambda t, a: t["in0"] - t["in1"],
    "mul": lambda t, a: t["in0"] * t["in1"],
    "scale": lambda t, a: t["in0"] * a["factor"],
    "mean": lambda t, a: t["in0"].mean(a["axis"], keepdim=a["keepdims"]),
    "softmax": lambda t, a: torch.softmax(t["in0"], a["axis"]),
    "linear": lambda t, a: F.linear(t["in0"], t["out.weight"], t.get("out.bias")),
    "linear_add": lambda t, a: F.linear(t["in0"], t["out.weight"], t.get("out.bias"))
    + t["in1"],
    "matmul": lambda t, a: torch.matmul(t["in0"], t["in1"]),
    "embedding": lambda t, a: F.embedding(t["in0"], t["out.weight"]),
    "softmax_cross_entropy": lambda t, a: _class_loss(F.cross_entropy, t, a,
                                                      label_smoothing=a["label_smoothing"]),
    "nll": lambda t, a: _class_loss(F.nll_loss, t, a),
    "l1": lambda t, a: F.l1_loss(t["in0"], t["in1"], reduction=a["reduction"]),
    "smooth_l1": lambda t, a: F.smooth_l1_loss(t["in0"], t["in1"], reduction=a["reduction"],
                                               beta=a["beta"]),
    "bce_with_logits": lambda t, a: F.binary_cross_entropy_with_logits(
        t["in0"], t["in1"], reduction=a["reduction"]),
    "mse": lambda t, a: F.mse_loss(t["in0"], t["in1"], reduction=a["reduction"]),
    "batchnorm": lambda t, a: F.batch_norm(
        t["in0"], t["out.running_mean"], t["out.running_var"], t.get("out.weight"),
        t.get("out.bias"), training=True, momentum=a["momentum"], eps=a["eps"]),
    "batchnorm_relu": lambda t, a: F.relu(TORCH["batchnorm"](t, a)),
    "layernorm": lambda t, a: F.layer_norm(t["in0"], t["in0"].shape[a["axis"]:],
                                           t.get("out.weight"), t.get("out.bias"), a["eps"]),
    "groupnorm": lambda t, a: F.group_norm(t["in0"], a["num_groups"], t.get("out.weight"),
                                           t.get("out.bias"), a["eps"]),
    "instancenorm": lambda t, a: F.instance_norm(t["in0"], weight=t.get("out.weight"),
                                                 bias=t.get("out.bias"), eps=a["eps"]),
    "rmsnorm": lambda t, a: F.rms_norm(t["in0"], t["in0"].shape[a["axis"]:],
                                       t.get("out.weight"), a["eps"]),
    "flatten": lambda t, a: torch.flatten(t["in0"], a["start"]),
    "reshape": lambda t, a: t["in0"].reshape(a["shape"]),
    "permute": lambda t, a: t["in0"].permute(a["dims"]),
    "transpose": lambda t, a: t["in0"].transpose(a["dim0"], a["dim1"]),
    "concat": lambda t, a: torch.cat([t["in0"], t["in1"]], a["axis"]),
    "slice": lambda t, a: _slice(t["in0"], a),
    # arithmetic
    "sqrt": lambda t, a: torch.sqrt(t["in0"]),
    "exp": lambda t, a: torch.exp(t["in0"]),
    "log": lambda t, a: torch.log(t["in0"]),
    "abs": lambda t, a: torch.abs(t["in0"]),
    "neg": lambda t, a: -t["in0"],
    "div": lambda t, a: t["in0"] / t["in1"],
    "pow": lambda t, a: torch.pow(t["in0"], t["in1"]),
    "maximum": lambda t, a: torch.maximum(t["in0"], t["in1"]),
    "minimum": lambda t, a: torch.minimum(t["in0"], t["in1"]),
    "where": lambda t, a: torch.where(t["in0"].bool(), t["in1"], t["in2"]),
    "cast": lambda t, a: t["in0"].to(torch.float64),
    # activations
    "relu6": lambda t, a: F.relu6(t["in0"]),
    "add_relu": lambda t, a: F.relu(t["in0"] + t["in1"]),
    "clip": lambda t, a: torch.clamp(t["in0"], a["min"], a["max"]),
    "hardswish": lambda t, a: F.hardswish(t["in0"]),
    "hardsigmoid": lambda t, a: F.hardsigmoid(t["in0"]),
    "silu": lambda t, a: F.silu(t["in0"]),
    "mish": lambda t, a: F.mish(t["in0"]),
    "elu": lambda t, a: F.elu(t["in0"], a["alpha"]),
    "selu": lambda t, a: F.selu(t["in0"]),
    "softplus": lambda t, a: F.softplus(t["in0"], a["beta"], a["threshold"]),
    "prelu": lambda t, a: F.prelu(t["in0"], t["out.weight"]),
    # padding and resizing
    "pad": lambda t, a: F.pad(t["in0"], a["pads"], a["mode"],
                              a["value"] if a["mode"] == "constant" else None),
    "upsample": lambda t, a: F.interpolate(
        t["in0"], size=a["size"], scale_factor=a["scale_factor"], mode=a["mode"],
        align_corners=None if a["mode"] == "nearest" else a["align_corners"]),
    # attention
    "scaled_dot_product_attention": lambda t, a: F.scaled_dot_product_attention(
        t["in0"], t["in1"], t["in2"], is_causal=a["causal"], scale=a["scale"]),
    "attention_qkv": _attention_qkv,
    "attention_qkv_probs": lambda t, a: _attention_qkv_probs(t["in0"], a),
    "causal_mask": lambda t, a: t["in0"].masked_fill(
        torch.ones(t["in0"].shape[-2:], dtype=torch.bool).triu(1), a["value"]),
    # reductions
    "sum": lambda t, a: t["in0"].sum(a["axis"], keepdim=a["keepdims"]),
    "amax": lambda t, a: t["in0"].amax(a["axis"], keepdim=a["keepdims"]),
    "amin": lambda t, a: t["in0"].amin(a["axis"], keepdim=a["keepdims"]),
    "log_softmax": lambda t, a: torch.log_softmax(t["in0"], a["axis"]),
    # shape
    "squeeze": lambda t, a: t["in0"].squeeze(a["axis"]),
    "unsqueeze": lambda t, a: t["in0"].unsqueeze(a["axis"]),
    "expand": lambda t, a: t["in0"].expand(*a["shape"]),
    "gather": lambda t, a: _gather(t["in0"], t["in1"], a["axis"]),
    "gather_elements": lambda t, a: torch.gather(t["in0"], a["axis"], t["in1"]),
}


def _conv(f, d, t, a):
    """torch's convN, with netdsl's (begins..., ends...) padding applied by F.pad first."""
    x, p = t["in0"], a["padding"]
    if isinstance(p, tuple) and len(p) == 2 * d:
        widths = []
        for i in reversed(range(d)):  # F.pad: last dim first
            widths += [p[i], p[d + i]]
        x, p = F.pad(x, widths), 0
    with warnings.catch_warnings():  # torch: "same" with an even kernel copies the input
        warnings.simplefilter("ignore", UserWarning)
        return f(x, t["out.weight"], t.get("out.bias"), _nd(a["stride"], d), p,
                 _nd(a["dilation"], d), a["groups"])


def _class_loss(f, t, a, **kw):
    x, y = t["in0"].movedim(a["axis"], -1), t["in1"]  # netdsl's class axis, moved last
    w = None if a["weight"] is None else torch.tensor(a["weight"], dtype=x.dtype)
    out = f(x.reshape(-1, x.shape[-1]), y.reshape(-1), weight=w,
            ignore_index=a["ignore_index"], reduction=a["reduction"], **kw)
    return out.reshape(y.shape) if a["reduction"] == "none" else out


def _nd(v, d=3):
    v = tuple(v) if isinstance(v, tuple) else (v,)
    return v * d if len(v) == 1 else v


def _adaptive(f1, f2, f3, x, size):
    d = x.dim() - 2
    return (f1, f2, f3)[d - 1](x, _nd(size, d))


def _slice(x, a):
    idx = [slice(None)] * x.dim()
    idx[a["axis"]] = slice(a["start"], a["stop"], a["step"])
    return x[tuple(idx)]


def _gather(x, idx, axis):  # ONNX Gather: x.shape[:axis] + idx.shape + x.shape[axis+1:]
    axis %= x.dim()
    flat = torch.index_select(x, axis, idx.reshape(-1))
    return flat.reshape(x.shape[:axis] + idx.shape + x.shape[axis + 1:])

CASES = [
    ("conv2d", [(2, 4, 7, 6)], {"out_channels": 6, "kernel": 3, "stride": 2, "padding": 1,
                                "groups": 2}, {}),
    ("conv2d", [(1, 3, 9, 9)], {"out_channels": 2, "kernel": (3, 2), "dilation": 2,
                                "bias": False}, {}),
    ("conv2d", [(2, 3, 4, 4)], {"out_channels": 5, "kernel": 1}, {}),
    # fewer outputs than inputs: the weight gradient as the transposed products
    ("conv2d", [(2, 8, 4, 4)], {"out_channels": 3, "kernel": 1}, {}),
    # ... and with the batch folded into one GEMM (O*C > H*W*(O+C))
    ("conv2d", [(2, 24, 2, 2)], {"out_channels": 16, "kernel": 1, "bias": False}, {}),
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
    ("softmax_cross_entropy", [(2, 3, 4), (2, 3)], {"axis": -1}, {1: 4}),
    ("softmax_cross_entropy", [(2, 4, 3, 5), (2, 3, 5)], {}, {1: 4}),  # per pixel, dim 1
    ("softmax_cross_entropy", [(2, 3, 4, 5), (2, 3, 4)], {"axis": 3}, {1: 5}),
    ("mse", [(3, 4), (3, 4)], {}, {}),
    ("batchnorm", [(4, 3, 2, 3)], {"momentum": 0.3}, {}),
    ("batchnorm", [(5, 3)], {"affine": False}, {}),
    ("batchnorm_relu", [(4, 3, 2, 3)], {"momentum": 0.3}, {}),
    ("batchnorm_relu", [(6, 2, 5)], {"affine": False}, {}),
    ("layernorm", [(2, 3, 5)], {}, {}), ("layernorm", [(4, 5)], {"affine": False}, {}),
    ("flatten", [(2, 3, 2, 2)], {"start": 2}, {}), ("reshape", [(2, 6)], {"shape": (3, 2, 2)}, {}),
    ("permute", [(2, 3, 4)], {"dims": (2, 0, 1)}, {}),
    ("transpose", [(2, 3, 4)], {"dim0": 0, "dim1": 2}, {}),
    ("concat", [(2, 3, 4), (2, 1, 4)], {"axis": 1}, {}),
    ("slice", [(2, 5, 3)], {"axis": 1, "start": 1, "stop": 4}, {}),
]
CASES = [(*c, ()) for c in CASES] + list(OP_CASES)


# torch's hardsigmoid backward multiplies by 1/6 rounded to float32, even in float64
GRAD_RTOL = {"hardsigmoid": 1e-7}


def compare_with_torch(op, shapes, attrs, ints, seed=0, positive=()):
    g = op_graph(op, shapes, attrs, ints)
    t = autodiff(g)
    ex = Executor(t, "numpy", dtype="f64", seed=seed)
    rng = np.random.default_rng(seed)
    randomise_params(ex, rng, positive)
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
        np.testing.assert_allclose(grad, tens[p].grad.numpy(), rtol=GRAD_RTOL.get(op, 1e-8),
                                   atol=1e-12, err_msg=f"{op}: gradient of {p}")
    for name, v in ex.state.items():  # batchnorm updates its running statistics in place
        if "running" in name:
            np.testing.assert_allclose(v, tens[name].numpy(), rtol=1e-12, err_msg=name)


@pytest.mark.parametrize("op,shapes,attrs,ints,positive", CASES,
                         ids=[f"{c[0]}-{k}" for k, c in enumerate(CASES)])
def test_op_matches_torch(op, shapes, attrs, ints, positive):
    compare_with_torch(op, shapes, attrs, ints, positive=positive)


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


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["maxpool", "avgpool"]), st.integers(1, 4), st.integers(1, 3),
       st.data(), st.booleans(), st.booleans())
def test_pools_match_torch_on_random_geometry(op, k, s, data, ceil, include_pad):
    p = data.draw(st.integers(0, k // 2))
    h, w = data.draw(st.integers(k, k + 5)), data.draw(st.integers(k, k + 5))
    compare_with_torch(op, [(2, 2, h, w)], {"kernel": k, "stride": s, "padding": p,
                                            "ceil_mode": ceil,
                                            "count_include_pad": include_pad}, {})


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 2), st.integers(1, 3), st.integers(1, 3), st.integers(0, 2),
       st.integers(1, 2), st.data(), st.booleans())
def test_conv_transpose2d_matches_torch_on_random_geometry(groups, k, s, p, d, data, bias):
    op = data.draw(st.integers(0, max(s, d) - 1))
    size = data.draw(st.integers(1, 4))
    if (size - 1) * s - 2 * p + d * (k - 1) + op + 1 < 1:
        return
    compare_with_torch("conv_transpose2d", [(2, groups * 2, size, size + 1)],
                       {"out_channels": groups, "kernel": k, "stride": s, "padding": p,
                        "output_padding": op, "dilation": d, "groups": groups,
                        "bias": bias}, {})


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["nearest", "bilinear"]), st.booleans(), st.integers(1, 7),
       st.integers(1, 7), st.data())
def test_upsample_matches_torch_on_random_sizes(mode, align, h, w, data):
    if data.draw(st.booleans()):
        attrs = {"size": (data.draw(st.integers(1, 13)), data.draw(st.integers(1, 13)))}
    else:
        attrs = {"scale_factor": data.draw(st.sampled_from([0.5, 1.5, 2.0, 3.0, 2.5]))}
        if min(int(h * attrs["scale_factor"]), int(w * attrs["scale_factor"])) < 1:
            return
    attrs.update(mode=mode, align_corners=align and mode != "nearest")
    compare_with_torch("upsample", [(1, 2, h, w)], attrs, {})


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(["adaptive_avgpool", "adaptive_maxpool"]), st.integers(1, 9),
       st.integers(1, 9), st.integers(1, 5), st.integers(1, 5))
def test_adaptive_pools_match_torch_on_random_sizes(op, h, w, oh, ow):
    compare_with_torch(op, [(2, 2, h, w)], {"output_size": (oh, ow)}, {})


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(["conv1d", "conv3d"]), st.integers(1, 2), st.integers(1, 3),
       st.integers(1, 2), st.integers(1, 2), st.data())
def test_conv_nd_matches_torch_on_random_geometry(op, groups, k, s, d, data):
    dims = 1 if op == "conv1d" else 3
    same = data.draw(st.booleans()) and s == 1
    p = "same" if same else data.draw(st.integers(0, 2))
    eff = d * (k - 1) + 1
    size = tuple(max(1, eff - (0 if same else 2 * p)) + data.draw(st.integers(0, 2))
                 for _ in range(dims))
    compare_with_torch(op, [(2, 2 * groups) + size],
                       {"out_channels": groups, "kernel": k, "stride": s, "padding": p,
                        "dilation": d, "groups": groups, "bias": data.draw(st.booleans())},
                       {})


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


@pytest.mark.parametrize("kind,hyper,make", [
    ("sgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)),
    ("adamw", {"lr": 0.01, "weight_decay": 0.1},
     lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)),
])
@pytest.mark.parametrize("max_norm", [0.05, 0.5, 100.0])  # clipped, some steps, never
def test_clip_grad_norm_matches_torch(kind, hyper, make, max_norm):
    """`clip_grad_norm=c` scales the gradients as torch.nn.utils.clip_grad_norm_(c) does
    before the step (the first steps' norms here are 0.7-3)."""
    from test_executor import reg_feeds
    t = add_optimizer(autodiff(regression_graph()), kind, clip_grad_norm=max_norm, **hyper)
    assert len(t.by_op("grad_sumsq")) == len(t.by_op("clip_factor")) == 1
    ex = Executor(t.verify(), "numpy", dtype="f64", seed=0)
    lin = torch.nn.Linear(3, 1).double()
    with torch.no_grad():
        lin.weight.copy_(torch.tensor(ex.state["fc.weight"]))
        lin.bias.copy_(torch.tensor(ex.state["fc.bias"]))
    opt = make(lin.parameters())
    norms = []
    for step in range(4):
        feeds = reg_feeds(step)
        ex.run(feeds)
        opt.zero_grad()
        F.mse_loss(lin(torch.tensor(feeds["x"])), torch.tensor(feeds["t"])).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(lin.parameters(), max_norm)))
        opt.step()
    np.testing.assert_allclose(ex.state["fc.weight"], lin.weight.detach().numpy(), rtol=1e-10)
    np.testing.assert_allclose(ex.state["fc.bias"], lin.bias.detach().numpy(), rtol=1e-10)
    if max_norm == 0.05:
        assert min(norms) > max_norm  # (clipped every step)
    if max_norm == 100.0:
        assert max(norms) < max_norm


# The kernels pick other paths on large maps (a flat-shift weight gradient from 256
# pixels up, a flipped-kernel input gradient at stride 1): cover them explicitly.
@pytest.mark.parametrize("groups,k,s,p,d", [(1, 3, 1, 1, 1), (2, 3, 1, 2, 2), (1, 5, 1, 0, 1),
                                            (2, 3, 2, 1, 1), (1, 1, 1, 0, 1), (1, 3, 1, 4, 1)])
def test_conv2d_matches_torch_on_large_maps(groups, k, s, p, d):
    compare_with_torch("conv2d", [(2, 2 * groups, 20, 18)],
                       {"out_channels": 2 * groups, "kernel": k, "stride": s, "padding": p,
                        "dilation": d, "groups": groups, "bias": True}, {})
