"""Mixed precision (netdsl.passes.precision, netdsl.runtime.loss_scale): the rewrite and
its types, the byte accounting of 2-byte values, the options, the f16 loss scale against
torch.amp.GradScaler's rule, a skipped step, exact resume, and the clear errors.
(One step against torch.autocast: test_precision_torch.py.)"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from _examples import example_feeds, load

import netdsl
from netdsl.config import TrainConfig
from netdsl.errors import NetdslError
from netdsl.ir import registry
from netdsl.memory.plan import make_plan, value_bytes
from netdsl.options import RunOptions, StepOptions, conflicts
from netdsl.passes.pipeline import run_pipeline
from netdsl.runtime import checkpoint
from netdsl.runtime.executor import Executor
from netdsl.runtime.loss_scale import LossScale
from netdsl.runtime.trainer import Trainer
from netdsl.step.graphs import training_graph

SMALL = """
network small {
    input x: f32[N, 3, 6, 6]
    input y: i64[N]
    h = relu(batchnorm(conv2d(x, 4, kernel=3, padding=1, bias=false)))
    logits = linear(flatten(global_avgpool(h)), 5)
    output logits
    loss softmax_cross_entropy(logits, y)
}
train {
    data = synthetic(samples=40, test_samples=8)
    optimizer = adam(lr=0.01)
    batch = 8
    seed = 3
    precision = f16
}
"""


@pytest.fixture
def small(tmp_path):
    p = tmp_path / "small.net"
    p.write_text(SMALL)
    return netdsl.load(p)


def step_of(example: str, batch: int, precision: str):
    net = load(example)
    cfg = (net.train or TrainConfig()).model_copy(update={"precision": precision})
    return training_graph(net.lower(batch), cfg)


# -- the rewrite --------------------------------------------------------------------------
def test_each_op_runs_in_the_type_its_rule_declares():
    g = run_pipeline(load("digits-cnn.net").lower(4), [("precision", {"dtype": "bf16"})])
    ops = registry.OPS
    for n in g.nodes:
        if n.is_source or n.op == "cast":
            continue
        rule = ops[n.op].precision
        if rule == "reduced":
            assert n.type.dtype == "bf16", n.name
            assert all(g[i].type.dtype == "bf16" for i in n.inputs), n.name
        elif rule == "f32":
            assert n.type.dtype == "f32" and g[n.inputs[0]].type.dtype == "f32", n.name
    # the master weights stay f32 state; each is cast once, read by its layer
    assert all(p.type.dtype == "f32" for p in g.params())
    casts = [n for n in g.nodes if n.op == "cast"]
    assert len({n.inputs[0] for n in casts}) == len(casts)
    assert g["conv2d"].inputs[1] == "conv2d.weight.bf16"
    # batchnorm follows its input and reads its f32 parameters and statistics as they are
    assert g["batchnorm"].type.dtype == "bf16"
    assert [g[i].type.dtype for i in g["batchnorm"].inputs[1:]] == ["f32"] * 4
    assert g.meta["precision"] == {"dtype": "bf16", "device": "cpu"}
    assert run_pipeline(load("digits-cnn.net").lower(4), [("precision", {"dtype": "f32"})]) \
        .to_text() == load("digits-cnn.net").lower(4).to_text()


def test_every_op_declares_a_known_rule_and_the_language_cannot_name_bf16():
    from netdsl.ir.opdef import PRECISIONS
    from netdsl.ir.types import DTYPES
    assert all(op.precision in PRECISIONS for op in registry.OPS.values())
    assert {op for op, d in registry.OPS.items() if d.precision == "reduced"} >= {
        "conv2d", "linear", "matmul", "conv2d_grad_input", "linear_grad_weight"}
    assert {op for op, d in registry.OPS.items() if d.precision == "f32"} >= {
        "softmax_cross_entropy", "mse", "sum", "exp"}
    assert "bf16" not in DTYPES  # (the language's element types)


@pytest.mark.parametrize("precision", ["bf16", "f16"])
def test_gradients_are_held_in_their_values_types(precision):
    g = step_of("resnet20-cifar.net", 2, precision)
    for x in g.outputs["grads"]:
        assert g[x].type.dtype == "f32", x  # every parameter's gradient: f32
    backward = [n for n in g.nodes if n.meta.get("phase") == "backward"]
    stats = [n for n in backward if n.op == "batchnorm_grad_stats"]
    assert stats and all(n.type.dtype == "f32" for n in stats)  # sums over the batch
    convs = [n for n in backward if n.op == "conv2d_grad_input"]
    assert convs and all(n.type.dtype == precision for n in convs)
    updates = [g[u] for u in g.outputs["updates"]]
    gated = [u for u in updates if "gate" in u.meta]
    assert (len(gated) == len(updates)) if precision == "f16" else not gated


def test_a_precision_step_runs_a_split_as_one_device_does():
    """The precision pass comes first in a split too: gradient accumulation over two
    micro-batches of a bf16 step equals the bf16 step's update (batchnorm aside: an MLP)."""
    net = netdsl.loads("""network m {
    input x: f32[N, 6]
    input y: i64[N]
    logits = linear(relu(linear(x, 8)), 3)
    output logits
    loss softmax_cross_entropy(logits, y)
}
""")
    from netdsl.step.graphs import accumulating_step
    cfg = TrainConfig(precision="bf16")
    one = training_graph(net.lower(4), cfg)
    two = accumulating_step(net.graph, 4, cfg, 2)
    assert any(n.type.dtype == "bf16" for n in two.nodes)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((4, 6)).astype(np.float32), "y": np.arange(4) % 3}
    e1, e2 = Executor(one), Executor(two)
    e1.run(feeds, roles=("loss", "updates"))
    e2.run(feeds, roles=("loss", "updates"))
    for k, v in e1.state_dict().items():
        np.testing.assert_allclose(e2.state_dict()[k], v, rtol=0, atol=1e-2, err_msg=k)


