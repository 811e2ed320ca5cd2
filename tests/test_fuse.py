"""Fusion: the `fuse` pass (relu(batchnorm(x)) -> batchnorm_relu(x)) as a graph
transformation - the step before and after gives the same losses, gradients, updates and
running statistics - and the fused CPU kernels (Numba, the `fast` extra) against the NumPy
reference kernels they replace."""
from __future__ import annotations

import numpy as np
import pytest
from _examples import example_feeds, load
from test_strategies import decide, run_steps

import netdsl
from netdsl.backends.numpy import NumpyBackend
from netdsl.ir import registry
from netdsl.memory.strategies import apply_decisions
from netdsl.passes.autodiff import autodiff
from netdsl.passes.fuse import fuse, fuse_grads, join_slice_grads
from netdsl.passes.optimizer import add_optimizer
from netdsl.passes.pipeline import run_pipeline
from netdsl.runtime.executor import Executor, KernelContext

WITH_GRADS = ("loss", "output", "grads", "updates")

BRANCHY = """
network branchy {
    input x: f32[N, 3, 5, 4]
    input y: i64[N]
    a = batchnorm(x)
    h = relu(a) + a
    h = relu(batchnorm(h, affine=false))
    h = relu(batchnorm(conv2d(h, 4, kernel=1), zero_init=true))
    h = conv2d(relu(batchnorm(h)), 4, kernel=1) + h
    h = conv2d(batchnorm(h), 4, kernel=1) + h
    logits = linear(flatten(h), 3)
    output logits
    loss softmax_cross_entropy(logits, y)
}
"""


def step(fwd, fused: bool):
    g = autodiff(fuse(fwd, enabled=True) if fused else fwd)
    return add_optimizer(fuse_grads(g, enabled=True) if fused else g, "sgd", lr=0.05,
                         momentum=0.9)


def test_pass_fuses_single_reader_pairs_only():
    g = fuse(netdsl.loads(BRANCHY).lower(2), enabled=True)
    ops = [n.op for n in g.nodes if not n.is_source]
    # `a` is read by the relu and the add: left as it was; the other two pairs fused
    assert ops.count("batchnorm") == 2 and ops.count("relu") == 1
    assert ops.count("batchnorm_relu") == 3
    f = g.by_op("batchnorm_relu")
    assert not f[0].attrs["affine"] and f[1].attrs["zero_init"]
    assert f[1].meta["fused"][1] == f[1].name  # named after the relu: its readers unchanged
    assert f[1].loc is not None and f[1].loc.line == 8  # the batchnorm's source line
    assert fuse(g, enabled=False) is g
    assert "batchnorm_relu(" in g.to_text()


def test_gradient_sums_fold_into_batchnorm_dx():
    """ResNet-164's block inputs are read by a batchnorm and the shortcut: the sum of their
    two gradients is written by the batchnorm's dx node."""
    g = autodiff(fuse(load("resnet164-cifar.net").lower(2), enabled=True))
    sums = [n for n in g.by_op("add") if "sums_gradient_of" in n.meta]
    h = fuse_grads(g, enabled=True)
    acc = [n for n in h.by_op("batchnorm_grad_from_stats") if len(n.inputs) == 6]
    assert len(acc) >= 50 and len(h.by_op("add")) == len(g.by_op("add")) - len(acc)
    assert {n.name for n in acc} <= {n.name for n in sums}  # named after the adds
    assert all(n.meta["sums_gradient_of"] and n.inputs[-1] in g for n in acc)
    assert fuse_grads(g, enabled=False) is g


def test_env_switches_the_pass_off(monkeypatch):
    fwd = netdsl.loads(BRANCHY).lower(2)
    monkeypatch.setenv("NETDSL_FUSE", "0")
    assert run_pipeline(fwd, ["fuse"]).by_op("batchnorm_relu") == []
    monkeypatch.setenv("NETDSL_FUSE", "1")
    assert len(run_pipeline(fwd, ["fuse"]).by_op("batchnorm_relu")) == 3


def test_a_gpu_step_is_fused_without_numba_and_a_cpu_step_only_with_it(monkeypatch):
    """The CuPy backend's CUDA kernels run the fused ops whether or not Numba is there:
    a GPU step (the Trainer's on CuPy) is fused unless NETDSL_FUSE=0; a CPU step only
    where the Numba kernels are."""
    import importlib.util

    from netdsl.config import TrainConfig
    from netdsl.step.graphs import training_graph
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "numba" else real(name, *a))
    monkeypatch.delenv("NETDSL_FUSE", raising=False)
    fwd = load("resnet20-cifar.net").lower(2)
    def fused(device):
        step = training_graph(fwd, TrainConfig(), device)
        return len(step.by_op("batchnorm_relu")), len(step.by_op("add_relu"))
    gpu = fused("gpu")
    assert gpu[0] >= 10 and gpu[1] == 9  # (resnet20's nine blocks end in relu(add))
    assert fused("cpu") == (0, 0)
    monkeypatch.setenv("NETDSL_FUSE", "0")
    assert fused("gpu") == (0, 0)


@pytest.mark.parametrize("example,batch", [("resnet20-cifar", 2), ("branchy", 3)])
def test_fused_step_matches_the_unfused_step(example, batch):
    fwd = (netdsl.loads(BRANCHY) if example == "branchy" else load(f"{example}.net")).lower(batch)
    g, h = step(fwd, False), step(fwd, True)
    assert h.by_op("batchnorm_relu") and len(h.by_op("relu_grad")) < len(g.by_op("relu_grad"))
    if example == "branchy":  # both gradient sums of a batchnorm's input folded into its dx
        assert sum(len(n.inputs) == 6 for n in h.by_op("batchnorm_grad_from_stats")) == 2
    else:  # post-activation blocks: relu(bn(conv) + shortcut), its input's gradient sum
        assert len(h.by_op("add_relu")) == 9
        assert sum(len(n.inputs) == 3 for n in h.by_op("relu_grad")) == 8
        # the stem's output (a batchnorm_relu's) keeps its sum: its backward reads dy twice
        assert [n.meta["sums_gradient_of"] for n in h.by_op("add")] == ["cifar_stem.relu"]
    assert_same_steps(g, h, rtol=1e-9, atol=1e-12)


RESIDUAL = """
network residual {
    input x: f32[N, 3, 5, 4]
    input y: i64[N]
    h = conv2d(x, 4, kernel=1)
    h = conv2d(relu(h), 4, kernel=1, bias=false) + h
    h = h + conv2d(h, 4, kernel=3, padding=1)
    k = conv2d(h, 4, kernel=1)
    h = k + conv2d(h, 4, kernel=1) + k
    c = conv2d(h, 4, kernel=1)
    h = c + h
    h = conv2d(h, 4, kernel=1) + parameter((4, 1, 1))
    t = flatten(h)
    t = linear(t, 80) + t
    logits = linear(tanh(t), 3)
    output logits
    output c
    loss softmax_cross_entropy(logits, y)
}
"""


def test_residual_adds_fold_into_the_products_only_they_read():
    """add(conv2d(x), r) -> conv2d_add(x, r) and add(linear(x), r) -> linear_add(x, r), r
    either term, named after the add; not where the product has another reader or is a
    graph output, nor for a broadcasting add, nor with residuals=False."""
    fwd = netdsl.loads(RESIDUAL).lower(2)
    g = fuse(fwd, enabled=True)
    ops = [n.op for n in g.nodes if not n.is_source]
    # the 1x1 and the 3x3 with `h` either side; `k + conv2d(h)`'s conv (k has two readers)
    assert ops.count("conv2d_add") == 3 and ops.count("linear_add") == 1
    # the first conv (read by relu and the add), k, c (an output), the broadcast one's
    assert ops.count("conv2d") == 4 and ops.count("add") == 3
    for f in g.by_op("conv2d_add") + g.by_op("linear_add"):
        product, add = f.meta["fused"]
        assert add == f.name and fwd[add].op == "add" and f.loc == fwd[product].loc
        assert f.inputs[0] == fwd[product].inputs[0] and f.inputs[1] in fwd[add].inputs
        assert f.inputs[2:] == fwd[product].inputs[1:] and f.type == fwd[add].type
    assert "conv2d_add(" in g.to_text() and "linear_add(" in g.to_text()
    kept = fuse(fwd, enabled=True, residuals=False)
    assert not kept.by_op("conv2d_add") and not kept.by_op("linear_add")
    assert len(kept.by_op("add")) == 7


@pytest.mark.parametrize("example,batch", [("residual", 3), ("transformer-tiny", 2)])
def test_residual_fusion_keeps_every_number(example, batch):
    """The step with the residuals folded into the products computes the unfused step's
    numbers bit for bit: the product, its bias, then the residual, in the same order."""
    src = netdsl.loads(RESIDUAL) if example == "residual" else load(f"{example}.net")
    fwd = src.lower(batch)
    g = add_optimizer(autodiff(fuse(fwd, enabled=True, residuals=False)), "sgd", lr=0.05,
                      momentum=0.9)
    h = add_optimizer(autodiff(fuse(fwd, enabled=True)), "sgd", lr=0.05, momentum=0.9)
    assert h.by_op("linear_add") and len(h.by_op("add")) < len(g.by_op("add"))
    assert_same_steps(g, h, rtol=0, atol=0)


