"""The storage plan: its predicted peak is the executor's count on real examples, its
arena never overlaps live values, and executing in the arena changes no number."""
import _fake_cudnn
import numpy as np
import pytest
from _examples import example_feeds, load

from netdsl.backends.numpy import NumpyBackend
from netdsl.errors import NetdslError
from netdsl.ir.build import add_op
from netdsl.ir.graph import Node
from netdsl.memory.plan import make_plan
from netdsl.passes.autodiff import autodiff
from netdsl.passes.optimizer import add_optimizer
from netdsl.runtime.executor import Executor


@pytest.mark.parametrize("example,batch", [("digits-cnn", 8), ("resnet20-cifar", 2),
                                           ("transformer-tiny", 2)])
def test_predicted_peak_is_measured_peak(example, batch):
    net = load(f"{example}.net")
    g = add_optimizer(autodiff(net.lower(batch)), "sgd", lr=0.01, momentum=0.9)
    roles = ("loss", "output", "updates")
    predicted = make_plan(g, roles)
    ex = Executor(g, "numpy")
    ex.run(example_feeds(g), roles=roles)
    assert ex.peak_bytes == predicted.peak_bytes
    # freeing matters: the peak is well below keeping every value of the step
    everything = predicted.state_bytes + predicted.workspace_bytes + sum(
        n.type.nbytes() for n in g.nodes if n.op not in ("param", "buffer"))
    assert predicted.peak_bytes < everything


# -- the arena --------------------------------------------------------------------------------
def training_step(example, batch, fused=False):
    """The example's SGD step; `fused`: through the fuse passes, as a CPU step with the
    fused kernels (batchnorm_relu, attention_qkv, the residual products...)."""
    from netdsl.passes.fuse import fuse, fuse_grads
    fwd = load(f"{example}.net").lower(batch)
    g = autodiff(fuse(fwd, enabled=True) if fused else fwd)
    g = fuse_grads(g, enabled=True) if fused else g
    return add_optimizer(g, "sgd", lr=0.01, momentum=0.9)


ROLES = ("loss", "output", "updates")


@pytest.mark.parametrize("example,batch", [("digits-cnn", 4), ("resnet20-cifar", 2),
                                           ("densenet121", 1), ("transformer-tiny", 2)])
def test_arena_never_overlaps_live_values_and_stays_near_its_bound(example, batch):
    g = training_step(example, batch)
    plan = make_plan(g, ROLES)
    born = {name: k for k, name in enumerate(plan.order)}
    died = {name: k for k, names in enumerate(plan.frees) for name in names}
    end = len(plan.order)
    live = sorted((plan.offsets[v], plan.offsets[v] + plan.sizes[v], born[v], died.get(v, end), v)
                  for v in plan.offsets)
    # any two values whose byte ranges overlap must not be alive at the same time
    for i, (_s1, e1, b1, d1, v1) in enumerate(live):
        for s2, _e2, b2, d2, v2 in live[i + 1:]:
            if s2 >= e1:
                break
            assert d1 < b2 or d2 < b1, f"{v1} and {v2} share bytes while both alive"
    assert plan.arena_bytes >= plan.lower_bound_bytes
    assert plan.arena_bytes <= 1.5 * plan.lower_bound_bytes + 64 * 1024


@pytest.mark.parametrize("example,batch", [("digits-cnn", 4), ("resnet20-cifar", 2)])
def test_arena_execution_gives_the_same_step_bit_for_bit(example, batch):
    g = training_step(example, batch)
    feeds = example_feeds(g)
    results = []
    for arena in (False, True):
        ex = Executor(g, "numpy", dtype="f64", arena=arena)
        losses = [float(ex.run(feeds, roles=ROLES)["loss"][0]) for _ in range(2)]
        results.append((losses, ex.state_dict(), ex.peak_bytes))
    (l0, s0, p0), (l1, s1, p1) = results
    assert l0 == l1
    for k in s0:
        np.testing.assert_array_equal(s0[k], s1[k])
    assert p0 == p1  # the count follows the plan either way