# -- bytes --------------------------------------------------------------------------------
def test_two_byte_values_count_two_bytes_whatever_the_float_dtype():
    from netdsl.ir.types import TensorType
    t = TensorType((3, 5), "bf16")
    assert value_bytes(t, "f32") == value_bytes(t, "f64") == 30
    assert value_bytes(TensorType((3, 5), "f16"), "f64") == 30
    assert value_bytes(TensorType((3, 5), "f32"), "f64") == 120


def test_a_bf16_step_holds_about_half_the_activation_bytes():
    """The storage plan's values at its peak (activations and gradients) in bf16 are at
    most 0.55 of f32's at batch 16 (more than half only by the 2-byte copies of the
    weights the step computes from: 0.58 at batch 4, 0.51 at 32); every 2-byte value's
    array is 2 bytes an element (the executor checks each against the plan)."""
    f32 = make_plan(step_of("resnet20-cifar.net", 16, "f32"), ("loss", "output", "updates"))
    g = step_of("resnet20-cifar.net", 16, "bf16")
    bf16 = make_plan(g, ("loss", "output", "updates"))
    assert bf16.lower_bound_bytes <= 0.55 * f32.lower_bound_bytes
    assert bf16.state_bytes == f32.state_bytes  # master weights and optimizer state: f32
    ex = Executor(g)
    out = ex.run(example_feeds(g), roles=("loss", "output", "updates"))
    assert str(out["output"][0].dtype) == "bfloat16"
    assert ex.peak_bytes == bf16.peak_bytes


def test_conversions_around_kernels_are_counted_as_their_workspace():
    from netdsl.ir.precision import conversion_bytes, converted
    from netdsl.memory.plan import workspace_bytes
    g = step_of("digits-cnn.net", 4, "bf16")
    conv = g["conv2d_1"]
    assert converted(g, conv, "cpu") == ((0, 1), True)
    assert converted(g, conv, "gpu") == ((), False)  # cuBLAS and cuDNN take 2-byte data
    assert converted(g, g["flatten"], "cpu") == ((), False)  # data moves as it is
    extra = conversion_bytes(g, conv, "cpu")
    ins = sum(g[i].type.numel() for i in conv.inputs[:2])
    assert extra == 4 * (ins + conv.type.numel())
    assert workspace_bytes(g, conv, "f32", "cpu") == workspace_bytes(g, conv, "f32") + extra


# -- options ------------------------------------------------------------------------------
def test_options_are_checked_together():
    with pytest.raises(NetdslError, match="--precision must be f32, bf16 or f16, not 'fp8'"):
        conflicts(StepOptions(precision="fp8"))
    with pytest.raises(NetdslError, match="--precision bf16 computes in bf16 from f32 master "
                                          "weights, and --dtype f64 asks for f64 ones"):
        conflicts(StepOptions(precision="bf16", dtype="f64"))
    conflicts(StepOptions(precision="f32", dtype="f64"))