def test_residual_fusion_in_float32_on_the_fused_kernels_keeps_the_bits(monkeypatch):
    """In float32 on the GEMM tasks (1x1 products of 16 -> 64 channels at 32x32, over the
    size where the loops take them), on one thread and on two: the same losses and
    gradients as the unfused step's."""
    numba = pytest.importorskip("numba")
    net = netdsl.loads("""
network wide {
    input x: f32[N, 16, 32, 32]
    input y: i64[N]
    h = conv2d(x, 64, kernel=1, bias=false)
    h = conv2d(relu(conv2d(relu(h), 16, kernel=1)), 64, kernel=1, bias=false) + h
    logits = linear(flatten(global_avgpool(h)), 3)
    output logits
    loss softmax_cross_entropy(logits, y)
}""")
    fwd = net.lower(4)
    g = autodiff(fuse(fwd, enabled=True, residuals=False))
    h = autodiff(fuse(fwd, enabled=True))
    assert len(h.by_op("conv2d_add")) == 1
    feeds = example_feeds(g)
    for threads in ("1", "2"):
        monkeypatch.setenv("OMP_NUM_THREADS", threads)
        runs = []
        for graph in (g, h):
            ex = Executor(graph, "numpy", dtype="f32", seed=3)
            assert ex.backend.fused.threads == min(int(threads),
                                                   numba.config.NUMBA_NUM_THREADS)
            r = ex.run(feeds, roles=("loss", "grads"))
            runs.append([np.array(v) for k in ("loss", "grads") for v in r[k]])
        for a, b in zip(*runs, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("example,batch", [("residual", 2), ("transformer-tiny", 2)])
@pytest.mark.parametrize("mode", ["recompute", "offload", "layer-adaptive"])
def test_residual_products_under_the_memory_strategies_and_in_the_arena(example, batch,
                                                                          mode):
    """conv2d_add and linear_add recomputed (their residual kept or rebuilt too),
    offloaded, and run at their planned offsets (transformer-tiny's attention_qkv too):
    the planned step's numbers are the unplanned one's bit for bit, and the executor
    counts what the plan says."""
    from netdsl.memory.plan import make_plan
    src = netdsl.loads(RESIDUAL) if example == "residual" else load(f"{example}.net")
    g = add_optimizer(autodiff(fuse(src.lower(batch), enabled=True)), "sgd", lr=0.05,
                      momentum=0.9)
    assert g.by_op("linear_add")
    assert bool(g.by_op("attention_qkv")) == (example == "transformer-tiny")
    feeds = example_feeds(g)
    ref, ref_state, _ = run_steps(g, feeds)
    h = apply_decisions(g, decide(g, mode))
    if mode == "recompute":
        assert any(n.meta.get("phase") == "recompute" for n in h.by_op("linear_add"))
    got, got_state, ex = run_steps(h, feeds)
    for a_step, b_step in zip(ref, got, strict=True):
        for a, b in zip(a_step, b_step, strict=True):
            np.testing.assert_array_equal(a, b)
    for k in ref_state:
        np.testing.assert_array_equal(got_state[k], ref_state[k], err_msg=k)
    ex.reset_peak()
    ex.run(feeds, roles=("loss", "output", "updates"))
    assert ex.peak_bytes == make_plan(h, ("loss", "output", "updates"), "f64").peak_bytes
    arena = Executor(h, "numpy", dtype="f64", seed=7, arena=True)
    r = arena.run(feeds, roles=WITH_GRADS)
    assert all(np.array_equal(a, np.array(b)) for a, b in
               zip(ref[0], [v for key in ("loss", "grads") for v in r[key]], strict=True))


def test_only_a_cpu_step_folds_residuals_into_products(monkeypatch):
    """A GPU adds the residual after the product, one launch as the add's: its step is
    left with the add."""
    from netdsl.config import TrainConfig
    from netdsl.step.graphs import training_graph
    monkeypatch.setenv("NETDSL_FUSE", "1")
    fwd = load("resnet164-cifar.net").lower(2)
    assert len(training_graph(fwd, TrainConfig(), "cpu").by_op("conv2d_add")) == 54
    assert not training_graph(fwd, TrainConfig(), "gpu").by_op("conv2d_add")


CAPPED = """
network capped {
    input x: f32[N, 3, 6, 6]
    input y: i64[N]
    h = relu6(batchnorm(conv2d(x, 4, kernel=3, padding=1, bias=false)))
    h = relu6(batchnorm(conv2d(h, 4, kernel=3, padding=1, groups=4, bias=false)))
    a = batchnorm(h)
    h = relu6(a) + a
    logits = linear(flatten(h), 3)
    output logits
    loss softmax_cross_entropy(logits, y)
}
"""


def test_relu6_after_batchnorm_fuses_with_a_cap_and_matches_the_unfused_step():
    """relu6(batchnorm(x)) becomes batchnorm_relu(x, cap=6) where the relu6 is the only
    reader (MobileNets); the step's numbers are the unfused ones'."""
    fwd = netdsl.loads(CAPPED).lower(3)
    g, h = step(fwd, False), step(fwd, True)
    fused = h.by_op("batchnorm_relu")
    assert len(fused) == 2 and all(n.attrs["cap"] == 6.0 for n in fused)
    assert len(h.by_op("relu6")) == 1 and len(h.by_op("relu6_grad")) == 1  # `a`: two readers
    assert all(n.attrs["cap"] == 6.0 and n.attrs["relu"] for n in h.by_op("batchnorm_grad_stats")
               if n.attrs["relu"])
    assert_same_steps(g, h, rtol=1e-9, atol=1e-12)


def assert_same_steps(g, h, rtol, atol):
    """Training steps of graphs g and h give the same losses, every gradient and the same
    state after (parameters, momentum, BN running statistics)."""
    feeds = example_feeds(g)
    ref, ref_state, _ = run_steps(g, feeds)
    got, got_state, _ = run_steps(h, feeds)
    for a_step, b_step in zip(ref, got, strict=True):
        for a, b in zip(a_step, b_step, strict=True):
            np.testing.assert_allclose(b, a, rtol=rtol, atol=atol)
    assert ref_state.keys() == got_state.keys()
    for k in ref_state:
        np.testing.assert_allclose(got_state[k], ref_state[k], rtol=rtol, atol=atol, err_msg=k)


SLICES = """
network slices {
    input x: f32[N, 6]
    input y: i64[N]
    h = linear(x, 9)
    k = linear(x, 8)
    m = linear(x, 6)
    a = slice(h, axis=1, start=0, stop=3)
    b = slice(h, axis=1, start=3, stop=6)
    c = slice(h, axis=1, start=6, stop=9)
    e = slice(k, axis=1, start=0, stop=3)
    f = slice(k, axis=1, start=5, stop=8)
    p = slice(m, axis=1, start=0, stop=3)
    q = slice(m, axis=1, start=0, stop=3)
    r = slice(m, axis=1, start=3, stop=6)
    logits = tanh(c) * b + a + tanh(e) * f + p * q + r
    output logits
    loss softmax_cross_entropy(logits, y)
}
"""


@pytest.mark.parametrize("example,batch,joins", [("transformer-tiny", 2, 2), ("slices", 3, 1)])
def test_slice_gradients_that_tile_an_axis_join_into_one_concat(example, batch, joins):
    """q, k and v cut from one projection: their gradients' sum becomes one concat, and
    the step's losses and every gradient are those of the graph as autodiff wrote it. A
    sum whose slices leave a gap (e and f) or overlap (p and q) stays as it was."""
    fwd = (netdsl.loads(SLICES) if example == "slices" else load(f"{example}.net")).lower(batch)
    g = add_optimizer(autodiff(fwd), "sgd", lr=0.05, momentum=0.9)
    h = join_slice_grads(g)
    joined = h.by_op("concat")
    assert len(joined) == joins and all(n.meta["joined"] for n in joined)
    assert all("sums_gradient_of" not in n.meta and n.name in g for n in joined)
    assert len(h.by_op("slice_grad")) == len(g.by_op("slice_grad")) - 3 * joins
    assert len(h.by_op("add")) == len(g.by_op("add")) - 2 * joins
    assert_same_steps(g, h, rtol=1e-12, atol=1e-14)


def test_fused_step_under_recompute_and_in_the_arena():
    """Recompute replays of batchnorm_relu update the running statistics once; the arena
    run equals the plain one bit for bit; the executor counts what the plan says."""
    g = step(load("resnet20-cifar.net").lower(2), True)
    feeds = example_feeds(g)
    ref, ref_state, _ = run_steps(g, feeds)
    h = apply_decisions(g, decide(g, "recompute"))
    assert any(n.attrs.get("replay") for n in h.by_op("batchnorm_relu"))
    got, got_state, ex = run_steps(h, feeds)
    for a, b in zip(ref[1], got[1], strict=True):
        np.testing.assert_array_equal(a, b)
    for k in ref_state:
        np.testing.assert_array_equal(got_state[k], ref_state[k])
    arena = Executor(g, "numpy", dtype="f64", seed=7, arena=True)
    for k in range(2):
        r = arena.run(feeds, roles=WITH_GRADS)
        got = [np.array(v) for key in ("loss", "grads") for v in r[key]]
        assert all(np.array_equal(a, b) for a, b in zip(ref[k], got, strict=True))
    assert arena.peak_bytes <= arena.plan(WITH_GRADS).peak_bytes


# -- fused kernels against the NumPy reference ------------------------------------------------
class _Reference:
    fused = None  # kernels find no fused loops: their NumPy code runs


def _kernels(op, ins, attrs, backend, training=True, out=None):
    ctx = KernelContext(training, backend, str(ins[0].dtype), out=out)
    return registry.get(op).kernel(np, ins, attrs, ctx)


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 7), (3, 5, 4, 6), (2, 2, 3, 2, 3),
                                   (3, 2, 40, 41)])  # rows of more than one sum block