def test_executor_checks_values_against_the_plan():
    g = training_step("digits-cnn", 2)
    ex = Executor(g, "numpy")
    plan = ex.plan(ROLES)
    victim = next(n for n in plan.order if g[n].op == "relu")
    plan.sizes[victim] += 4  # a plan that disagrees with what the kernel returns
    with pytest.raises(NetdslError, match=f"%{victim} = relu.*the plan holds"):
        ex.run(example_feeds(g), roles=ROLES)


def test_a_run_over_its_budget_stops_naming_the_node():
    g = training_step("resnet20-cifar", 2)
    plan = make_plan(g, ROLES)
    ex = Executor(g, "numpy", budget_bytes=plan.peak_bytes - 1)
    with pytest.raises(NetdslError, match=r"out of the memory budget at %\S+ = \w+"):
        ex.run(example_feeds(g), roles=ROLES)
    assert ex.bytes_current == plan.state_bytes  # nothing leaked by the failed run
    Executor(g, "numpy", budget_bytes=plan.peak_bytes).run(example_feeds(g), roles=ROLES)


@pytest.mark.parametrize("arena", [False, True])
def test_the_independent_meter_agrees_with_the_plan(arena):
    """tracemalloc (which NumPy reports its buffers to) measures what a step really
    allocates; it stays close to the plan's value bytes, and under it in the arena, where
    the only allocations left are kernel scratch and results not yet in their slot."""
    g = training_step("resnet20-cifar", 8)
    feeds = example_feeds(g)
    ex = Executor(g, "numpy", arena=arena)
    ex.run(feeds, roles=ROLES)  # first run: the arena block is allocated once
    plan = ex.plan(ROLES)
    with ex.backend.memory_meter() as meter:
        ex.run(feeds, roles=ROLES)
    planned = plan.peak_bytes - plan.state_bytes  # values + workspace region
    if arena:
        assert meter.peak_bytes < 0.35 * planned  # values are in the arena already
    else:
        assert 0.7 * planned < meter.peak_bytes < 1.1 * planned


# -- workspace rules follow the kernels ----------------------------------------------------------
CONV_PATHS = [  # (x shape, attrs): every kernel path of conv2d's three kernels
    ((2, 8, 12, 12), {"out_channels": 6, "kernel": 1}),  # pointwise
    ((2, 8, 20, 20), {"out_channels": 6, "kernel": 3, "padding": 1}),  # flat shift
    ((2, 4, 12, 12), {"out_channels": 6, "kernel": 3, "stride": 2, "padding": 1}),  # folded
    ((2, 8, 12, 12), {"out_channels": 6, "kernel": 3, "stride": 2, "padding": 1}),  # im2col
    ((2, 8, 36, 36), {"out_channels": 6, "kernel": 3, "stride": 2, "padding": 1}),  # im2col
    ((2, 64, 4, 4), {"out_channels": 48, "kernel": 1}),  # pointwise, dW folded
    ((2, 8, 12, 12), {"out_channels": 8, "kernel": 1, "stride": 2, "bias": False}),
    ((2, 8, 20, 20), {"out_channels": 8, "kernel": 3, "padding": 1, "groups": 2}),
    ((2, 8, 20, 20), {"out_channels": 8, "kernel": 3, "padding": 1, "groups": 8}),  # depthwise
    ((2, 6, 21, 21), {"out_channels": 12, "kernel": 3, "stride": 2, "padding": 1,
                      "groups": 6}),  # depthwise, strided, two outputs a channel
    ((2, 4, 10, 10), {"out_channels": 4, "kernel": 3, "padding": (0, 1, 1, 2)}),  # asymmetric
    ((2, 32, 40, 40), {"out_channels": 32, "kernel": 3, "padding": 1}),  # Winograd (Numba)
]


