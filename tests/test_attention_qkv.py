"""attention_qkv: the fuse pass's rewrite of multi-head attention written out over a packed
q/k/v projection (netdsl.passes.fuse_attention), and the fused kernels that run it
(netdsl.backends.numpy_fused_attention) against the NumPy reference kernels. The operator's
own gradient and its PyTorch comparison are in the shared op cases (tests/_op_cases.py)."""
from __future__ import annotations

import numpy as np
import pytest
from _examples import load
from test_fuse import _kernels, _Reference, assert_same_steps, step

import netdsl
from netdsl.passes.autodiff import autodiff
from netdsl.passes.fuse import fuse
from netdsl.passes.optimizer import add_optimizer

WRITTEN_OUT = ("slice", "permute", "transpose", "softmax", "scale", "matmul",
               "scaled_dot_product_attention")


@pytest.mark.parametrize("example,causal", [("transformer-tiny", False), ("gpt-tiny", True)])
def test_written_out_attention_becomes_one_node_with_the_same_numbers(example, causal):
    """stdlib's self_attention (products, scale, softmax) and causal_self_attention
    (scaled_dot_product_attention) between the slices of the q/k/v projection and the
    merged heads become attention_qkv(qkv, p) per layer, named as the final reshape, p the
    kept probabilities (32 tokens, heads of 16) named as the softmax (or the fused
    attention) they replace; fuse_grads joins their backward into one
    attention_qkv_grad(dy, qkv, p). The training step's losses, every gradient and the
    state after are the unfused step's, joined or not."""
    fwd = load(f"{example}.net").lower(2)
    g = fuse(fwd, enabled=True)
    fused = g.by_op("attention_qkv")
    assert len(fused) == 2 and len(g.by_op("attention_qkv_probs")) == 2
    for n in fused:
        assert n.attrs == {"heads": 4, "causal": causal, "scale": None}
        assert fwd[n.name].op == "reshape" and n.type == fwd[n.name].type
        qkv, p = n.inputs
        assert fwd[qkv].op == "linear" and g[p].op == "attention_qkv_probs"
        assert g[p].inputs == (qkv,) and g[p].attrs == n.attrs
        assert fwd[p].op == ("scaled_dot_product_attention" if causal else "softmax")
        assert all(fwd[x].op in WRITTEN_OUT + ("reshape",) and (x not in g or x == p)
                   for x in n.meta["fused"][:-1])
    assert not any(n.op in WRITTEN_OUT for n in g.nodes)
    assert "attention_qkv(" in g.to_text()
    assert fuse(fwd, enabled=True, attention=False).by_op("slice")
    joined = step(fwd, True)
    grads = joined.by_op("attention_qkv_grad")
    assert len(grads) == 2 and all(len(n.inputs) == 3 for n in grads)
    assert not joined.by_op("attention_qkv_grad_values", "attention_qkv_grad_probs",
                            "attention_qkv_probs_grad")
    ref = step(fwd, False)
    assert_same_steps(ref, joined, rtol=1e-10, atol=1e-12)
    apart = add_optimizer(autodiff(g), "sgd", lr=0.05, momentum=0.9)  # not joined
    assert len(apart.by_op("attention_qkv_probs_grad")) == 2
    assert_same_steps(ref, apart, rtol=1e-10, atol=1e-12)


LONG = """
import transformer
network long {
    input x: f32[N, 20, 8]
    h = transformer.self_attention(x, 2)
    output h
    loss mse(h, x)
}
"""


def test_long_sequences_recompute_the_probabilities():
    """20 tokens, heads of 4: the probabilities would outgrow q, k and v
    (fuse_attention.KEEP_PROBS_UP_TO), so one attention_qkv(qkv) whose backward
    attention_qkv_grad(dy, qkv) recomputes them; the step's numbers are the unfused one's."""
    fwd = netdsl.loads(LONG).lower(2)
    (n,) = fuse(fwd, enabled=True).by_op("attention_qkv")
    assert len(n.inputs) == 1
    h = step(fwd, True)
    assert not h.by_op("attention_qkv_probs")
    assert [len(x.inputs) for x in h.by_op("attention_qkv_grad")] == [2]
    assert_same_steps(step(fwd, False), h, rtol=1e-10, atol=1e-12)


def test_attention_is_left_as_written_where_a_value_inside_is_read_elsewhere():
    """The probabilities of the first layer an output too: that layer stays as written,
    the second is fused."""
    fwd = load("transformer-tiny.net").lower(2).copy()  # (not the cached graph's outputs)
    probs = [n.name for n in fwd.by_op("softmax")]
    fwd.outputs["probs"] = probs[:1]
    g = fuse(fwd, enabled=True)
    assert len(g.by_op("attention_qkv")) == 1 and len(g.by_op("softmax")) == 1
    assert g.by_op("attention_qkv")[0].name.startswith("encoder.encoder_layer[1].")


SWAPPED = """
import transformer
network swapped {
    input x: f32[N, 5, 8]
    k, q, v = split(linear(x, 24), 3, axis=2)
    scores = scale(matmul(transformer.split_heads(q, 2),
                          transpose(transformer.split_heads(k, 2))), 0.3)
    output transformer.merge_heads(matmul(softmax(scores), transformer.split_heads(v, 2)))
}
"""


