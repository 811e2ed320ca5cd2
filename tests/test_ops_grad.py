"""Every differentiable operator's gradient against central finite differences (float64),
on random shapes and attributes drawn by hypothesis."""
from __future__ import annotations

import numpy as np
import pytest
from _op_cases import OP_CASES, SPLIT_ONLY
from gradcheck import check_grads, op_graph, random_feeds
from hypothesis import given, settings
from hypothesis import strategies as st

from netdsl.ir import registry
from netdsl.passes.autodiff import autodiff
from netdsl.runtime.executor import Executor

FAST = settings(max_examples=12, deadline=None)
dims = st.integers(1, 4)


@st.composite
def conv_case(draw):
    groups = draw(st.integers(1, 2))
    cin, cout = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))
    k, s, p, d = (draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(0, 2)),
                  draw(st.integers(1, 2)))
    eff = d * (k - 1) + 1
    h = draw(st.integers(max(1, eff - 2 * p), max(1, eff - 2 * p) + 3))
    w = draw(st.integers(max(1, eff - 2 * p), max(1, eff - 2 * p) + 3))
    attrs = {"out_channels": cout, "kernel": k, "stride": s, "padding": p, "dilation": d,
             "groups": groups, "bias": draw(st.booleans())}
    return [(draw(st.integers(1, 2)), cin, h, w)], attrs


@FAST
@given(conv_case(), st.integers(0, 2**16))
def test_conv2d(case, seed):
    shapes, attrs = case
    check_grads(op_graph("conv2d", shapes, attrs), seed)