def test_the_train_sections_precision_is_the_default_and_the_option_wins(small):
    assert small.train.precision == "f16"
    step = netdsl.api.build(small, StepOptions())
    assert step.request.precision == "f16" and "loss_scale" in step.graph
    step = netdsl.api.build(small, StepOptions(precision="bf16"))
    assert step.request.precision == "bf16" and "loss_scale" not in step.graph
    with pytest.raises(NetdslError, match="the train section's precision f16 computes"):
        netdsl.api.build(small, StepOptions(dtype="f64"))


def test_a_precision_the_train_section_does_not_know_is_located():
    with pytest.raises(NetdslError) as e:
        netdsl.loads("network n {\n    input x: f32[N, 2]\n    output x\n}\n"
                     "train {\n    precision = fp8\n}\n", file="p.net")
    d = e.value.diagnostics[0]
    assert '`precision` must be "f32", "bf16" or "f16", not "fp8"' in d.message
    assert (d.loc.line, d.loc.column) == (6, 5)


def test_an_op_f16_cannot_hold_is_refused_naming_its_line():
    net = netdsl.loads("""network n {
    input x: f32[N, 4, 4]
    input y: f32[N, 4, 4]
    h = causal_mask(matmul(x, x))
    output h
    loss mse(softmax(h), y)
}
""", file="mask.net")
    with pytest.raises(NetdslError) as e:
        netdsl.api.build(net, StepOptions(precision="f16", batch=2))
    assert "causal_mask %causal_mask cannot run in f16: its value=-1e+09 is beyond f16's " \
           "range" in e.value.message
    assert e.value.loc.line == 4
    netdsl.api.build(net, StepOptions(precision="bf16", batch=2))  # (f32's range)


def test_a_tensor_split_with_a_precision_is_refused_by_name():
    with pytest.raises(NetdslError, match="--precision bf16 does not combine with a tensor "
                                          "split yet"):
        netdsl.api.build(load("transformer-tiny.net"),
                         StepOptions(precision="bf16", devices=2, split="tensor", batch=4))


def test_bf16_on_a_backend_without_it_is_refused(monkeypatch):
    import netdsl.ir.types as types
    from netdsl.backends.numpy import NumpyBackend
    real = __import__
    monkeypatch.setitem(__import__("sys").modules, "ml_dtypes", None)
    with pytest.raises(NetdslError, match="bf16 values need the ml_dtypes package"):
        NumpyBackend().check_precision("bf16")
    assert types.numpy_dtype("f16") == "float16" and real is __import__


# -- the loss scale -----------------------------------------------------------------------
def torch_scales(pattern: list[bool], interval: int) -> list[float]:
    """torch.amp.GradScaler's scale after each step of `pattern` (True: an inf gradient)."""
    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_factor=2.0,
                                  backoff_factor=0.5, growth_interval=interval)
    out = []
    for bad in pattern:
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        if bad:
            p.grad[1] = float("inf")
        scaler.step(opt)
        scaler.update()
        out.append(scaler.get_scale())
    return out


@pytest.mark.torch
@pytest.mark.parametrize("interval,steps", [(3, 200), (2000, 2010)])
def test_the_scale_follows_grad_scalers_rule(interval, steps):
    rng = np.random.default_rng(interval)
    pattern = list(rng.random(steps) < (0.15 if interval == 3 else 0.0))
    if interval == 2000:
        pattern[2005] = True  # a growth at 2000 clean steps, then a back-off
    s = LossScale(growth_interval=interval)
    ours = []
    for bad in pattern:
        s.update(bool(bad))
        ours.append(s.scale)
    assert ours == torch_scales(pattern, interval)
    assert s.skipped == sum(pattern)


def test_the_scale_stays_finite_where_growing_would_overflow():
    s = LossScale(scale=2.0 ** 127, growth_interval=1)
    s.update(False)
    assert s.scale == 2.0 ** 127 and s.growth_tracker == 0


def inject_inf_at(monkeypatch, step: int, op: str = "conv2d_grad_weight"):
    """Make the first `op` node's result inf on training run `step` (0-based)."""
    call = Executor._call

    def call_with_inf(self, n, inputs, ctx):
        out = call(self, n, inputs, ctx)
        if ctx.training and ctx.step == step and n.op == op:
            out = out.copy()
            out.reshape(-1)[0] = np.inf
        return out
    monkeypatch.setattr(Executor, "_call", call_with_inf)