def test_projections_in_another_order_are_left_as_written():
    """k, q, v cut in that order: not attention_qkv's layout, so not fused; q, k, v with
    a scale other than 1/sqrt(hd) take it as the `scale` attribute."""
    fwd = netdsl.loads(SWAPPED).lower(2)
    assert not fuse(fwd, enabled=True).by_op("attention_qkv")
    ordered = netdsl.loads(SWAPPED.replace("k, q, v =", "q, k, v =")).lower(2)
    (n,) = fuse(ordered, enabled=True).by_op("attention_qkv")
    assert n.attrs == {"heads": 2, "causal": False, "scale": 0.3}


def test_only_a_cpu_step_takes_attention_qkv(monkeypatch):
    """On a GPU the fused attention has not been measured: its step is left as written."""
    from netdsl.config import TrainConfig
    from netdsl.step.graphs import training_graph
    monkeypatch.setenv("NETDSL_FUSE", "1")
    fwd = load("transformer-tiny.net").lower(2)
    cpu = training_graph(fwd, TrainConfig(), "cpu")
    assert len(cpu.by_op("attention_qkv")) == len(cpu.by_op("attention_qkv_grad")) == 2
    assert not training_graph(fwd, TrainConfig(), "gpu").by_op("attention_qkv")


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-13), (np.float32, 3e-6)])
@pytest.mark.parametrize("n,t,heads,hd", [(2, 32, 4, 16), (3, 7, 2, 5), (1, 1, 1, 3),
                                          (2, 45, 3, 8)])
@pytest.mark.parametrize("causal,scale", [(False, None), (True, None), (True, 0.7)])
def test_fused_attention_kernels_match_the_reference(dtype, tol, n, t, heads, hd, causal,
                                                     scale):
    """The (image, head) task kernels against the NumPy reference (batched products over
    strided head views): the probabilities, the forward with them kept and recomputed
    (into a planned slot), and dqkv both ways; the backward nodes of the kept
    probabilities, summed, give the joined gradient."""
    pytest.importorskip("numba")
    from netdsl.backends.numpy import NumpyBackend
    fast = NumpyBackend()
    rng = np.random.default_rng(n * t + heads + hd + causal)
    qkv = (rng.standard_normal((n, t, 3 * heads * hd)) * 2).astype(dtype)
    dy = rng.standard_normal((n, t, heads * hd)).astype(dtype)
    a = {"heads": heads, "causal": causal, "scale": scale}
    res = []
    for backend in (_Reference(), fast):
        slot = np.full(dy.shape, np.nan, dtype)
        with fast.fused.running():
            p = _kernels("attention_qkv_probs", [qkv], a, backend)
            y = _kernels("attention_qkv", [qkv], a, backend, out=slot).copy()
            yp = _kernels("attention_qkv", [qkv, p], a, backend)
            dqkv = _kernels("attention_qkv_grad", [dy, qkv], a, backend)
            dqkv_p = _kernels("attention_qkv_grad", [dy, qkv, p], a, backend)
        assert np.shares_memory(_kernels("attention_qkv", [qkv], a, backend, out=slot), slot)
        res.append((p, y, yp, dqkv, dqkv_p))
    for name, u, v in zip(("p", "y", "y from p", "dqkv", "dqkv from p"), *res, strict=True):
        assert u.dtype == v.dtype == dtype
        np.testing.assert_allclose(v, u, rtol=0, atol=tol * max(float(np.abs(u).max()), 1.0),
                                   err_msg=name)
    p, _, yp, dqkv, _ = res[0]
    ref = _Reference()
    dp = _kernels("attention_qkv_grad_probs", [dy, qkv], {"heads": heads}, ref)
    parts = (_kernels("attention_qkv_grad_values", [dy, p], {"heads": heads}, ref)
             + _kernels("attention_qkv_probs_grad", [dp, p, qkv], a, ref))
    np.testing.assert_allclose(parts, dqkv, rtol=0, atol=tol * max(float(np.abs(dqkv).max()),
                                                                     1.0))


def test_fused_attention_gives_the_same_bits_on_one_thread_and_two():
    """Each (image, head) task computes alone, its products single-threaded: a step's
    numbers do not depend on how many threads share the tasks."""
    pytest.importorskip("numba")
    from netdsl.backends import numpy_fused_attention as fa
    from netdsl.backends.numpy import NumpyBackend
    f = NumpyBackend().fused
    if f.cblas is None:
        pytest.skip("NumPy links a BLAS other than its scipy-openblas")
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((4, 24, 3 * 64)).astype(np.float32)
    dy = rng.standard_normal((4, 24, 64)).astype(np.float32)
    fn, one, s = f.cblas.gemm[np.dtype(np.float32)], np.float32(1), np.float32(0.25)
    runs = []
    with f.running():
        for threads in (1, 2):
            p = np.empty((4, 4, 24, 24), np.float32)
            fa.attention_probs_tasks(fn, s, qkv, 4, True, p, threads)
            run = [p]
            for kept in (np.empty((0, 0, 0, 0), np.float32), p):
                y, d = np.empty_like(dy), np.empty_like(qkv)
                fa.attention_tasks(fn, one, s, qkv, 4, True, kept, y, threads)
                fa.attention_grad_tasks(fn, one, s, dy, qkv, 4, True, kept, d, threads)
                run += [y, d]
            runs.append(run)
    for u, v in zip(*runs, strict=True):
        np.testing.assert_array_equal(u, v)
    np.testing.assert_array_equal(runs[0][1], runs[0][3])  # kept or recomputed: one p
