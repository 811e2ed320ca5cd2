"""Synchronised batchnorm (netdsl/parallel/syncbn.py, netdsl/ir/ops/norm_sync.py): a data
or spatial split's batchnorms normalise with the whole batch's statistics, so the split
step is the single-device step (losses, every gradient, the running statistics); one
all_gather a layer forward and one all_reduce backward; the fused kernels agree with the
NumPy reference and with the single-device batchnorm's kernels bit for bit."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from netdsl import api
from netdsl.errors import NetdslError
from netdsl.ir import registry
from netdsl.parallel.split import SplitSpec, split_step
from netdsl.runtime.executor import Executor
from netdsl.runtime.gate import verify_split

NET = """
network sbn {
    input x: f32[N, 3, 6, 5]
    input y: i64[N]

    h = relu(batchnorm(conv2d(x, 4, kernel=3, padding=1, bias=false)))
    h = relu6(batchnorm(conv2d(h, 4, kernel=3, padding=1, bias=false), momentum=0.3))
    h = batchnorm(conv2d(h, 4, kernel=3, padding=1, bias=false), affine=false, eps=0.01)
    z = batchnorm(linear(flatten(h), 6, bias=false))
    logits = linear(relu(z), 5)

    output logits
    loss softmax_cross_entropy(logits, y)
}
"""
OPT = {"kind": "sgd", "lr": 0.1, "momentum": 0.9}


def feeds(batch: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batch, 3, 6, 5)) * 2 + 1,
            "y": rng.integers(0, 5, batch)}


@pytest.fixture(scope="module")
def net():
    return api.loads(NET, file="sbn.net")


@pytest.mark.parametrize("fused", ["1", "0"])
@pytest.mark.parametrize("data,batch", [(2, 8), (3, 7)])
def test_split_step_is_the_single_device_step(net, monkeypatch, fused, data, batch):
    """batchnorm, batchnorm+relu, +relu6, without affine and over [N, C], with parts of
    unequal size (7 rows over 3 devices): loss, gradients and the updated state (running
    statistics included) to 1e-9 in float64, with the fused kernels and without."""
    monkeypatch.setenv("NETDSL_FUSED_KERNELS", fused)
    g = split_step(net.graph, batch, SplitSpec(data=data), OPT)
    ops = {n.op for n in g.nodes}
    assert {"batchnorm", "batchnorm_relu"}.isdisjoint(ops)
    relus = [n.attrs for n in g.by_op("sync_batchnorm") if n.attrs["relu"]]
    assert relus and any(a.get("cap") == 6.0 for a in relus)  # relu and relu6 folded in
    r = verify_split(net.graph, batch, SplitSpec(data=data), OPT, feeds(batch), split=g)
    assert r.reference == "single-device step"
    assert r.ok and max(r.loss_rel, r.grad_rel, r.state_rel) <= 1e-9, r.worst


def test_one_gather_forward_and_one_reduce_backward_a_layer(net):
    """Per batchnorm and device: the moments all-gathered (2 x C values) and the
    backward's two sums all-reduced; the backward reads x, the statistics and the affine
    parameters (sync_batchnorm's `retains`), not the output."""
    g = split_step(net.graph, 8, SplitSpec(data=2), OPT)
    layers = g.by_op("sync_batchnorm")
    assert len(layers) == 2 * 4
    gathers = g.by_op("all_gather")
    assert len(gathers) == len(layers)
    assert all(g[n.inputs[0]].op == "bn_moments" and n.type.shape[0] == 4 for n in gathers)
    reduced = [n for n in g.by_op("all_reduce")
               if g[n.inputs[0]].op == "sync_batchnorm_grad_sums"]
    assert len(reduced) == len(layers)
    assert registry.get("sync_batchnorm").retains == ("inputs",)
    for n in layers:
        read = {i for m in g.nodes if m.meta.get("forward") == n.name for i in m.inputs
                if i in set(n.inputs) | {n.name}}
        assert read == set(n.inputs), n.name


def test_combined_moments_are_the_whole_batchs():
    """bn_combine: Chan's combination of parts of unequal counts, far from zero (no
    cancellation), against the moments of the concatenated data."""
    from netdsl.ir.ops.norm_sync import _bn_combine
    rng = np.random.default_rng(1)
    parts = [rng.standard_normal((n, 3, 4)) * [[1], [1e-3], [10]] + [[1e4], [-2], [0]]
             for n in (5, 1, 9)]
    rows = [np.stack([p.mean(axis=(0, 2)), p.var(axis=(0, 2))]) for p in parts]
    got = _bn_combine(np, [np.concatenate(rows)], {"counts": tuple(4 * len(p) for p in parts)},
                      None)
    whole = np.concatenate(parts)
    np.testing.assert_allclose(got[0], whole.mean(axis=(0, 2)), rtol=1e-14)
    np.testing.assert_allclose(got[1], whole.var(axis=(0, 2)), rtol=1e-10)
    if importlib.util.find_spec("numba") is not None:  # the fused kernel: the same numbers
        from netdsl.backends.numpy_fused import FusedKernels
        fused = np.empty((2, 3))
        FusedKernels.bn_combine(np.concatenate(rows), np.array([20.0, 4.0, 36.0]), fused)
        np.testing.assert_allclose(fused, got, rtol=1e-14)


def test_fused_kernels_are_batchnorms_own_bit_for_bit():
    """bn_moments and bn_normalise are bn_forward's two passes; bn_grad_sums with those
    moments is bn_grad_stats' first two rows, and bn_grad_input with the count of the
    values it sees is the plain batchnorm's dx: the same bits (float32, relu6)."""
    pytest.importorskip("numba")
    from netdsl.backends.numpy_fused import FusedKernels as F
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3, 5, 1100)) * 3 + 1).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    w, b = (rng.standard_normal(5).astype(np.float32) for _ in range(2))
    y, moments = np.empty_like(x), np.empty((2, 5))
    F.bn_forward(x, w, b, 1e-5, True, 6.0, y, moments, 2)
    m2, y2 = np.empty((2, 5)), np.empty_like(x)
    F.bn_moments(x, m2, 2)
    F.bn_normalise(x, m2, w, b, 1e-5, True, 6.0, y2, 2)
    assert np.array_equal(moments, m2) and np.array_equal(y, y2)
    st, sums = np.empty((4, 5), np.float32), np.empty((2, 5), np.float32)
    F.bn_grad_stats(dy, x, w, b, 1e-5, True, 6.0, st, 2)
    F.bn_grad_sums(dy, x, m2, w, b, 1e-5, True, 6.0, sums, 2)
    assert np.array_equal(st[:2], sums)
    dx, dx2 = np.empty_like(x), np.empty_like(x)
    F.bn_grad_input(dy, x, st, w, b, True, 6.0, dx, False, dx, 2)
    F.bn_grad_input(dy, x, st, w, b, True, 6.0, dx2, False, dx2, 2, 3 * 1100)
    assert np.array_equal(dx, dx2)