def test_an_inf_gradient_skips_exactly_that_step_and_halves_the_scale(small, monkeypatch,
                                                                       tmp_path):
    inject_inf_at(monkeypatch, 2)
    t = Trainer(small.graph, small.train, RunOptions(steps=5, log=str(tmp_path / "l.jsonl")))
    states = []
    orig = t._train_step

    def step_and_keep(run, log):
        orig(run, log)
        states.append(t.executor.state_dict())
    t._train_step = step_and_keep
    r = t.fit()
    recs = [json.loads(x) for x in (tmp_path / "l.jsonl").read_text().splitlines()]
    assert [x["skipped"] for x in recs] == [False, False, True, False, False]
    assert [x["loss_scale"] for x in recs] == [2.0 ** 16] * 3 + [2.0 ** 15] * 2
    assert r.loss_scale == {"scale": 2.0 ** 15, "skipped_steps": 1}
    # the skipped step changed no parameter and no optimizer state (Adam's step count
    # included); the others changed the parameters. (Its forward pass ran: batchnorm's
    # running statistics moved, as they do under GradScaler.)
    for k in states[1]:
        if "running_" not in k:
            np.testing.assert_array_equal(states[2][k], states[1][k], err_msg=k)
    assert not np.array_equal(states[3]["linear.weight"], states[2]["linear.weight"])
    assert not np.array_equal(states[1]["linear.weight"], states[0]["linear.weight"])


def test_resume_is_exact_with_the_scale_in_the_checkpoint(small, monkeypatch, tmp_path):
    inject_inf_at(monkeypatch, 1)
    full = Trainer(small.graph, small.train, RunOptions(steps=6)).fit()
    ck = tmp_path / "ck"
    Trainer(small.graph, small.train, RunOptions(steps=3, checkpoint=str(ck))).fit()
    _, header = checkpoint.load(ck)
    assert header["loss_scale"] == {"scale": 2.0 ** 15, "growth_tracker": 1, "skipped": 1}
    monkeypatch.undo()  # (the resumed run must not skip again: the inf was at step 2)
    rest = Trainer(small.graph, small.train, RunOptions(steps=6, checkpoint=str(ck),
                                                         resume=True)).fit()
    assert rest.loss_scale == full.loss_scale == {"scale": 2.0 ** 15, "skipped_steps": 1}
    assert rest.losses == full.losses[3:]


def test_f16_gradients_that_overflow_are_skipped_until_the_scale_fits(small):
    """A scale far too large: the first steps overflow the f16 backward and are skipped,
    each halving the scale, until the gradients fit; the run then trains."""
    t = Trainer(small.graph, small.train, RunOptions(steps=16))
    t.scale.scale.scale = 2.0 ** 32
    r = t.fit()
    skipped = r.loss_scale["skipped_steps"]
    assert 0 < skipped < 16 and r.loss_scale["scale"] == 2.0 ** (32 - skipped)
    assert math.isfinite(r.final_loss)


def test_bf16_runs_unscaled(small):
    r = Trainer(small.graph, small.train, RunOptions(steps=2, precision="bf16")).fit()
    assert r.loss_scale is None and r.precision == "bf16"