@st.composite
def pool_case(draw):
    k = draw(st.integers(1, 3))
    s = draw(st.sampled_from([None, 1, 2]))
    p = draw(st.integers(0, k // 2))
    h, w = draw(st.integers(k, k + 3)), draw(st.integers(k, k + 3))
    return [(draw(st.integers(1, 2)), draw(st.integers(1, 2)), h, w)], \
        {"kernel": k, "stride": s, "padding": p, "ceil_mode": draw(st.booleans()),
         "count_include_pad": draw(st.booleans())}


@FAST
@given(pool_case(), st.sampled_from(["maxpool", "avgpool"]), st.integers(0, 2**16))
def test_pools(case, op, seed):
    shapes, attrs = case
    check_grads(op_graph(op, shapes, attrs), seed)


def shape(min_rank=1, max_rank=3):
    return st.lists(dims, min_size=min_rank, max_size=max_rank).map(tuple)


@FAST
@given(shape(1, 3), st.sampled_from(["relu", "leaky_relu", "gelu", "sigmoid", "tanh"]),
       st.integers(0, 2**16))
def test_activations(s, op, seed):
    attrs = {"slope": 0.1} if op == "leaky_relu" else {}
    check_grads(op_graph(op, [s], attrs), seed)


@st.composite
def broadcast_pair(draw):
    """Two shapes that broadcast: the second drops leading dims or has 1s."""
    a = draw(shape(1, 3))
    b = tuple(1 if draw(st.booleans()) else d for d in a)[draw(st.integers(0, len(a) - 1)):]
    return (a, b) if draw(st.booleans()) else (b, a)


@FAST
@given(broadcast_pair(), st.sampled_from(["add", "sub", "mul"]), st.integers(0, 2**16))
def test_binary_broadcasting(shapes, op, seed):
    check_grads(op_graph(op, list(shapes), {}), seed)


@FAST
@given(shape(1, 3), st.floats(-2, 2), st.integers(0, 2**16))
def test_scale(s, factor, seed):
    check_grads(op_graph("scale", [s], {"factor": factor}), seed)


@FAST
@given(shape(1, 3), st.data(), st.integers(0, 2**16))
def test_mean_softmax(s, data, seed):
    axis = data.draw(st.integers(-len(s), len(s) - 1))
    check_grads(op_graph("mean", [s], {"axis": axis, "keepdims": data.draw(st.booleans())}),
                seed)
    check_grads(op_graph("softmax", [s], {"axis": axis}), seed)


@FAST
@given(shape(2, 3), dims, st.booleans(), st.integers(0, 2**16))
def test_linear(s, out, bias, seed):
    check_grads(op_graph("linear", [s], {"out_features": out, "bias": bias}), seed)


@FAST
@given(dims, dims, dims, st.sampled_from([(), (2,), "b"]), st.integers(0, 2**16))
def test_matmul(m, k, n, batch, seed):
    # batch "b": only the left operand is batched, so b's gradient is summed over it
    a_batch, b_batch = ((2,), ()) if batch == "b" else (batch, batch)
    check_grads(op_graph("matmul", [a_batch + (m, k), b_batch + (k, n)], {}), seed)


@FAST
@given(shape(1, 2), st.integers(2, 5), dims, st.integers(0, 2**16))
def test_embedding(ids_shape, num, dim, seed):
    # few rows and several ids: repeated ids must accumulate into one row's gradient
    check_grads(op_graph("embedding", [ids_shape], {"num": num, "dim": dim}, ints={0: num}),
                seed)


@FAST
@given(shape(2, 3), st.integers(0, 2**16))
def test_losses(s, seed):
    labels = s[:-1]
    check_grads(op_graph("softmax_cross_entropy", [s, labels], {"axis": -1},
                         ints={1: s[-1]}), seed)
    if len(s) >= 3:  # PyTorch's layout: classes at dim 1
        check_grads(op_graph("softmax_cross_entropy", [s, (s[0],) + s[2:]], {},
                             ints={1: s[1]}), seed)
    check_grads(op_graph("mse", [s, s], {}), seed)


@FAST
@given(st.integers(2, 4), st.integers(1, 3), st.sampled_from([(), (3,), (2, 3)]),
       st.booleans(), st.sampled_from(["batchnorm", "batchnorm_relu"]), st.integers(0, 2**16))
def test_batchnorm(n, c, spatial, affine, op, seed):
    check_grads(op_graph(op, [(n, c) + spatial], {"affine": affine}), seed)


@FAST
@given(shape(1, 2), st.integers(2, 5), st.booleans(), st.integers(0, 2**16))
def test_layernorm(lead, d, affine, seed):
    check_grads(op_graph("layernorm", [lead + (d,)], {"affine": affine}), seed)


@FAST
@given(shape(2, 4), st.data(), st.integers(0, 2**16))
def test_shape_ops(s, data, seed):
    rank = len(s)
    check_grads(op_graph("flatten", [s], {"start": data.draw(st.integers(0, rank - 1))}), seed)
    check_grads(op_graph("reshape", [s], {"shape": (-1,)}), seed)
    perm = data.draw(st.permutations(range(rank)))
    check_grads(op_graph("permute", [s], {"dims": tuple(perm)}), seed)
    d0, d1 = data.draw(st.integers(0, rank - 1)), data.draw(st.integers(0, rank - 1))
    check_grads(op_graph("transpose", [s], {"dim0": d0, "dim1": d1}), seed)
    ax = data.draw(st.integers(0, rank - 1))
    start = data.draw(st.integers(0, s[ax] - 1))
    stop = data.draw(st.integers(start + 1, s[ax]))
    check_grads(op_graph("slice", [s], {"axis": ax, "start": start, "stop": stop}), seed)
    other = s[:ax] + (data.draw(dims),) + s[ax + 1:]
    check_grads(op_graph("concat", [s, other, s], {"axis": ax}), seed)


@FAST
@given(st.integers(1, 2), st.integers(1, 3), st.integers(1, 4), st.integers(0, 2**16))
def test_global_avgpool(n, c, hw, seed):
    check_grads(op_graph("global_avgpool", [(n, c, hw, hw + 1)], {}), seed)


@FAST
@given(shape(), st.sampled_from(["to_host", "to_device"]), st.integers(0, 2**16))
def test_transfers(s, op, seed):
    check_grads(op_graph(op, [s], {}), seed)


@pytest.mark.parametrize("op,shapes,attrs,ints,positive", OP_CASES,
                         ids=[f"{c[0]}-{k}" for k, c in enumerate(OP_CASES)])
@pytest.mark.parametrize("seed", [0, 1])
def test_op_case_grads(op, shapes, attrs, ints, positive, seed):
    check_grads(op_graph(op, shapes, attrs, ints), seed, positive=positive)


# Ops tested above. Dropout is random, so it is tested apart: test_dropout_mask_is_explicit.
COVERED = {c[0] for c in OP_CASES} | {
           "conv2d", "maxpool", "avgpool", "relu", "leaky_relu", "gelu", "sigmoid", "tanh",
           "add", "sub", "mul", "scale", "mean", "softmax", "linear", "matmul", "embedding",
           "softmax_cross_entropy", "mse", "batchnorm", "batchnorm_relu", "layernorm",
           "flatten", "reshape",
           "permute", "transpose", "slice", "concat", "global_avgpool", "dropout",
           "to_host", "to_device"}


def test_every_differentiable_op_is_gradchecked():
    ops = {n for n, o in registry.load_all().items()
           if o.differentiable and n not in ("input", "param", "buffer") + SPLIT_ONLY}
    assert ops == COVERED, f"add gradient tests for {sorted(ops - COVERED)}"


@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_dropout_mask_is_explicit(p):
    """The mask is a graph value: d loss/d x = dy * mask with the very mask forward used,
    and the kept values are scaled by 1/(1-p)."""
    g = op_graph("dropout", [(64, 8)], {"p": p})
    g.outputs["debug"] = []
    tg = autodiff(g)
    assert "out.mask" in tg and tg["out"].op == "mul" and tg["out.mask"].op == "dropout_mask"
    tg.outputs["debug"] = ["out.mask", "r"]
    ex = Executor(tg, "numpy", dtype="f64", seed=1)
    res = ex.run(random_feeds(tg, np.random.default_rng(0)), training=True)
    mask, r = res["debug"]
    (grad,) = res["grads"]
    assert np.allclose(grad, mask * r / r.size)
    kept = mask[mask != 0]
    if p < 1.0:
        assert np.allclose(kept, 1.0 / (1.0 - p))
        assert abs((mask == 0).mean() - p) < 0.1  # 512 draws: p is clearly respected
    else:
        assert kept.size == 0
    # evaluation: identity, mask of ones
    ev = ex.run(random_feeds(tg, np.random.default_rng(0)), training=False,
                roles=("debug",))
    assert np.all(ev["debug"][0] == 1.0)