def test_fused_split_step_agrees_with_the_reference_in_float32(net, monkeypatch):
    """The Numba kernels and the NumPy reference on one float32 data=2 step: the same
    loss and gradients to float32 accuracy (and the kernels are the ones that ran)."""
    pytest.importorskip("numba")
    from netdsl.backends.numpy_fused import FusedKernels
    g = split_step(net.graph, 8, SplitSpec(data=2), OPT)
    roles = ("loss", "grads")
    calls = []
    spy = FusedKernels.bn_normalise
    monkeypatch.setattr(FusedKernels, "bn_normalise",
                        staticmethod(lambda *a: calls.append(1) or spy(*a)))
    runs = []
    for on in ("1", "0"):
        monkeypatch.setenv("NETDSL_FUSED_KERNELS", on)
        out = Executor(g, "numpy", dtype="f32", seed=3).run(feeds(8), roles=roles, step=0)
        runs.append([np.asarray(v, np.float64) for k in roles for v in out[k]])
    assert len(calls) == len(g.by_op("sync_batchnorm"))
    scale = max(np.abs(b).max() for b in runs[1])
    for a, b in zip(*runs, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-5 * scale)


def test_evaluating_a_split_step_is_refused_clearly(net):
    g = split_step(net.graph, 4, SplitSpec(data=2), OPT)
    ex = Executor(g, "numpy", dtype="f64", seed=0)
    with pytest.raises(NetdslError, match="runs in training only"):
        ex.run(feeds(4), training=False, roles=("loss",))


@pytest.mark.parametrize("spec", [SplitSpec(data=2, microbatches=3),
                                  SplitSpec(data=3, microbatches=2),
                                  SplitSpec(data=2, pipeline=2, microbatches=2,
                                            schedule="1f1b")],
                         ids=["data2-m3", "data3-m2", "hybrid-1f1b"])