# -- the fused loops that read bf16 ---------------------------------------------------------
def test_the_fused_loops_read_bf16_as_the_f32_loops_compute_it():
    """The batchnorm and relu loops on bf16 bits compute in f32 exactly as the f32 loops
    do on the same values: their bf16 results are the f32 results rounded once (ties to
    even, as ml_dtypes rounds), their f32 statistics equal."""
    pytest.importorskip("numba")
    from netdsl.backends.numpy_fused import FusedKernels
    from netdsl.ir.types import numpy_dtype
    bf16 = np.dtype(numpy_dtype("bf16"))
    f = FusedKernels()
    rng = np.random.default_rng(0)

    def pair(shape, scale=1.0):
        h = (scale * rng.standard_normal(shape)).astype(np.float32).astype(bf16)
        return h, h.astype(np.float32)
    (x, x32), (dy, dy32), (acc, acc32) = pair((4, 3, 50), 3.0), pair((4, 3, 50)), \
        pair((4, 3, 50))
    w = rng.standard_normal(3).astype(np.float32)
    b = rng.standard_normal(3).astype(np.float32)
    for relu in (False, True):
        y, y32 = np.empty_like(x), np.empty_like(x32)
        m, m32 = np.empty((2, 3)), np.empty((2, 3))
        f.bn_forward(x, w, b, 1e-5, relu, np.inf, y, m, 2)
        f.bn_forward(x32, w, b, 1e-5, relu, np.inf, y32, m32, 2)
        np.testing.assert_array_equal(m, m32)
        np.testing.assert_array_equal(y, y32.astype(bf16))
        st, st32 = np.empty((4, 3), np.float32), np.empty((4, 3), np.float32)
        f.bn_grad_stats(dy, x, w, b, 1e-5, relu, np.inf, st, 2)
        f.bn_grad_stats(dy32, x32, w, b, 1e-5, relu, np.inf, st32, 2)
        np.testing.assert_array_equal(st, st32)
        dx, dx32 = np.empty_like(x), np.empty_like(x32)
        f.bn_grad_input(dy, x, st, w, b, relu, np.inf, acc, True, dx, 2)
        f.bn_grad_input(dy32, x32, st, w, b, relu, np.inf, acc32, True, dx32, 2)
        np.testing.assert_array_equal(dx, dx32.astype(bf16))
    flat, flat32 = x.reshape(-1), x32.reshape(-1)
    g, g32 = dy.reshape(-1), dy32.reshape(-1)
    out, out32 = np.empty_like(flat), np.empty_like(flat32)
    f.relu_grad(g, flat, g, True, out)
    f.relu_grad(g32, flat32, g32, True, out32)
    np.testing.assert_array_equal(out, out32.astype(bf16))
    f.add(flat, g, True, out)
    f.add(flat32, g32, True, out32)
    np.testing.assert_array_equal(out, out32.astype(bf16))
    nan = np.array([np.nan, -np.inf, 3e38], np.float32).astype(bf16)
    out = np.empty_like(nan)
    f.add(nan, nan, False, out)
    assert np.isnan(out[0]) and np.isneginf(out[1]) and np.isposinf(out[2])  # (overflow)


def test_which_kernels_read_two_byte_values_themselves():
    from netdsl.ir.precision import converted
    g = step_of("resnet20-cifar.net", 2, "bf16")
    bn = next(n for n in g.nodes if n.op in ("batchnorm_relu", "batchnorm"))
    conv = next(n for n in g.nodes if n.op == "conv2d")
    assert converted(g, bn, "numba") == ((), False)  # the fused loops read bf16 bits
    assert converted(g, bn, "cpu")[1]  # NumPy's reference kernels compute in f32
    assert converted(g, conv, "numba")[1]  # the BLAS computes in f32
    g16 = step_of("resnet20-cifar.net", 2, "f16")
    bn16 = next(n for n in g16.nodes if n.op == bn.op)
    assert converted(g16, bn16, "numba")[1]  # Numba has no float16
    flat = next(n for n in g16.nodes if n.op == "flatten")
    assert converted(g16, flat, "numba") == ((), False)  # moving values: any type


# -- accuracy -------------------------------------------------------------------------------
@pytest.mark.slow
def test_digits_cnn_reaches_97_percent_in_bf16_and_f16_in_f32s_steps():
    """The example's 10 epochs (440 steps) in f32, bf16 and f16: each reaches 97% test
    accuracy, the mixed-precision runs within a point of f32's."""
    pytest.importorskip("sklearn")
    net = load("digits-cnn.net")
    res = {p: Trainer(net.graph, net.train, RunOptions(precision=p)).fit()
           for p in ("f32", "bf16", "f16")}
    assert {r.steps for r in res.values()} == {440}
    for p, r in res.items():
        assert r.test_accuracy >= 0.97, (p, r.test_accuracy)
        assert abs(r.test_accuracy - res["f32"].test_accuracy) <= 0.01, p
    assert res["f16"].loss_scale["skipped_steps"] == 0
    print("\n" + ", ".join(f"{p} {r.test_accuracy:.4f}" for p, r in res.items()))