@pytest.mark.parametrize("relu", [False, True, 0.8])  # 0.8: capped there (as relu6 at 6)
@pytest.mark.parametrize("affine", [False, True])
def test_fused_kernels_match_the_reference(dtype, tol, shape, relu, affine):
    pytest.importorskip("numba")
    cap = {"cap": relu} if relu not in (False, True) else {}
    fast = NumpyBackend()
    assert fast.fused is not None
    rng = np.random.default_rng(sum(shape) + (2 if cap else int(relu)) + 3 * affine)
    c = shape[1]
    x = (rng.standard_normal(shape) * 3 + 5).astype(dtype)  # a mean far from 0
    dy = rng.standard_normal(shape).astype(dtype)
    w, b = rng.standard_normal(c).astype(dtype), rng.standard_normal(c).astype(dtype)
    a = {"eps": 1e-5, "momentum": 0.2, "affine": affine, "zero_init": False, **cap}
    op = "batchnorm_relu" if relu else "batchnorm"
    res = []
    for backend in (_Reference(), fast):
        rm, rv = np.full(c, 0.5, dtype), np.full(c, 2.0, dtype)
        params = [w, b] if affine else []
        slot = np.full(shape, np.nan, dtype)  # a planned slot: written, not copied into
        y = _kernels(op, [x] + params + [rm, rv], a, backend, out=slot)
        assert y is slot or np.shares_memory(y, slot)
        y = y.copy()
        ev = _kernels(op, [x] + params + [rm, rv], a, backend, training=False)
        mask_in = params if relu else []
        st = _kernels("batchnorm_grad_stats", [dy, x] + mask_in,
                      {"eps": 1e-5, "relu": bool(relu), **cap}, backend)
        dx = _kernels("batchnorm_grad_from_stats", [dy, x, st] + (mask_in or params[:1]),
                      {"relu": bool(relu), **cap}, backend)
        res.append((y, ev, rm, rv, st, dx))
        if affine:  # with a gradient to add (acc, after weight and bias)
            dx_acc = _kernels("batchnorm_grad_from_stats", [dy, x, st, w, b, dy * 3],
                              {"relu": bool(relu), **cap}, backend)
            np.testing.assert_allclose(dx_acc, dx + dy * 3, rtol=0, atol=tol * 10)
    for name, u, v in zip(("y", "eval", "running mean", "running var", "stats", "dx"),
                          *res, strict=True):
        assert u.dtype == v.dtype == dtype, name
        scale = max(float(np.abs(u).max()), 1.0)
        np.testing.assert_allclose(v, u, rtol=0, atol=tol * scale, err_msg=name)
    if relu:  # the same elements are zero (the mask is the forward's exactly)
        assert np.array_equal(res[0][0] > 0, res[1][0] > 0)
    if cap:  # the cap bites, and the same elements are under it
        assert (res[0][0] == relu).any()
        assert np.array_equal(res[0][0] < relu, res[1][0] < relu)


@pytest.mark.parametrize("shape", [(16, 3, 1024), (5, 2, 2500), (16, 4, 64)])
def test_fused_float32_moments_are_float32_exact(shape):
    """float32 sums in blocks of a row, float64 across blocks: the batch mean and variance
    within a few float32 roundings of float64's over the same data, a mean far from zero
    included (the shifted one-pass variance does not cancel)."""
    pytest.importorskip("numba")
    from netdsl.backends import numpy_fused_norm as f
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(shape) * 3 + 1000).astype(np.float32)
    c = shape[1]
    moments = np.empty((2, c))
    f.bn_forward(x, np.ones(c, np.float32), np.zeros(c, np.float32), 1e-5, False, np.inf,
                 np.empty_like(x), moments, 2)
    x64 = x.astype(np.float64)
    # (measured: mean within 1e-10 relative, variance within 1.5e-7; without the shift the
    # variance of data at 1000 +- 3 would lose about 1% to cancellation)
    np.testing.assert_allclose(moments[0], x64.mean(axis=(0, 2)), rtol=0, atol=3e-6)
    np.testing.assert_allclose(moments[1], x64.var(axis=(0, 2)), rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("op,attrs", [("relu6_grad", {}), ("clip_grad", {"min": 0.1, "max": None}),
                                      ("clip_grad", {"min": -1.5, "max": 2.0})])
def test_window_gradients_in_one_pass_equal_the_reference_bits(op, attrs, dtype):
    """relu6's and clip's gradients in the fused kernels' one pass: the reference's product
    with the 0/1 mask bit for bit, at and around the bounds (open for relu6, closed for
    clip, compared in the data's dtype), with NaN, inf and -0.0 in x and in dy."""
    pytest.importorskip("numba")
    rng = np.random.default_rng(9)
    edges = [0.0, -0.0, 6.0, 0.1, -1.5, 2.0, np.nan, np.inf, -np.inf]
    x = np.concatenate([rng.uniform(-8, 8, 40001), edges, np.nextafter(edges[:6], 9),
                        np.nextafter(edges[:6], -9)]).astype(dtype)
    dy = rng.standard_normal(x.size).astype(dtype)
    dy[:5] = [np.nan, np.inf, -np.inf, -0.0, 0.0]
    x, dy = x.reshape(2, -1), dy.reshape(2, -1)
    got = _kernels(op, [dy, x], attrs, NumpyBackend())
    with np.errstate(invalid="ignore"):  # inf * 0 in the reference's product: NaN, as wanted
        want = _kernels(op, [dy, x], attrs, _Reference())
    assert got.dtype == want.dtype == dtype
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))


def test_vectorised_exp_is_within_an_ulp():
    """GELU's gradient's exp (Cephes' expf, 2^n from its bits) against float64's: within
    one float32 ulp over [-87, 0], 0 below -87 (and at -inf), NaN for NaN."""
    numba = pytest.importorskip("numba")
    from netdsl.backends.numpy_fused_activation import exp_of_nonpositive

    @numba.njit
    def exp_all(t, out):
        for i in range(t.size):
            out[i] = exp_of_nonpositive(t[i])

    t = np.concatenate([-np.linspace(0, 87, 400001), [-87.5, -100.0, -np.inf, np.nan]])
    t = t.astype(np.float32)
    e = np.empty_like(t)
    exp_all(t, e)
    want = np.exp(t[:-4].astype(np.float64))
    assert np.abs(e[:-4] - want).max() <= 2.0 ** -23 * want.max()
    assert (np.abs(e[:-4] - want) / want).max() < 2.0 ** -23  # 1.19e-7
    assert list(e[-4:-1]) == [0.0, 0.0, 0.0] and np.isnan(e[-1])