def test_replicas_with_micro_batches_synchronise_each_micro_batch(net, spec):
    """Micro-batch m of every replica normalises with their joint statistics: the step
    of one device with the same micro-batches (10 rows: parts of 2 and 1 rows), the first
    micro-batch's statistics moving the running ones (once per replica's state)."""
    g = split_step(net.graph, 10, spec, OPT)
    layers = 4
    assert len(g.by_op("all_gather")) == layers * spec.data * spec.microbatches
    assert len(g.by_op("bn_running_update")) == layers * spec.data
    r = verify_split(net.graph, 10, spec, OPT, feeds(10), split=g)
    assert r.reference.startswith("single-device step over the same micro-batches")
    assert r.ok and max(r.loss_rel, r.grad_rel, r.state_rel) <= 1e-9, r.worst


@pytest.mark.parametrize("batch,data,micro", [(10, 2, 3), (7, 3, 2), (16, 2, 4), (9, 2, 2)])
def test_synchronised_micro_batches_are_one_devices_micro_batches(batch, data, micro):
    """With synchronised batchnorm the parts are laid out micro-batch by micro-batch:
    micro-batch m of the replicas tiles one device's micro-batch m; replica by replica
    otherwise (the layout `--bn local` and every other split keep)."""
    from netdsl.ir.placement import even_parts
    from netdsl.parallel.split import _part_rows
    rows = _part_rows(batch, data, micro, by_micro=True)
    for m, (lo, hi) in enumerate(even_parts(batch, micro)):
        parts = [rows[r][m] for r in range(data)]
        assert parts[0][0] == lo and parts[-1][1] == hi
        assert all(a[1] == b[0] and a[1] > a[0] for a, b in zip(parts, parts[1:]))
    flat = _part_rows(batch, data, micro, by_micro=False)
    assert [p for r in flat for p in r] == even_parts(batch, data * micro)


def test_auto_considers_synchronised_hybrids_with_micro_batches(net):
    from netdsl.parallel.choose import candidates
    specs = candidates("auto", 4, 16, None, {}, "sync")
    assert any(s.data > 1 and s.pipeline > 1 and s.microbatches > 1 for s in specs)
    (hybrid,) = candidates("hybrid", 4, 16, None, {}, "sync")
    assert hybrid.microbatches > 1


@pytest.mark.parametrize("spec", [SplitSpec(microbatches=3),
                                  SplitSpec(data=2, microbatches=2),
                                  SplitSpec(pipeline=2, microbatches=3)],
                         ids=["accumulate3", "data2-m2", "pipeline2-m3"])
def test_micro_batches_move_the_running_statistics_as_the_whole_batch(net, spec):
    """Each micro-batch normalises with its own (or its replicas') statistics, but each
    running statistic is updated once a step, from all of them combined: the mean and
    unbiased variance of every row its layer saw, as the unsplit step updates them
    (torchgpipe's deferred batchnorm); every replica's copy alike. The layer's inputs
    are read back from the step and their moments taken with NumPy."""
    from netdsl.ir.placement import canonical
    batch = 10
    g = split_step(net.graph, batch, spec, OPT)
    assert len(g.by_op("bn_running_update")) == 4 * spec.data
    layers: dict[str, list] = {}
    for n in g.by_op("sync_batchnorm"):
        layers.setdefault(n.meta["origin"], []).append(n.inputs[0])
    g.outputs["probe"] = [x for xs in layers.values() for x in xs]
    ex = Executor(g, "numpy", dtype="f64", seed=0)
    seen = iter(ex.run(feeds(batch), roles=tuple(g.outputs), step=0)["probe"])
    checked = 0
    for origin, xs in layers.items():
        x = np.concatenate([next(seen) for _ in xs])
        assert x.shape[0] == batch
        axes = (0,) + tuple(range(2, x.ndim))
        count = x.size // x.shape[1]
        bn = net.graph[origin]  # (a relu's name where batchnorm + relu were fused)
        bn = bn if bn.op == "batchnorm" else net.graph[bn.inputs[0]]
        m = bn.attrs["momentum"]
        want = {"running_mean": m * x.mean(axis=axes),
                "running_var": 1 - m + m * x.var(axis=axes) * count / (count - 1)}
        for name, value in ex.state.items():
            key = canonical(name)
            if key.startswith(bn.name + ".running_"):
                np.testing.assert_allclose(value, want[key.split(".")[-1]], rtol=1e-12,
                                           err_msg=name)
                checked += 1
    assert checked == 8 * spec.data