# -- export --------------------------------------------------------------------------------
@pytest.mark.parametrize("example", ["digits-cnn.net", "transformer-tiny.net"])
def test_export_half_writes_a_float16_model_that_computes_the_float32_ones(example, tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx.reference import ReferenceEvaluator

    from netdsl.interop.onnx_export import export_onnx
    from netdsl.interop.weights import seeded
    g = load(example).lower()
    r32 = export_onnx(g, seeded(0), tmp_path / "m32.onnx", batch=2)
    r16 = export_onnx(g, seeded(0), tmp_path / "m16.onnx", batch=2, half=True)
    assert r16.weight_bytes * 2 == r32.weight_bytes
    m16 = onnx.load(tmp_path / "m16.onnx")
    assert {t.data_type for t in m16.graph.initializer} <= {onnx.TensorProto.FLOAT16,
                                                             onnx.TensorProto.INT64}
    feeds = example_feeds(g.bind(2))
    feeds = {i.name: feeds[i.name].astype(np.float32 if feeds[i.name].dtype.kind == "f"
                                         else np.int64) for i in m16.graph.input}
    ref = ReferenceEvaluator(str(tmp_path / "m32.onnx")).run(None, feeds)[0]
    half = ReferenceEvaluator(m16).run(None, {k: v.astype(np.float16) if v.dtype.kind == "f"
                                              else v for k, v in feeds.items()})[0]
    assert half.dtype == np.float16
    assert np.abs(half - ref).max() <= 8 * 2.0 ** -11 * np.abs(ref).max()


def test_export_half_refuses_a_weight_beyond_float16(tmp_path):
    pytest.importorskip("onnx")
    from netdsl.errors import InteropError
    from netdsl.interop.onnx_export import export_onnx
    from netdsl.interop.weights import seeded
    g = load("digits-cnn.net").lower()
    base = seeded(0)

    def huge(n):
        v = base(n)
        return v * 1e8 if n.name == "linear.weight" else v
    with pytest.raises(InteropError, match="weight `linear.weight` holds values beyond "
                                           "float16's range"):
        export_onnx(g, huge, tmp_path / "m.onnx", half=True)


# -- splits ----------------------------------------------------------------------------------
@pytest.mark.parametrize("precision,split", [("bf16", "data"), ("f16", "pipeline")])
def test_a_split_trains_at_a_precision_within_its_plan(precision, split, monkeypatch):
    """The split's devices hold what their plans say; an f16 overflow on one stage skips
    the step on both (their flags summed by an all_reduce)."""
    if precision == "f16":
        inject_inf_at(monkeypatch, 1)
    net = load("resnet20-cifar.net")
    t = Trainer(net.graph, net.train, RunOptions(steps=3, batch=8, precision=precision,
                                                 devices=2, split=split, eval_samples=0))
    before = []
    orig = t._train_step
    t._train_step = lambda run, log: (before.append(t.executor.state_dict()), orig(run, log))
    r = t.fit()
    assert r.peak_by_device == r.planned_peak_by_device and len(r.peak_by_device) == 2
    assert all(math.isfinite(x) for x in r.losses)
    if precision == "f16":
        assert r.loss_scale == {"scale": 2.0 ** 15, "skipped_steps": 1}
        after_skip = t.executor.state_dict() if len(before) < 3 else before[2]
        for k, v in before[1].items():
            if "running_" not in k:
                np.testing.assert_array_equal(after_skip[k], v, err_msg=k)


# -- the commands ----------------------------------------------------------------------------
def test_the_commands_take_and_report_the_precision(small, tmp_path):
    import subprocess
    import sys

    def netdsl_cli(*args):
        return subprocess.run([sys.executable, "-m", "netdsl_cli", *map(str, args)],
                              capture_output=True, text=True, timeout=300)
    f = small.file
    ck = tmp_path / "ck"
    r = netdsl_cli("run", f, "--steps", "2", "--json", "--checkpoint", ck)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["precision"] == "f16" and d["loss_scale"] == {"scale": 65536.0,
                                                           "skipped_steps": 0}
    r = netdsl_cli("eval", f, "--checkpoint", ck, "--precision", "bf16", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["precision"] == "bf16", r.stderr
    r = netdsl_cli("plan", f, "--precision", "bf16", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["precision"] == "bf16", r.stderr
    r = netdsl_cli("show", f, "--precision", "bf16", "--json")
    rows = {x["op"]: x for x in json.loads(r.stdout)["rows"]}
    assert rows["conv2d"]["precision"] == "reduced" and rows["conv2d"]["type"].startswith("bf16")
    assert rows["softmax_cross_entropy"]["precision"] == "f32"
    r = netdsl_cli("run", f, "--steps", "1", "--dtype", "f64")  # (the file says f16)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "the train section's precision f16 computes in f16" in r.stderr