def test_fused_gelu_matches_the_exact_erf_in_float32():
    """GELU and its gradient in float32 (a vectorised rational erf) against the reference
    (SciPy's erf, in float64): within 1e-6 absolute over [-6, 6], the same special values,
    any shape; float64 keeps the exact kernel (bit for bit the reference's)."""
    pytest.importorskip("numba")
    import math
    fast = NumpyBackend()
    a = {"approximate": "none"}
    x = np.concatenate([np.linspace(-6, 6, 120001), [0.0, -0.0, 1e-30, 7.0, 40.0, -40.0,
                                                     np.inf, np.nan]]).astype(np.float32)
    dy = np.random.default_rng(0).standard_normal(x.shape).astype(np.float32)
    x64 = x.astype(np.float64)
    with np.errstate(invalid="ignore"):
        phi = 0.5 * (1.0 + np.vectorize(math.erf)(x64 / math.sqrt(2.0)))
        want = x64 * phi
        want_dx = dy * (phi + x64 * np.exp(-0.5 * x64 * x64) / math.sqrt(2 * math.pi))
    y = _kernels("gelu", [x.reshape(3, -1)], a, fast).reshape(-1)
    dx = _kernels("gelu_grad", [dy.reshape(3, -1), x.reshape(3, -1)], a, fast)
    dx = dx.reshape(-1)
    assert y.dtype == dx.dtype == np.float32
    ok = np.isfinite(want)
    np.testing.assert_allclose(y[ok], want[ok], rtol=0, atol=1e-6)
    np.testing.assert_allclose(dx[ok], want_dx[ok], rtol=0, atol=1e-6 * np.abs(dy[ok]).max())
    assert np.isnan(y[-1]) and np.isnan(dx[-1]) and y[-2] == np.inf
    assert _kernels("gelu", [x[:-8]], a, fast)[-120001:-60000].max() <= 0  # x <= 0 side
    ref, x64 = NumpyBackend(), x64[:-2]
    ref._fused = None
    y64 = _kernels("gelu", [x64], a, fast)  # float64: the exact erf either way
    assert np.array_equal(y64, _kernels("gelu", [x64], a, ref))
    np.testing.assert_allclose(y64, want[:-2], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
@pytest.mark.parametrize("shape,axis,affine", [((6, 5), -1, True), ((3, 4, 7), -1, True),
                                               ((2, 3, 4, 5), 2, True), ((4, 9), 1, False)])
def test_fused_layernorm_matches_the_reference(shape, axis, affine, dtype, tol):
    pytest.importorskip("numba")
    rng = np.random.default_rng(len(shape) + affine)
    x = (rng.standard_normal(shape) * 3 + 7).astype(dtype)  # a mean far from 0
    dy = rng.standard_normal(shape).astype(dtype)
    norm = shape[axis % len(shape):]
    w, b = rng.standard_normal(norm).astype(dtype), rng.standard_normal(norm).astype(dtype)
    a = {"eps": 1e-5, "axis": axis, "affine": affine}
    ref = NumpyBackend()
    ref._fused = None
    res = []
    for backend in (ref, NumpyBackend()):
        params = [w, b] if affine else []
        res.append([_kernels("layernorm", [x] + params, a, backend),
                    _kernels("layernorm_grad_input", [dy, x] + params[:1], a, backend),
                    _kernels("layernorm_grad_weight", [dy, x], a, backend)])
    assert res[1][0] is not None
    for name, u, v in zip(("y", "dx", "dw"), *res, strict=True):
        assert u.dtype == v.dtype == dtype and u.shape == v.shape, name
        scale = max(float(np.abs(u).max()), 1.0)
        np.testing.assert_allclose(v, u, rtol=0, atol=tol * scale, err_msg=name)


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-13), (np.float32, 1e-6)])
@pytest.mark.parametrize("shape,axis", [((5, 7), -1), ((2, 3, 4, 6), 3), ((3, 4, 5), 1)])
def test_fused_softmax_matches_the_reference(shape, axis, dtype, tol):
    """Rows of the last axis in Numba (another axis keeps the NumPy kernel); large and
    equal logits (max shift), -inf (a zero probability)."""
    pytest.importorskip("numba")
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(shape) * 30).astype(dtype)
    x.flat[0:3] = 500.0
    x.flat[5] = -np.inf
    dy = rng.standard_normal(shape).astype(dtype)
    ref = NumpyBackend()
    ref._fused = None
    res = []
    for backend in (ref, NumpyBackend()):
        y = _kernels("softmax", [x], {"axis": axis}, backend)
        res.append((y, _kernels("softmax_grad", [dy, y], {"axis": axis}, backend)))
    for u, v in zip(*res, strict=True):
        assert u.dtype == v.dtype == dtype
        np.testing.assert_allclose(v, u, rtol=0, atol=tol * max(float(np.abs(u).max()), 1.0))
    np.testing.assert_allclose(res[1][0].sum(axis=axis), 1.0, rtol=tol * 10)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_softmax_rows_with_nan_or_inf_are_the_references(dtype):
    """A NaN anywhere in a row (first, inside the four maximum chains, in the remainder),
    +inf, a row all -inf: the fused rows give what NumPy's softmax gives (NaN rows)."""
    pytest.importorskip("numba")
    x = np.random.default_rng(4).standard_normal((6, 11)).astype(dtype)
    x[0, 0] = x[1, 3] = x[2, 10] = np.nan
    x[3, 5] = np.inf
    x[4, :] = -np.inf
    ref = NumpyBackend()
    ref._fused = None
    with np.errstate(invalid="ignore"):  # inf - inf, as intended
        u, v = (_kernels("softmax", [x], {"axis": -1}, b) for b in (ref, NumpyBackend()))
    assert np.isnan(u[:5]).all() and np.isnan(v[:5]).all()
    np.testing.assert_allclose(v[5], u[5], rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("momentum,nesterov,wd", [(0.0, False, 0.0), (0.9, False, 0.0),
                                                  (0.9, True, 5e-4), (0.0, False, 1e-2)])
def test_fused_sgd_is_the_reference_bit_for_bit(dtype, momentum, nesterov, wd):
    pytest.importorskip("numba")
    rng = np.random.default_rng(7)
    p0, g = (rng.standard_normal((3, 5, 7)).astype(dtype) for _ in range(2))
    buf0 = rng.standard_normal(p0.shape).astype(dtype)
    a = {"momentum": momentum, "nesterov": nesterov, "weight_decay": wd}
    ref = NumpyBackend()
    ref._fused = None
    out = []
    for backend in (ref, NumpyBackend()):
        p, buf = p0.copy(), buf0.copy()
        for step in range(3):  # the buffer carries over
            r = _kernels("sgd_update", [p, g * (step + 1), np.array(0.05), buf], a, backend)
            assert r is p
        out.append((p, buf))
    assert np.array_equal(out[0][0], out[1][0]) and np.array_equal(out[0][1], out[1][1])
    assert not np.array_equal(out[0][0], p0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("wd,decoupled", [(0.0, False), (0.01, False), (0.01, True)])
def test_fused_adam_is_the_reference_bit_for_bit(dtype, wd, decoupled):
    pytest.importorskip("numba")
    rng = np.random.default_rng(8)
    p0, g = (rng.standard_normal((4, 6)).astype(dtype) for _ in range(2))
    a = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": wd,
         "decoupled": decoupled}
    ref = NumpyBackend()
    ref._fused = None
    out = []
    for backend in (ref, NumpyBackend()):
        p, m, v = p0.copy(), np.zeros_like(p0), np.zeros_like(p0)
        for step in range(1, 4):
            r = _kernels("adam_update", [p, g * step, np.array(1e-3), m, v,
                                         np.array(step, np.int64)], a, backend)
            assert r is p
        out.append((p, m, v))
    for u, w in zip(*out, strict=True):
        assert np.array_equal(u, w)
    assert not np.array_equal(out[0][0], p0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(3, 4, 5), (5, 3, 71, 41)])  # one block; several, cut