@pytest.mark.parametrize("target", [None, "gpu"])
@pytest.mark.parametrize("shape,attrs", CONV_PATHS, ids=range(len(CONV_PATHS)))
def test_conv_workspace_rules_cover_what_the_kernels_allocate(shape, attrs, target):
    """tracemalloc's peak inside each kernel, less its result, stays within the op's
    declared workspace with the fused kernels and with the NumPy reference kernels (the
    plan does not know which will run, so a rule covers the larger), and the larger of
    the two uses most of it (the rule is not a blanket). Measured here: every path's
    scratch within 4 kB of its rule. With target "gpu" (nodes the `device` pass marked
    for a GPU: the columns' paths, the same xp code CuPy runs) the rules count those
    paths, and cuDNN's workspaces (the stand-in library's, tests/_fake_cudnn.py, where a C
    compiler builds it), and the results equal the CPU paths'."""
    import tracemalloc

    from netdsl.ir import registry
    from netdsl.ir.build import add_op
    from netdsl.ir.graph import Graph, Node
    from netdsl.ir.types import TensorType
    from netdsl.runtime.executor import KernelContext
    g = Graph("c", batch=shape[0])
    # x is a parameter, so that the backward pass computes its gradient too
    g.add(Node("x", "param", (), TensorType(shape), {"shape": shape, "init": "normal"}))
    add_op(g, "y", "conv2d", ["x"], attrs)
    t = autodiff_of(g)
    if target is not None:
        from netdsl.passes.device import for_device
        t = for_device(t, target)
    rng = np.random.default_rng(0)
    values = {n.name: rng.standard_normal(n.type.shape).astype(np.float32)
              for n in t.nodes if n.op in ("input", "param")}
    be = Executor(t, "numpy").backend
    reference = Executor(t, "numpy").backend
    reference._fused = None
    backends = [be, reference]
    if target == "gpu" and _fake_cudnn.library() is not None:
        backends.append(NumpyBackend())
        backends[-1].cudnn = _fake_cudnn.convolutions()
    for n in t.nodes:
        if n.op not in ("conv2d", "conv2d_grad_input", "conv2d_grad_weight"):
            continue
        op = registry.OPS[n.op]
        ins = [values.get(i) if i in values else
               rng.standard_normal(t[i].type.shape).astype(np.float32) for i in n.inputs]
        declared = op.workspace([t[i].type for i in n.inputs[:op.n_tensor_inputs(
            len(n.inputs))]], n.type, n.attrs)
        most = 0
        for backend in backends:
            ctx = KernelContext(True, backend, "float32")
            ctx.node = n
            with backend.running():  # as in a run: the fused kernels' GEMMs on their threads
                if getattr(backend, "cudnn", None) is not None:
                    # its descriptors and algorithm choice, made once per geometry, are
                    # host objects (ctypes buffers, which tracemalloc sees), not scratch
                    op.kernel(np, ins, n.attrs, ctx)
                tracemalloc.start()  # (Numba's arrays too: its runtime allocates through
                out = op.kernel(np, ins, n.attrs, ctx)  # CPython's allocator)
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
            used = peak - out.nbytes
            most = max(most, used)
            if target is not None:  # the same numbers as the CPU's paths
                plain = {k: v for k, v in n.attrs.items() if k != "target"}
                want = op.kernel(np, ins, plain, ctx)
                np.testing.assert_allclose(out, want, rtol=1e-4,
                                           atol=1e-5 * float(np.abs(want).max()))
            # slack: NumPy's matmul may hold one result-sized temporary of its own
            assert used <= declared + out.nbytes + 4096, (n.op, used, declared)
        if declared > 64 * 1024:
            assert most >= 0.5 * declared, (n.op, most, declared)