def test_fused_relu_kernels_are_the_reference_bit_for_bit(dtype, shape):
    """add, add_relu and relu_grad (with and without the folded sum) in one Numba pass
    each, blocks of elements on the loops' threads, to the bit of the NumPy kernels: NaN,
    inf and signed zeros included."""
    pytest.importorskip("numba")
    rng = np.random.default_rng(10)
    a, b, dy, acc = (rng.standard_normal(shape).astype(dtype) for _ in range(4))
    a.flat[:6] = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1.0]
    b.flat[:6] = [1.0, -np.inf, 1.0, 0.0, -0.0, -1.0]
    dy.flat[:3] = [np.inf, np.nan, -0.5]
    ref = NumpyBackend()
    ref._fused = None
    out = []
    with np.errstate(invalid="ignore"):  # inf - inf, inf * 0: NaN, as in the reference
        for backend in (ref, NumpyBackend()):
            y = _kernels("add_relu", [a, b], {}, backend)
            out.append((y, _kernels("relu_grad", [dy, y], {}, backend),
                        _kernels("relu_grad", [dy, y, acc], {}, backend),
                        _kernels("add", [a, b], {}, backend)))
        want = (dy + acc) * (out[0][0] > 0)
        total = np.empty_like(a)  # the add loop itself (the kernel takes it on 2+ threads)
        NumpyBackend().fused.add(a.reshape(-1), b.reshape(-1), False, total.reshape(-1))
        out[0] += (total,)
        out[1] += (a + b,)
    for u, v in zip(*out, strict=True):
        assert u.dtype == v.dtype == dtype
        assert np.array_equal(u.view(f"u{u.itemsize}"), v.view(f"u{v.itemsize}"))  # bits
    assert np.isnan(out[1][0].flat[0]) and out[1][0].flat[3] == 0 and (out[1][0] >= 0).sum() > 50
    np.testing.assert_array_equal(out[1][2], want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("geom", [  # kh, kw, sh, sw, ph, pw, dh, dw
    (3, 3, 1, 1, 1, 1, 1, 1), (7, 7, 2, 2, 3, 3, 1, 1), (3, 2, 2, 3, 2, 0, 2, 1),
    (3, 3, 1, 1, 0, 0, 1, 1), (3, 3, 1, 1, 4, 4, 1, 1), (1, 1, 2, 2, 0, 0, 1, 1)])
def test_fused_im2col_is_the_reference_bit_for_bit(dtype, geom):
    """The folded convolution's columns, read from the unpadded x by one Numba pass per
    row (padding wider than the image included), are NumPy's copy of the windows."""
    pytest.importorskip("numba")
    from netdsl.ir.ops.conv import _folded_columns
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    x = np.random.default_rng(12).standard_normal((3, 2, 7, 9)).astype(dtype)
    x.flat[:3] = [np.nan, -0.0, np.inf]
    ho = (7 + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    wo = (9 + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    u = _folded_columns(np, x, geom, ho, wo, None)
    v = _folded_columns(np, x, geom, ho, wo, NumpyBackend().fused)
    assert u.shape == v.shape == (2 * kh * kw, 3 * ho * wo) and v.dtype == dtype
    assert np.array_equal(u.view(f"u{u.itemsize}"), v.view(f"u{v.itemsize}"))  # bits


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kernel,stride,padding,dilation,groups", [
    ((3, 3), (2, 2), (1, 1), (1, 1), 1), ((3, 3), (2, 2), (2, 2), (2, 2), 1),
    ((2, 3), (3, 2), (0, 1), (1, 1), 2), ((1, 1), (2, 2), (0, 0), (1, 1), 1)])
def test_fused_col2im_is_the_reference_bit_for_bit(dtype, kernel, stride, padding,
                                                    dilation, groups):
    """A strided convolution's input gradient scatters its columns back with one Numba
    pass per plane: the offsets in NumPy's order, so the same sums to the bit."""
    pytest.importorskip("numba")
    rng = np.random.default_rng(11)
    n, c, o, h, w = 3, 4, 6, 9, 8
    a = {"kernel": kernel, "stride": stride, "padding": padding, "dilation": dilation,
         "groups": groups, "shape": (n, c, h, w)}
    ho = (h + 2 * padding[0] - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1
    wo = (w + 2 * padding[1] - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
    dy = rng.standard_normal((n, o, ho, wo)).astype(dtype)
    wt = rng.standard_normal((o, c // groups) + kernel).astype(dtype)
    ref = NumpyBackend()
    ref._fused = None
    u, v = (_kernels("conv2d_grad_input", [dy, wt], a, backend)
            for backend in (ref, NumpyBackend()))
    assert u.shape == v.shape == (n, c, h, w) and u.dtype == v.dtype == dtype
    assert np.array_equal(u, v) and np.abs(u).max() > 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_scatter_add_is_add_at_bit_for_bit(dtype):
    """embedding_grad and gather_grad (axis 0) scatter rows with one Numba loop: repeated
    ids accumulate in add.at's order, so the sums are the same to the bit."""
    pytest.importorskip("numba")
    rng = np.random.default_rng(9)
    ids = rng.integers(0, 7, size=(5, 6))  # 30 ids over 7 rows: most rows repeat
    dy = rng.standard_normal((5, 6, 3)).astype(dtype)
    ref = NumpyBackend()
    ref._fused = None
    for op, a in (("embedding_grad", {"num": 7}),
                  ("gather_grad", {"shape": (7, 3), "axis": 0})):
        u, v = (_kernels(op, [dy, ids], a, backend) for backend in (ref, NumpyBackend()))
        assert u.dtype == v.dtype == dtype and u.shape == v.shape == (7, 3)
        assert np.array_equal(u, v), op
        np.testing.assert_allclose(u[3], dy[ids == 3].sum(axis=0), rtol=1e-6)


_NO_COMPILE_PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import numba
from _examples import example_feeds, load
from netdsl.backends import (numpy_fused, numpy_fused_activation, numpy_fused_attention,
                             numpy_fused_depthwise, numpy_fused_gemm, numpy_fused_loss,
                             numpy_fused_norm, numpy_fused_optim, numpy_fused_pool,
                             numpy_fused_scatter, numpy_winograd)
from netdsl.backends.numpy import NumpyBackend
from netdsl.passes.autodiff import autodiff
from netdsl.passes.fuse import fuse, fuse_grads
from netdsl.passes.optimizer import add_optimizer
from netdsl.runtime.executor import Executor
be = NumpyBackend()
assert be.fused is not None and not be.fused.loaded  # nothing loads before an executor
modules = (numpy_fused_activation, numpy_fused_attention, numpy_fused_depthwise,
           numpy_fused_gemm, numpy_fused_loss, numpy_fused_norm, numpy_fused_optim,
           numpy_fused_pool, numpy_fused_scatter, numpy_winograd)
kernels = [f for m in modules for f in vars(m).values()
           if isinstance(f, numba.core.registry.CPUDispatcher)]
late, loaded = [], {}
for name, batch, dtype, opt in (("digits-cnn.net", 8, "f32", "sgd"),
                                ("resnet20-cifar.net", 16, "f32", "sgd"),
                                ("transformer-tiny.net", 4, "f32", "adamw"),
                                ("gpt-tiny.net", 2, "f32", "adam"),
                                ("digits-cnn.net", 8, "f64", "adam"),
                                ("mobilenet_v2.net", 1, "f32", "sgd")):
    g = add_optimizer(fuse_grads(autodiff(fuse(load(name).lower(batch), enabled=True)),
                                 enabled=True), opt)
    ex = Executor(g, be, dtype=dtype, seed=0)  # loads the kernels g's ops use
    loaded[name + ":" + dtype] = sorted(f"{k}:{d}" for k, d in be.fused.loaded)
    before = [len(k.signatures) for k in kernels]
    ex.run(example_feeds(g), roles=("loss", "updates"))
    late += [k.__name__ for k, b in zip(kernels, before) if len(k.signatures) != b]
print(json.dumps([late, loaded]))
"""


def test_every_op_names_kernel_groups_that_exist():
    """The groups an op declares (OpDef.extra["fused_kernels"]) are the ones the fused
    kernels load by; a convolution's follow its geometry and shapes (conv.kernel_groups:
    Winograd's only where conv_winograd.applies, for dx on the shapes its stride-1
    convolution has)."""
    pytest.importorskip("numba")
    from netdsl.backends.numpy_fused import KERNEL_GROUPS
    from netdsl.ir import registry
    ops = registry.load_all()
    declared = {g for op in ops.values() if not callable(op.extra.get("fused_kernels"))
                for g in op.extra.get("fused_kernels", ())}
    for name in ("resnet20-cifar.net", "mobilenet_v2.net", "transformer-tiny.net"):
        g = add_optimizer(fuse_grads(autodiff(fuse(load(name).lower(16), enabled=True)),
                                     enabled=True), "sgd")
        for n in g.nodes:
            groups = ops[n.op].fused_groups(n, g)
            assert isinstance(groups, tuple) and set(groups) <= set(KERNEL_GROUPS), n.op
            declared |= set(groups)
            if n.op.startswith("conv2d"):
                first = g[n.inputs[0]].type.shape[1]  # x's channels, or dy's
                if n.op == "conv2d_grad_input":
                    c, o = n.attrs["shape"][1], first
                elif n.op == "conv2d_grad_weight":
                    c, o = g[n.inputs[1]].type.shape[1], first
                else:
                    c, o = first, n.type.shape[1]
                wide = tuple(n.attrs["kernel"]) == (3, 3) and n.attrs["groups"] == 1 and \
                    tuple(n.attrs["stride"]) == (1, 1) and min(c, o) >= 32
                assert ("winograd" in groups) == wide, (n.name, groups)
                assert ("depthwise" in groups) == (n.attrs["groups"] > 1), n.name
    assert declared == set(KERNEL_GROUPS)  # none loads for no op


def test_no_fused_kernel_compiles_inside_a_step():
    """Every signature the training steps call (Winograd's strided tile matrices, GELU,
    layernorm, attention, both optimizers, max pooling, depthwise convolutions and
    batchnorm + relu6, f32 and f64) is loaded when the executor is made, in a fresh
    process: a compile, or a load from Numba's cache, inside a step would be in its time
    and in its tracemalloc peak (`run --mem` measured 63% over its plan). Only the groups
    its graph's ops name load, in its dtype (a first run compiles only those)."""
    pytest.importorskip("numba")
    import json
    import subprocess
    import sys
    from pathlib import Path
    out = subprocess.run([sys.executable, "-c", _NO_COMPILE_PROBE, str(Path(__file__).parent)],
                         capture_output=True, text=True, check=True).stdout
    late, loaded = json.loads(out.strip().splitlines()[-1])
    assert late == []
    # each executor loads what its graph's ops call, in its dtype: digits-cnn in float32
    # none of the depthwise, Winograd (its convolutions are too narrow), attention,
    # layernorm or float64 kernels
    assert loaded["digits-cnn.net:f32"] == [
        "batchnorm:float32", "gemm:float32", "im2col:float32", "loss:float32",
        "optimizer:float32", "pool:float32"]
    assert "winograd:float32" in loaded["resnet20-cifar.net:f32"]
    assert {"attention:float32", "layernorm:float32", "gelu:float32"} <= set(
        loaded["transformer-tiny.net:f32"])
    assert "depthwise:float32" in loaded["mobilenet_v2.net:f32"]
    assert not any(k.endswith("float64") for k in loaded["mobilenet_v2.net:f32"]
                   if k not in loaded["digits-cnn.net:f64"])


_WAIT_PROBE = """
import os
import sys
import numba
import numba.np.ufunc.parallel as parallel
from netdsl.backends import numpy_fused
from netdsl.backends.numpy import NumpyBackend
if sys.argv[1] == "elsewhere":  # NumPy linked to a BLAS the pooled GEMMs cannot call
    numpy_fused.find_numpy_cblas = lambda: None
assert not parallel._is_initialized  # libgomp not loaded yet: it reads the policy on load
f = NumpyBackend().fused
print(os.environ.get("OMP_WAIT_POLICY"), parallel._is_initialized, f.gemm is not None)
"""


@pytest.mark.parametrize("threads, blas, user, expect", [
    ("2", "numpy's", None, ["None", "True", "True"]),
    ("2", "elsewhere", None, ["PASSIVE", "True", "False"]),
    ("1", "numpy's", None, ["PASSIVE", "True", "False"]),
    ("2", "numpy's", "active", ["active", "True", "True"]),
])
def test_numba_threads_wait_passively_where_two_pools_share_the_cores(threads, blas, user,
                                                                      expect):
    """libgomp's spinning idle threads took the cores from OpenBLAS's (ResNet-164's step
    5x slower with two threads): where OpenBLAS keeps its own threads the loops' threads
    start with passive waits, set before Numba loads libgomp. Where the GEMMs run on the
    loops' threads instead (two threads and NumPy's own OpenBLAS found), OpenBLAS has one
    thread during a step and libgomp keeps its default; the user's OMP_WAIT_POLICY stands."""
    pytest.importorskip("numba")
    import os
    import subprocess
    import sys

    from netdsl.backends.numpy_fused_gemm import find_numpy_cblas
    if blas == "numpy's" and threads != "1" and find_numpy_cblas() is None:
        pytest.skip("NumPy does not link the scipy-openblas64 build here")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["OMP_NUM_THREADS"] = threads
    if user:
        env["OMP_WAIT_POLICY"] = user
    out = subprocess.run([sys.executable, "-c", _WAIT_PROBE, blas], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == expect


def test_fused_kernels_are_switched_off_by_env(monkeypatch):
    monkeypatch.setenv("NETDSL_FUSED_KERNELS", "0")
    assert NumpyBackend().fused is None
    monkeypatch.delenv("NETDSL_FUSED_KERNELS")
    numba = pytest.importorskip("numba")
    assert numba.__version__ in repr(NumpyBackend().fused)


def test_fused_kernels_give_the_reference_training_step(monkeypatch):
    """A whole f32 step of a fused ResNet-20 with the Numba kernels and with the NumPy
    reference kernels: the same loss and gradients to float32 accuracy."""
    pytest.importorskip("numba")
    g = step(load("resnet20-cifar.net").lower(4), True)
    feeds = example_feeds(g)
    runs = []
    for on in ("1", "0"):
        monkeypatch.setenv("NETDSL_FUSED_KERNELS", on)
        ex = Executor(g, "numpy", dtype="f32", seed=3)
        assert (ex.backend.fused is not None) == (on == "1")
        r = ex.run(feeds, roles=WITH_GRADS)
        runs.append([np.array(v, np.float64) for k in ("loss", "grads") for v in r[k]])
    for a, b in zip(*runs, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-5 * max(np.abs(b).max(), 1e-3))


def test_fused_kernels_follow_the_blas_threads_and_agree_across_them(monkeypatch):
    """As many threads as the BLAS is told (OMP_NUM_THREADS); batchnorm's forward and
    input gradient split their rows over the tasks (of images, or inside one where there
    are fewer images than tasks, with rows longer than a block), its statistics the
    channels, and all give the same bits on any number."""
    numba = pytest.importorskip("numba")
    from netdsl.backends.numpy_fused import FusedKernels
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert FusedKernels().threads == 1
    rng = np.random.default_rng(5)
    for shape in ((4, 6, 9), (1, 6, 2100)):
        x = (rng.standard_normal(shape) * 3 + 1).astype(np.float32)
        c = shape[1]
        w = rng.standard_normal(c).astype(np.float32)
        b = rng.standard_normal(c).astype(np.float32)
        outs = []
        for threads, tasks in sorted({(1, 1), (numba.config.NUMBA_NUM_THREADS, 2),
                                      (numba.config.NUMBA_NUM_THREADS, 5)}):
            numba.set_num_threads(threads)
            y, mom = np.empty_like(x), np.empty((2, c))
            FusedKernels.bn_forward(x, w, b, 1e-5, True, np.inf, y, mom, tasks)
            dy = np.cos(x)  # and the input gradient, with and without a sum into it
            st = np.empty((4, c))
            FusedKernels.bn_grad_stats(dy, x, w, b, 1e-5, True, np.inf, st, tasks)
            dx, dx_acc = np.empty_like(x), np.empty_like(x)
            FusedKernels.bn_grad_input(dy, x, st, w, b, True, np.inf, dx, False, dx, tasks)
            FusedKernels.bn_grad_input(dy, x, st, w, b, True, np.inf, y, True, dx_acc,
                                       tasks)
            np.testing.assert_allclose(dx_acc, dx + y, rtol=1e-5, atol=1e-6)
            outs.append((y, mom, st, dx, dx_acc))
        numba.set_num_threads(FusedKernels().threads)
        assert all(np.array_equal(a, b) for o in outs[1:] for a, b in zip(outs[0], o))
        x64 = x.astype(np.float64)
        np.testing.assert_allclose(outs[0][1][0], x64.mean(axis=(0, 2)), rtol=1e-6)
        np.testing.assert_allclose(outs[0][1][1], x64.var(axis=(0, 2)), rtol=1e-5)
        ref = (x64 - x64.mean(axis=(0, 2))[:, None]) / np.sqrt(
            x64.var(axis=(0, 2))[:, None] + 1e-5) * w[:, None] + b[:, None]
        np.testing.assert_allclose(y, np.maximum(ref, 0), rtol=1e-4, atol=1e-5)


def test_fusion_defaults_to_where_the_fused_kernels_run(monkeypatch):
    import importlib.util

    from netdsl.passes import fuse as fuse_mod
    monkeypatch.delenv("NETDSL_FUSE", raising=False)
    assert fuse_mod.fusion_enabled() == (importlib.util.find_spec("numba") is not None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert not fuse_mod.fusion_enabled()
    monkeypatch.setenv("NETDSL_FUSE", "1")
    assert fuse_mod.fusion_enabled()


# -- GEMMs on the loops' threads (numpy_fused_gemm) ---------------------------------------------
@pytest.fixture
def pooled_gemm():
    """A PooledGemm on two threads, inside its one-BLAS-thread block."""
    pytest.importorskip("numba")
    from netdsl.backends.numpy_fused_gemm import PooledGemm, find_numpy_cblas
    cblas = find_numpy_cblas()
    if cblas is None:
        pytest.skip("NumPy does not link the scipy-openblas64 build here")
    gemm = PooledGemm(cblas, 2)
    for dt in (np.float32, np.float64):
        gemm.warm_up(dt)
    with cblas.limit(1):
        yield gemm


def _gemm_operands(dtype):
    """(a, b) pairs of every layout the convolutions and linear layers hand over: 2-d and
    3-d, shared or batched, transposed views, rows further apart than their length (the flat
    shift's slices), and products small enough to be split into row or column blocks."""
    rng = np.random.default_rng(11)
    a = rng.standard_normal((16, 48, 80)).astype(dtype)
    b = rng.standard_normal((16, 80, 600)).astype(dtype)
    wide = rng.standard_normal((16, 80, 620)).astype(dtype)
    yield a, b
    yield a[0], b
    yield a, b[0]
    yield a[3], b[5]
    yield np.ascontiguousarray(a.transpose(0, 2, 1)).transpose(0, 2, 1), b
    yield a, np.ascontiguousarray(b.transpose(0, 2, 1)).transpose(0, 2, 1)
    yield a, wide[..., 7:607]
    yield a[1], wide[2][:, 3:590]
    yield np.ascontiguousarray(a[0].T).T, b[2]
    yield b[0].T, a[0].T  # [600, 80] @ [80, 48]: split into row blocks
    yield a[:2], b[:2]
    # rank 4: a transformer's heads, [N, heads, T, d] views of a [N, T, 3 * heads * d]
    # projection (the batch's two levels strided apart), and broadcast leading dimensions
    q, k = _heads(dtype)
    probs = np.ascontiguousarray(np.matmul(q, k.swapaxes(-1, -2)))
    yield q, k.swapaxes(-1, -2)
    yield probs.swapaxes(-1, -2), k
    yield q[:1], k.swapaxes(-1, -2)
    yield q, a[0, :16, :32]
    yield q[0], k.swapaxes(-1, -2)


def _heads(dtype, n=32, t=32, heads=4, d=16):
    """The q and k heads of a fused q/k/v projection: [n, heads, t, d] views."""
    qkv = np.random.default_rng(12).standard_normal((n, t, 3 * heads * d)).astype(dtype)
    q, k, _ = np.split(qkv, 3, axis=2)
    return (v.reshape(n, t, heads, d).transpose(0, 2, 1, 3) for v in (q, k))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pooled_gemm_matches_numpy_on_every_layout(pooled_gemm, dtype):
    """Each block is one call of NumPy's own OpenBLAS: the products equal np.matmul's to
    rounding, on every layout, accumulated into `out` or not."""
    gemm = pooled_gemm
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for a, b in _gemm_operands(dtype):
        ref = np.matmul(a, b)
        y = gemm(a, b)
        assert y is not None and y.shape == ref.shape and y.dtype == dtype, (a.shape, b.shape)
        np.testing.assert_allclose(y, ref, rtol=tol, atol=tol * np.abs(ref).max())
        acc = np.ones_like(ref)
        assert gemm(a, b, acc, accumulate=True) is acc
        np.testing.assert_allclose(acc, ref + 1, rtol=tol, atol=tol * np.abs(ref).max())


def test_pooled_gemm_leaves_to_numpy_what_it_cannot_take(pooled_gemm):
    gemm = pooled_gemm
    a = np.ones((8, 64, 64), np.float32)
    b = np.ones((8, 64, 256), np.float32)
    assert gemm(a, b) is not None
    gemm.cblas.held -= 1  # outside limit(1): OpenBLAS may start its own threads
    try:
        assert gemm(a, b) is None
    finally:
        gemm.cblas.held += 1
    np.testing.assert_array_equal(gemm(a[:, ::2], b), np.matmul(a[:, ::2], b))  # rows apart
    assert gemm(a[..., ::2], b[:, ::2]) is None  # no unit stride along either axis
    assert gemm(a.astype(np.float64), b) is None  # mixed dtypes
    assert gemm(a.astype(np.int64), b.astype(np.int64)) is None
    assert gemm(a[None, None], b[None, None]) is None  # rank 5
    assert gemm(a[:2], b[:3]) is None  # batches that do not broadcast
    assert gemm(a[:1, :2, :3], b[:1, :3, :2]) is None  # too small to split
    assert gemm(a, b, np.empty((8, 256, 64), np.float32).transpose(0, 2, 1)) is None
    apart = np.zeros((8, 70, 270), np.float32)[:, 3:67, 2:258]  # rows and matrices apart
    assert gemm(a, b, apart) is apart
    np.testing.assert_array_equal(apart, np.matmul(a, b))
    assert gemm(a, b, accumulate=True) is None  # nothing to add into


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_attention_products_on_the_threads_equal_numpys_bits(pooled_gemm, dtype):
    """The attention's rank-4 products, taken as the views they are: each head's product
    is one call of the same OpenBLAS that NumPy's matmul makes, so the same bits on two
    threads as NumPy's on one (a transformer's step does not depend on the threads)."""
    q, k = _heads(dtype)
    probs = np.ascontiguousarray(np.matmul(q, k.swapaxes(-1, -2)))
    for a, b in ((q, k.swapaxes(-1, -2)), (probs, k), (probs.swapaxes(-1, -2), k)):
        y = pooled_gemm(a, b)
        assert y is not None
        np.testing.assert_array_equal(y, np.matmul(a, b))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pooled_gemm_adds_a_bias_to_each_row(pooled_gemm, dtype):
    """A linear layer's bias, added by each thread to its block after its GEMM: the same
    sums as the product then the add (bit for bit), for row blocks, column blocks, a
    transposed weight and a given `out`; not taken for 3-d products or an `out` that is
    not C-contiguous."""
    rng = np.random.default_rng(5)
    for m, k, n in ((1024, 64, 192), (40, 80, 2000)):  # row blocks; column blocks
        x = rng.standard_normal((m, k)).astype(dtype)
        w = rng.standard_normal((n, k)).astype(dtype)
        bias = rng.standard_normal(n).astype(dtype)
        want = pooled_gemm(x, w.T)
        want += bias
        np.testing.assert_array_equal(pooled_gemm(x, w.T, bias=bias), want)
        out = np.empty((m, n), dtype)
        assert pooled_gemm(x, w.T, out, bias=bias) is out
        np.testing.assert_array_equal(out, want)
    x3 = rng.standard_normal((4, 64, 64)).astype(dtype)
    assert pooled_gemm(x3, x3, bias=np.ones(64, dtype)) is None
    apart = np.empty((m, n + 3), dtype)[:, :n]
    assert pooled_gemm(x, w.T, apart, bias=bias) is None


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [1, 2])
def test_pooled_gemm_adds_a_residual_to_each_block(pooled_gemm, dtype, threads):
    """conv2d_add's and linear_add's residual, added by each task to its block after its
    GEMM (and bias): the same bits as the product, the bias, then the add, for a 1x1
    convolution's batch of products, a linear layer's row blocks and a given `out`, on one
    thread or two; not taken with `accumulate` or a residual not C-contiguous or of
    another shape."""
    from netdsl.backends.numpy_fused_gemm import PooledGemm
    gemm = pooled_gemm if threads == 2 else PooledGemm(pooled_gemm.cblas, 1)
    rng = np.random.default_rng(6)
    w = rng.standard_normal((64, 16)).astype(dtype)
    x = rng.standard_normal((8, 16, 1024)).astype(dtype)  # [64, 16] @ [8, 16, 1024]
    r = rng.standard_normal((8, 64, 1024)).astype(dtype)
    want = np.matmul(w, x)
    want += r
    np.testing.assert_array_equal(gemm(w, x, residual=r), want)
    out = np.empty_like(r)
    assert gemm(w, x, out, residual=r) is out
    np.testing.assert_array_equal(out, want)
    a = rng.standard_normal((1024, 64)).astype(dtype)  # a linear layer's, with its bias
    b = rng.standard_normal((64, 192)).astype(dtype)
    bias = rng.standard_normal(192).astype(dtype)
    r2 = rng.standard_normal((1024, 192)).astype(dtype)
    want = gemm(a, b)  # (two threads cut it into row blocks: not NumPy's bits)
    want += bias
    want += r2
    np.testing.assert_array_equal(gemm(a, b, bias=bias, residual=r2), want)
    assert gemm(w, x, np.ones_like(r), accumulate=True, residual=r) is None
    assert gemm(w, x, residual=np.asfortranarray(r)) is None
    assert gemm(w, x, residual=r[:4]) is None


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("batch", [1, 5])  # fewer images than threads: column blocks
def test_shifted_gemm_sums_every_offsets_product(pooled_gemm, dtype, batch):
    """A flat shift's offsets in one call: the sum over offsets of each shifted product,
    as the per-offset GEMMs make it (a whole step through it: the test below)."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((9, 40, 24)).astype(dtype)
    b = rng.standard_normal((batch, 24, 1200)).astype(dtype)
    offsets = np.array([0, 1, 2, 34, 35, 36, 68, 69, 70])
    y = pooled_gemm.shifted(a, b, offsets, 1100)
    ref = sum(np.matmul(a[o], b[:, :, s:s + 1100]) for o, s in enumerate(offsets))
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert y is not None and y.shape == (batch, 40, 1100) and y.dtype == dtype
    np.testing.assert_allclose(y, ref, rtol=tol, atol=tol * np.abs(ref).max())
    assert pooled_gemm.shifted(a, b[..., :100], offsets, 1100) is None  # out of bounds
    assert pooled_gemm.shifted(a[:, :2, :2], b[:, :2], offsets, 10) is None  # too small
    assert pooled_gemm.shifted(a, b.astype(np.float16), offsets, 1100) is None


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kernel,padding,dilation", [
    ((3, 3), (1, 1), (1, 1)), ((5, 3), (2, 0), (1, 2)), ((1, 3), (0, 1), (1, 1))])
@pytest.mark.parametrize("cin,cout", [(24, 40), (12, 16)])  # (12, 16): dW a kernel row a GEMM
def test_convolutions_an_image_a_task_match_the_reference(pooled_gemm, dtype, kernel,
                                                           padding, dilation, cin, cout):
    """A stride-1 convolution and its weight gradient with each image one task (padded,
    multiplied and cropped in the thread's buffers): NumPy's reference kernels' results,
    for several kernels, paddings and dilations and an odd batch; into a given `out`
    too; the forward not taken for fewer images than threads or an `out` of another
    shape; the weight gradient the same to the bit on one thread."""
    from netdsl.ir.ops.conv import conv2d_forward
    rng = np.random.default_rng(4)
    (kh, kw), (ph, pw), (dh, dw) = kernel, padding, dilation
    x = rng.standard_normal((5, cin, 30, 28)).astype(dtype)
    w = rng.standard_normal((cout, cin, kh, kw)).astype(dtype)
    wt = np.ascontiguousarray(w.reshape(cout, cin, kh * kw).transpose(2, 0, 1))
    ref = conv2d_forward(np, x, w, {"kernel": kernel, "stride": 1, "padding": padding,
                                    "dilation": dilation, "groups": 1})
    y = pooled_gemm.conv(x, wt, kh, kw, ph, pw, dh, dw)
    assert y is not None and y.shape == ref.shape and y.dtype == dtype
    np.testing.assert_array_equal(y, ref)  # the same GEMMs, summed in the same order
    tol = 1e-5 if dtype == np.float32 else 1e-12
    out = np.empty_like(ref)
    assert pooled_gemm.conv(x, wt, kh, kw, ph, pw, dh, dw, out) is out
    np.testing.assert_array_equal(out, y)
    assert pooled_gemm.conv(x[:1], wt, kh, kw, ph, pw, dh, dw) is None  # 1 image, 2 threads
    assert pooled_gemm.conv(x, wt, kh, kw, ph, pw, dh, dw, out[:, :2]) is None
    # the weight gradient the same way: NumPy's reference kernel's
    from netdsl.ir.ops.conv import conv2d_grad_weight
    dy = rng.standard_normal(ref.shape).astype(dtype)
    gw_ref = conv2d_grad_weight(np, dy, x, w.shape, {
        "kernel": kernel, "stride": 1, "padding": padding, "dilation": dilation,
        "groups": 1})
    budget = 1 << 30  # elements of scratch: every task fits
    gw = pooled_gemm.conv_grad_weight(dy, x, kh, kw, ph, pw, dh, dw, budget)
    assert gw is not None and gw.shape == w.shape and gw.dtype == dtype
    np.testing.assert_allclose(gw, gw_ref, rtol=tol, atol=tol * np.abs(gw_ref).max())
    # the images' products summed in their order: the same bits on one thread
    from netdsl.backends.numpy_fused_gemm import PooledGemm
    one = PooledGemm(pooled_gemm.cblas, 1).conv_grad_weight(dy, x, kh, kw, ph, pw, dh, dw,
                                                            budget)
    np.testing.assert_array_equal(one, gw)
    # a budget that holds the products and no task's buffers: not taken
    assert pooled_gemm.conv_grad_weight(dy, x, kh, kw, ph, pw, dh, dw, gw.size * 5) is None


@pytest.mark.parametrize("x_shape,out,kernel,stride,padding", [
    ((3, 3, 64, 64), 16, 7, 2, 3),  # strided: columns an image at a time, 1,024 pixels
    ((3, 16, 20, 20), 24, 3, 1, 1),  # stride 1: the image tasks
    ((3, 64, 32, 32), 16, 1, 1, 0),  # 1x1: products cut into blocks (small_blocks)
])
def test_convolutions_give_the_same_bits_on_one_thread_as_on_two(pooled_gemm, x_shape, out,
                                                                  kernel, stride, padding):
    """conv2d's three kernels with the fused kernels on one thread (NumPy's matmul, the
    image tasks on one thread) and on two (the pooled GEMMs): the same bits, so that a
    step's numbers do not depend on the thread count (tests/test_mpi.py checks a whole
    run)."""
    from netdsl.backends.numpy_fused_gemm import PooledGemm
    from netdsl.ir import registry
    from netdsl.runtime.executor import KernelContext
    rng = np.random.default_rng(6)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal((out, x_shape[1], kernel, kernel)).astype(np.float32)
    a = {"kernel": kernel, "stride": stride, "padding": padding, "dilation": 1, "groups": 1}
    be = NumpyBackend()
    ctx = KernelContext(True, be, "float32")
    results = []
    for gemm, convs in ((None, PooledGemm(pooled_gemm.cblas, 1)), (pooled_gemm, pooled_gemm)):
        be.fused.gemm, be.fused.convs = gemm, convs
        y = registry.OPS["conv2d"].kernel(np, [x, w], a, ctx)
        dy = np.random.default_rng(7).standard_normal(y.shape).astype(np.float32)
        results.append([y, registry.OPS["conv2d_grad_input"].kernel(
            np, [dy, w], {**a, "shape": x.shape}, ctx), registry.OPS["conv2d_grad_weight"]
            .kernel(np, [dy, x], {**a, "shape": w.shape}, ctx)])
    for name, one, two in zip(("y", "dx", "dw"), *results, strict=True):
        np.testing.assert_array_equal(one, two, err_msg=name)


@pytest.mark.parametrize("small_kernels", [True, False])
def test_products_are_cut_into_blocks_by_their_shapes(pooled_gemm, monkeypatch,
                                                       small_kernels):
    """Where OpenBLAS has its small-matrix kernels (its AVX-512 cores), products of 1M to
    4M multiply-adds go in blocks under their limit (1e6), along their larger side;
    elsewhere products stay whole but a single one of 2M-4M, which goes in halves. The
    blocks depend on the shapes alone, so one thread and two give the same bits; on one
    thread only the products cut into blocks leave NumPy's matmul."""
    from netdsl.backends.numpy_fused import FusedKernels
    from netdsl.backends.numpy_fused_gemm import PooledGemm, product_blocks, small_blocks
    assert small_blocks(16, 1024, 64) == (1, 2)  # 2^20: ResNet-164's 1x1 products
    assert small_blocks(64, 16, 1024) == (2, 1)  # rows, the larger side
    assert small_blocks(16, 512, 64) == (1, 1)  # under the limit already
    assert small_blocks(64, 64, 1024) == (1, 5)  # 4.2M: five blocks of 205 columns
    assert small_blocks(256, 128, 256) == (1, 1)  # 8.4M: packing pays there
    assert product_blocks(64, 64, 1024, 1, True) == (1, 5)
    assert product_blocks(64, 64, 1024, 1, False) == (1, 2)  # one product: halves
    assert product_blocks(1024, 64, 64, 1, False) == (2, 1)
    assert product_blocks(64, 64, 1024, 4, False) == (1, 1)  # a batch: whole products
    assert product_blocks(16, 1024, 64, 1, False) == (1, 1)  # 1M: NumPy's own call
    assert product_blocks(256, 128, 256, 1, False) == (1, 1)  # 8.4M: cut for threads
    cblas = pooled_gemm.cblas
    assert isinstance(cblas.corename, str) and cblas.small_kernels == (
        cblas.corename.lower() in ("skylakex", "cooperlake", "sapphirerapids"))
    monkeypatch.setattr(cblas, "small_kernels", small_kernels)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    fk = FusedKernels()
    assert fk.gemm is None and fk.convs is not None
    monkeypatch.setattr(fk.cblas, "small_kernels", small_kernels)
    rng = np.random.default_rng(8)
    for a, b, cut in (  # ResNet-164's 1x1 products, a batch of them
            (rng.standard_normal((16, 64)), rng.standard_normal((4, 64, 1024)), small_kernels),
            # one transformer product [1024, 64] @ [64, 64]: halves without small kernels
            (rng.standard_normal((1024, 64)), rng.standard_normal((64, 64)), True)):
        a, b = a.astype(np.float32), b.astype(np.float32)
        one = PooledGemm(cblas, 1)(a, b)
        np.testing.assert_array_equal(one, pooled_gemm(a, b))
        np.testing.assert_allclose(one, np.matmul(a, b), rtol=1e-5, atol=1e-4)
        with fk.running():
            if cut:
                np.testing.assert_array_equal(fk.matmul(a, b), one)
            else:  # whole products on one thread are NumPy's own call
                assert fk.matmul(a, b) is None
            assert fk.matmul(a[..., :8], b[..., :8, :]) is None  # under 2M: NumPy's own call


def test_one_blas_thread_inside_a_run_and_restored_after(pooled_gemm):
    cblas = pooled_gemm.cblas
    before = cblas._get()
    cblas._set(2)
    try:
        with cblas.limit(1):
            assert cblas._get() == 1
            with cblas.limit(1):
                assert cblas._get() == 1
            assert cblas._get() == 1
        assert cblas._get() == 2
        with pytest.raises(RuntimeError), cblas.limit(1):
            raise RuntimeError
        assert cblas._get() == 2
        held = cblas.held
        with cblas.limit(3):  # at most 3: two stays two, and two is not one
            assert cblas._get() == 2 and cblas.held == held
        cblas._set(4)
        with cblas.limit(2):
            assert cblas._get() == 2 and cblas.held == held
        assert cblas._get() == 4
    finally:
        cblas._set(before)


def test_steps_with_pooled_gemms_match_numpys_gemms(pooled_gemm):
    """A whole fused ResNet-20 step (every convolution path: pointwise, flat shift,
    Winograd, strided im2col) and a transformer step, with the GEMMs on the loops' threads
    and with NumPy's matmul: the same losses, gradients and updated state. The pooled
    GEMMs run because the executor holds NumPy's BLAS to one thread for the run."""
    class Counting(type(pooled_gemm)):
        taken = offsets = 0

        def __call__(self, *args, **kw):
            y = super().__call__(*args, **kw)
            Counting.taken += y is not None
            return y

        def shifted(self, *args, **kw):  # the flat shift's offsets in one call
            y = super().shifted(*args, **kw)
            Counting.offsets += y is not None
            return y

        def conv(self, *args, **kw):  # the flat shift, an image a task
            y = super().conv(*args, **kw)
            Counting.offsets += y is not None
            return y

    for name, batch in (("resnet20-cifar.net", 16), ("transformer-tiny.net", 4)):
        g = add_optimizer(fuse_grads(autodiff(fuse(load(name).lower(batch), enabled=True)),
                                     enabled=True), "sgd")
        feeds = example_feeds(g)
        runs = []
        for pooled in (True, False):
            be = NumpyBackend()
            # the backend's own OpenBLAS handle, whose block only the executor's run opens
            be.fused.gemm = be.fused.convs = Counting(be.fused.cblas, 2) if pooled else None
            assert be.fused.cblas.held == 0
            ex = Executor(g, be, dtype="f32", seed=3)
            taken, offsets = Counting.taken, Counting.offsets
            r = ex.run(feeds, roles=("loss", "grads", "updates"))
            assert (Counting.taken > taken) == pooled, name
            assert (Counting.offsets > offsets) == (pooled and name.startswith("resnet"))
            runs.append([np.array(v, np.float64) for k in ("loss", "grads", "updates")
                         for v in r[k]])
        for a, b in zip(*runs, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * max(np.abs(b).max(), 1))


def test_threads_are_shared_out_among_the_mpi_ranks_of_a_machine(monkeypatch):
    """Two MPI ranks on one machine take half the cores each (two ranks of all the
    cores' threads spun against each other: ResNet-164's distributed step 2.6x slower);
    the user's OMP_NUM_THREADS stands."""
    numba = pytest.importorskip("numba")
    from netdsl.backends.numpy_fused import thread_count
    for key in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MPI_LOCALNRANKS",
                "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.delenv(key, raising=False)
    pool = numba.config.NUMBA_NUM_THREADS
    assert thread_count() == pool
    monkeypatch.setenv("MPI_LOCALNRANKS", "2")
    assert thread_count() == max(1, pool // 2)
    monkeypatch.delenv("MPI_LOCALNRANKS")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", str(4 * pool))
    assert thread_count() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", str(pool))  # the user's count stands
    assert thread_count() == pool