def test_device_pass_marks_the_convolutions_for_a_gpu_only():
    """`device` kind gpu marks conv2d and its two gradients (target = "gpu"), nothing else;
    kind cpu changes nothing; the Trainer marks its step on CuPy only."""
    from netdsl.config import TrainConfig
    from netdsl.passes.device import for_device
    from netdsl.runtime.options import RunOptions
    from netdsl.runtime.trainer import Trainer
    from netdsl.step.graphs import training_graph
    net = load("resnet20-cifar.net")
    step = training_graph(net.lower(2), net.train or TrainConfig(), "gpu")
    convs = {"conv2d", "conv2d_grad_input", "conv2d_grad_weight"}
    assert {n.op for n in step.nodes if n.attrs.get("target") == "gpu"} == convs
    assert all(n.attrs.get("target") == "gpu" for n in step.nodes if n.op in convs)
    cpu = training_graph(net.lower(2), net.train or TrainConfig())
    assert not any("target" in n.attrs for n in cpu.nodes)
    assert for_device(cpu, "cpu") is cpu
    with pytest.raises(NetdslError, match="unknown device kind"):
        for_device(cpu, "tpu")
    tr = Trainer(net.graph, net.train, RunOptions(steps=1, batch=2))
    assert not any("target" in n.attrs for n in tr.train_graph.nodes)


def autodiff_of(g):
    y = g["y"]
    g.add(Node("t", "input", (), y.type, {"shape": y.type.shape}))
    add_op(g, "loss", "mse", ["y", "t"], {})
    g.outputs = {"output": ["y"], "loss": ["loss"]}
    return autodiff(g.verify())


# every op of a step: a kernel's scratch within its rule ----------------------------------------
# per call, besides the arrays: the interpreter's objects and ufunc buffers (34 kB measured)
CALL_SLACK = 64 * 1024


@pytest.mark.parametrize("fused", ["1", "0"], ids=["fused", "numpy"])
@pytest.mark.parametrize("example,batch", [
    ("digits-cnn", 64), ("transformer-tiny", 32), ("gpt-tiny", 32), ("resnet20-cifar", 8),
    ("squeezenet1_1", 1), ("mobilenet_v2", 1), ("unet-small", 1), ("densenet121", 1)])
@pytest.mark.parametrize("passes", [False, True], ids=["as-written", "fuse-passes"])
def test_every_kernel_of_a_step_stays_within_its_workspace_rule(example, batch, fused, passes,
                                                                monkeypatch):
    """An arena run holds, outside the arena, a node's scratch and its result until the
    result is in its slot; the plan counts the op's workspace rule plus that result
    (`MemoryPlan.transient_bytes`). tracemalloc's peak inside every kernel call of a
    training step (dropout's masks, attention's scores, pooling's passes, the losses'
    softmax included) stays within that, with the fused kernels and with the NumPy
    reference kernels alike, the step as written and through the fuse passes (its fused
    ops: batchnorm_relu, attention_qkv, the products with a residual)."""
    import tracemalloc

    from netdsl.memory.plan import workspace_bytes
    monkeypatch.setenv("NETDSL_FUSED_KERNELS", fused)
    g = training_step(example, batch, fused=passes)
    feeds = example_feeds(g)
    ex = Executor(g, "numpy", arena=True)
    if fused == "0":
        assert ex.backend.fused is None  # the reference kernels run
    ex.run(feeds, roles=ROLES)  # the arena, the plan and the kernels' first calls
    over, calls = [], []
    call = Executor._call

    def measured(self, n, inputs, ctx):
        calls.append(n.op)
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        out = call(self, n, inputs, ctx)
        used = tracemalloc.get_traced_memory()[1] - before
        in_slot = ctx.out is not None and np.may_share_memory(out, ctx.out)
        allowed = workspace_bytes(g, n) + (0 if in_slot else out.nbytes)
        if used > allowed + CALL_SLACK:
            over.append((n.op, n.name, used, allowed))
        return out

    monkeypatch.setattr(Executor, "_call", measured)
    tracemalloc.start()
    try:
        ex.run(feeds, roles=ROLES)
    finally:
        tracemalloc.stop()
    assert len(calls) > 20 and not over, over
    if passes and example in ("transformer-tiny", "gpt-tiny"):
        assert {"attention_qkv", "attention_qkv_grad"} <= set(calls)
