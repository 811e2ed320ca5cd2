"""The CuPy backend against the NumPy one: same graphs, same numbers, same byte counts.

Skips cleanly unless CuPy is installed and a CUDA device answers. On a GPU machine run
`bash bench/gpu_check.sh` (it runs these and a ResNet step with --backend cupy).
"""
import numpy as np
import pytest
from _examples import example_feeds, load
from _fake_cudnn import GEOMETRIES, conv_attrs, geometry
from _op_cases import OP_CASES

from netdsl.passes.autodiff import autodiff
from netdsl.passes.optimizer import add_optimizer
from netdsl.runtime.executor import Executor


def _gpu_backend():
    try:
        from netdsl.backends import get_backend
        return get_backend("cupy", 0)
    except Exception as e:  # DeviceError: no CuPy, no driver, no device
        pytest.skip(f"no usable CuPy GPU: {e}")


pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("device", ["cpu", "gpu"])
@pytest.mark.parametrize("example,batch", [("digits-cnn", 4), ("resnet20-cifar", 2),
                                           ("transformer-tiny", 2), ("densenet121", 1)])
def test_training_step_matches_numpy(example, batch, device):
    """Two steps on CuPy and on NumPy, the same graph: as written, and with the `device`
    pass's GPU variants (the columns' convolutions: the Trainer's graph on CuPy)."""
    from netdsl.passes.device import for_device
    gpu = _gpu_backend()
    g = for_device(add_optimizer(autodiff(load(f"{example}.net").lower(batch)), "sgd",
                                 lr=0.1, momentum=0.9, weight_decay=1e-4), device)
    roles = ("loss", "grads", "updates")
    feeds = example_feeds(g)
    cpu_ex = Executor(g, "numpy", dtype="f64", seed=1)
    gpu_ex = Executor(g, gpu, dtype="f64", seed=1)
    for _ in range(2):  # two steps: momentum buffers and BN statistics take part
        a = cpu_ex.run(feeds, roles=roles)
        b = gpu_ex.run(feeds, roles=roles)
        np.testing.assert_allclose(gpu.to_host(b["loss"][0]), a["loss"][0], rtol=1e-9)
        for x, y in zip(a["grads"], b["grads"]):
            np.testing.assert_allclose(gpu.to_host(y), x, rtol=1e-7, atol=1e-10)
    sa, sb = cpu_ex.state_dict(), gpu_ex.state_dict()
    for k in sa:
        np.testing.assert_allclose(sb[k], sa[k], rtol=1e-7, atol=1e-10, err_msg=k)
    # the executor's own accounting is backend-independent
    assert gpu_ex.peak_bytes == cpu_ex.peak_bytes


@pytest.mark.parametrize("kind,hyper", [("adam", {"weight_decay": 1e-4}),
                                        ("adamw", {"weight_decay": 0.01})])
def test_adam_steps_match_numpy(kind, hyper):
    """Adam and AdamW on the GPU (one CUDA launch a parameter, the learning rate and step
    counter read on the device) against NumPy's, over three steps."""
    gpu = _gpu_backend()
    g = add_optimizer(autodiff(load("transformer-tiny.net").lower(2)), kind, lr=1e-3, **hyper)
    feeds = example_feeds(g)
    cpu_ex = Executor(g, "numpy", dtype="f64", seed=1)
    gpu_ex = Executor(g, gpu, dtype="f64", seed=1)
    for _ in range(3):
        a = cpu_ex.run(feeds, roles=("loss", "updates"))
        b = gpu_ex.run(feeds, roles=("loss", "updates"))
        np.testing.assert_allclose(gpu.to_host(b["loss"][0]), a["loss"][0], rtol=1e-9)
    sa, sb = cpu_ex.state_dict(), gpu_ex.state_dict()
    for k in sa:
        np.testing.assert_allclose(sb[k], sa[k], rtol=1e-7, atol=1e-10, err_msg=k)


@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("kind,hyper", [("sgd", {"momentum": 0.9, "weight_decay": 1e-4}),
                                        ("adamw", {"weight_decay": 0.01})])
def test_grouped_updates_are_the_single_ones_on_the_gpu(kind, hyper, dtype):
    """One launch for all the parameters (group_updates: a table of their addresses) gives
    what a launch a parameter gives, bit for bit, and NumPy's numbers."""
    from netdsl.passes.optimizer import group_updates
    gpu = _gpu_backend()
    g = add_optimizer(autodiff(load("digits-cnn.net").lower(4)), kind, lr=1e-2, **hyper)
    h = group_updates(g)
    assert h.by_op(f"{'sgd' if kind == 'sgd' else 'adam'}_update_group")
    feeds = example_feeds(g)
    runs = [Executor(x, b, dtype=dtype, seed=1) for x, b in ((g, gpu), (h, gpu),
                                                             (h, "numpy"))]
    for _ in range(3):
        for ex in runs:
            ex.run(feeds, roles=("loss", "updates"))
    single, grouped, cpu = (ex.state_dict() for ex in runs)
    for k in single:
        assert np.array_equal(grouped[k], single[k]), k
        np.testing.assert_allclose(grouped[k], cpu[k], rtol=1e-4 if dtype == "f32" else 1e-9,
                                   atol=1e-6 if dtype == "f32" else 1e-12, err_msg=k)


def test_float32_step_runs_and_is_finite():
    gpu = _gpu_backend()
    g = add_optimizer(autodiff(load("resnet164-cifar.net").lower(16)), "sgd", lr=0.1,
                      momentum=0.9)
    ex = Executor(g, gpu, dtype="f32", check_numerics=True)
    out = ex.run(example_feeds(g), roles=("loss", "updates"))
    assert np.isfinite(gpu.to_host(out["loss"][0]))


@pytest.mark.parametrize("case", OP_CASES, ids=[f"{c[0]}-{k}" for k, c in enumerate(OP_CASES)])
def test_op_case_matches_numpy(case):
    """Every operator case of tests/_op_cases.py: forward and gradients on CuPy equal
    NumPy's in float64 (the kernels use only the xp functions both provide)."""
    from gradcheck import op_graph, random_feeds, randomise_params
    gpu = _gpu_backend()
    op, shapes, attrs, ints, positive = case
    g = autodiff(op_graph(op, shapes, attrs, ints))
    cpu_ex = Executor(g, "numpy", dtype="f64", seed=0)
    randomise_params(cpu_ex, np.random.default_rng(0), positive)
    gpu_ex = Executor(g, gpu, dtype="f64", seed=0)
    gpu_ex.load_state_dict(cpu_ex.state_dict())
    feeds = random_feeds(g, np.random.default_rng(1))
    a, b = cpu_ex.run(feeds), gpu_ex.run(feeds)
    for role in ("output", "loss", "grads"):
        for x, y in zip(a[role], b[role]):
            np.testing.assert_allclose(gpu.to_host(y), x, rtol=1e-9, atol=1e-12,
                                       err_msg=f"{op} {role}")


@pytest.mark.parametrize("mode", ["layer-adaptive", "alternate"])
def test_planned_step_matches_the_numpy_planned_step(mode):
    """Recompute and offload (pinned host buffers, the copy stream) on the GPU: the
    rewritten step equals the same rewritten step on NumPy, and the executor's count is
    still the plan's."""
    from test_strategies import ROLES, WITH_GRADS, decide, step_graph

    from netdsl.memory.plan import make_plan
    from netdsl.memory.strategies import apply_decisions
    gpu = _gpu_backend()
    g = step_graph("resnet20-cifar", 2)
    h = apply_decisions(g, decide(g, mode))
    feeds = example_feeds(g)
    cpu_ex = Executor(h, "numpy", dtype="f64", seed=7)
    gpu_ex = Executor(h, gpu, dtype="f64", seed=7)
    for _ in range(2):
        a = cpu_ex.run(feeds, roles=WITH_GRADS)
        b = gpu_ex.run(feeds, roles=WITH_GRADS)
        np.testing.assert_allclose(gpu.to_host(b["loss"][0]), a["loss"][0], rtol=1e-9)
        for x, y in zip(a["grads"], b["grads"], strict=True):
            np.testing.assert_allclose(gpu.to_host(y), x, rtol=1e-7, atol=1e-10)
    sa, sb = cpu_ex.state_dict(), gpu_ex.state_dict()
    for k in sa:
        np.testing.assert_allclose(sb[k], sa[k], rtol=1e-7, atol=1e-10, err_msg=k)
    gpu_ex.reset_peak()
    gpu_ex.run(feeds, roles=ROLES)
    assert gpu_ex.peak_bytes == make_plan(h, ROLES, "f64").peak_bytes


@pytest.mark.parametrize("spec", ["data2", "pipeline2", "tensor2"])
def test_split_step_matches_numpy(spec):
    """A step split over two logical devices (one CuPy backend, the in-process
    collectives) computes what the same split step computes on NumPy."""
    from test_split import SPECS, setup

    from netdsl.parallel.split import split_step
    gpu = _gpu_backend()
    net, opt, feeds = setup("resnet20")
    g = split_step(net.graph, 8, SPECS[spec], opt, device="gpu")  # (a GPU's fusions)
    cpu_ex, gpu_ex = _same_step(g, gpu, feeds)
    assert gpu_ex.comm.sent_bytes == cpu_ex.comm.sent_bytes


@pytest.mark.parametrize("microbatches", [1, 2])
def test_synchronised_batchnorm_takes_the_cuda_kernels(microbatches, monkeypatch):
    """A data split's synchronised batchnorm (and, with micro-batches, a micro-batch's own
    and the deferred running statistics) runs on the CUDA kernels, which these runs are
    checked to take, and computes what NumPy computes: the loss and every gradient."""
    from test_split import setup

    from netdsl.parallel.split import SplitSpec, split_step
    gpu = _gpu_backend()
    assert gpu.cuda_fused is not None, "NETDSL_CUDA_KERNELS is off"
    names = ("bn_moments", "bn_combine", "bn_normalise", "bn_grad_sums", "bn_grad_input",
             "bn_running")
    called = _spy(monkeypatch, gpu.cuda_fused, names)
    net, opt, feeds = setup("resnet20")
    spec = SplitSpec(data=2, microbatches=microbatches)
    g = split_step(net.graph, 8, spec, opt, device="gpu")
    cpu_ex, gpu_ex = _same_step(g, gpu, feeds, ("loss", "grads", "state_updates"))
    sa, sb = cpu_ex.state_dict(), gpu_ex.state_dict()  # the running statistics too
    for k in sa:
        np.testing.assert_allclose(sb[k], sa[k], rtol=1e-9, atol=1e-12, err_msg=k)
    assert called == set(names)


def _spy(monkeypatch, kernels, names) -> set:
    """The set that the `kernels` methods `names` add their names to when called."""
    called = set()
    for name in names:
        def spy(*args, _f=getattr(kernels, name), _n=name):
            called.add(_n)
            return _f(*args)
        monkeypatch.setattr(kernels, name, spy)
    return called


def _same_step(g, gpu, feeds, roles=("loss", "grads")):
    """One float64 training step of `g` on NumPy and on the GPU: the same loss and
    gradients. Returns both executors."""
    cpu_ex = Executor(g, "numpy", dtype="f64", seed=0)
    gpu_ex = Executor(g, gpu, dtype="f64", seed=0)
    a = cpu_ex.run(dict(feeds), training=True, roles=roles, step=0)
    b = gpu_ex.run(dict(feeds), training=True, roles=roles, step=0)
    np.testing.assert_allclose(gpu.to_host(b["loss"][0]), a["loss"][0], rtol=1e-9)
    for x, y in zip(a["grads"], b["grads"], strict=True):
        np.testing.assert_allclose(gpu.to_host(y), x, rtol=1e-7, atol=1e-10)
    return cpu_ex, gpu_ex


@pytest.mark.parametrize("dtype,rtol", [("f64", 1e-9), ("f32", 2e-4)])
@pytest.mark.parametrize("op,attrs", [("batchnorm", {}), ("batchnorm", {"affine": False}),
                                      ("batchnorm_relu", {}), ("batchnorm_relu", {"cap": 6.0})])
def test_cuda_batchnorm_kernels_match_numpy(op, attrs, dtype, rtol, monkeypatch):
    """The CUDA batchnorm kernels (netdsl.backends.cupy_fused: forward, backward statistics,
    input gradient, running statistics), which these runs are checked to take, against the
    NumPy reference kernels: output, loss, gradients and the running statistics."""
    from gradcheck import op_graph, random_feeds, randomise_params
    gpu = _gpu_backend()
    assert gpu.cuda_fused is not None, "NETDSL_CUDA_KERNELS is off"
    called = _spy(monkeypatch, gpu.cuda_fused,
                  ("bn_forward", "bn_running", "bn_grad_stats", "bn_grad_input"))
    g = autodiff(op_graph(op, [(4, 6, 5, 7)], attrs, {}))
    cpu_ex = Executor(g, "numpy", dtype=dtype, seed=0)
    randomise_params(cpu_ex, np.random.default_rng(0), ())
    gpu_ex = Executor(g, gpu, dtype=dtype, seed=0)
    gpu_ex.load_state_dict(cpu_ex.state_dict())
    feeds = random_feeds(g, np.random.default_rng(1))
    a, b = cpu_ex.run(feeds), gpu_ex.run(feeds)
    def close(got, want, what):  # float32: near-zero elements against the array's scale
        want = np.asarray(want)
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * float(np.abs(want).max()),
                                   err_msg=f"{op} {what}")
    for role in ("output", "loss", "grads"):
        for x, y in zip(a[role], b[role], strict=True):
            close(gpu.to_host(y), x, role)
    sa, sb = cpu_ex.state_dict(), gpu_ex.state_dict()
    for k in sa:
        close(sb[k], sa[k], k)
    assert called == {"bn_forward", "bn_running", "bn_grad_stats", "bn_grad_input"}


def _cudnn(gpu):
    """The backend's cuDNN convolutions; a skip where no library is installed or it is
    turned off, a failure where one loaded but did not pass its check."""
    dnn = gpu.cudnn
    status = gpu.cudnn_status
    if dnn is None and ("could be loaded" in status or status.startswith("off")):
        pytest.skip(f"cuDNN: {status}")
    assert dnn is not None, f"cuDNN {status}"
    return dnn


def test_cudnn_is_found_and_passes_its_check():
    gpu = _gpu_backend()
    _cudnn(gpu)
    assert gpu.cudnn_status.startswith("cuDNN "), gpu.cudnn_status
    print(gpu.cudnn_status)  # (which library: the device run's log says)


@pytest.mark.parametrize("dtype,rtol", [("float64", 1e-10), ("float32", 1e-4)])
@pytest.mark.parametrize("shape,o,a", GEOMETRIES, ids=range(len(GEOMETRIES)))
def test_cudnn_convolutions_match_numpy(shape, o, a, dtype, rtol):
    """cuDNN's three convolutions (FMA math: no TF32) against the NumPy kernels, and
    writing into a given output (a planned slot)."""
    from netdsl.ir.ops.conv import conv2d_forward, conv2d_grad_input, conv2d_grad_weight
    gpu = _gpu_backend()
    dnn, cp = _cudnn(gpu), gpu.xp
    a = conv_attrs(o, a)
    geom, groups = geometry(a), a["groups"]
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(dtype)
    w = rng.standard_normal((o, shape[1] // groups, *geom[:2])).astype(dtype)
    y = conv2d_forward(np, x, w, a)
    dy = rng.standard_normal(y.shape).astype(dtype)
    out = cp.full(y.shape, np.nan, dtype)
    got = (dnn.forward(cp.asarray(x), cp.asarray(w), geom, groups, out, limit=1 << 24),
           dnn.grad_input(cp.asarray(dy), cp.asarray(w), x.shape, geom, groups, None, 1 << 24),
           dnn.grad_weight(cp.asarray(dy), cp.asarray(x), w.shape, geom, groups, 1 << 24))
    assert got[0] is out
    want = (y, conv2d_grad_input(np, dy, w, x.shape, a), conv2d_grad_weight(np, dy, x, w.shape, a))
    for what, g, r in zip(("forward", "dx", "dw"), got, want, strict=True):
        if g is None:
            pytest.fail(f"cuDNN found no {what} algorithm for {shape} {a}")
        np.testing.assert_allclose(cp.asnumpy(g), r, rtol=rtol,
                                   atol=rtol * float(np.abs(r).max()), err_msg=what)


@pytest.mark.parametrize("example,batch,kind", [("resnet20-cifar", 4, "sgd"),
                                                ("digits-cnn", 8, "adam")])
def test_cuda_graph_replays_equal_ordinary_steps(example, batch, kind, monkeypatch):
    """NETDSL_CUDA_GRAPH=1: the second step is recorded as a CUDA graph and later steps
    replay it (netdsl.runtime.replay); four steps equal four ordinary GPU steps (float64;
    the recorded loss takes the general cross-entropy path, the same sums)."""
    from netdsl.passes.device import for_device
    from netdsl.runtime.replay import GRAPH_ENV, Recorded
    gpu = _gpu_backend()
    hyper = {"lr": 0.05, "momentum": 0.9} if kind == "sgd" else {"lr": 1e-3}
    g = for_device(add_optimizer(autodiff(load(f"{example}.net").lower(batch)), kind,
                                 **hyper), "gpu")
    roles = ("loss", "grads", "updates")
    feeds = example_feeds(g)
    plain = Executor(g, gpu, dtype="f64", seed=2)
    monkeypatch.setenv(GRAPH_ENV, "1")
    ex = Executor(g, gpu, dtype="f64", seed=2)
    assert ex.replay is not None
    for k in range(4):
        f = {name: (v * (1 + 0.1 * k) if np.asarray(v).dtype.kind == "f" and np.ndim(v)
                    else v) for name, v in feeds.items()}  # each step its own batch
        a, b = plain.run(f, roles=roles), ex.run(f, roles=roles)
        np.testing.assert_allclose(gpu.to_host(b["loss"][0]), gpu.to_host(a["loss"][0]),
                                   rtol=1e-9)
        for x, y in zip(a["grads"], b["grads"], strict=True):
            np.testing.assert_allclose(gpu.to_host(y), gpu.to_host(x), rtol=1e-7, atol=1e-10)
    assert not ex.replay.reasons, "\n".join(ex.replay.reasons.values())
    assert isinstance(ex.replay.kinds[(roles, True)], Recorded)
    sa, sb = plain.state_dict(), ex.state_dict()
    for k in sa:
        np.testing.assert_allclose(sb[k], sa[k], rtol=1e-7, atol=1e-10, err_msg=k)


def test_accumulated_step_and_evaluation_match_numpy(tmp_path):
    """Gradient accumulation (four parts, the GPU's kernel variants) computes on the GPU
    what it computes on NumPy, and a checkpoint evaluates to the same loss on both."""
    from test_split import setup

    from netdsl.runtime.checkpoint import save
    from netdsl.runtime.evaluate import evaluate_checkpoint
    from netdsl.step.graphs import accumulating_step
    gpu = _gpu_backend()
    net, _, feeds = setup("resnet20")
    g = accumulating_step(net.graph, 8, net.train, 4, device="gpu")
    cpu_ex, _ = _same_step(g, gpu, feeds)
    save(tmp_path, cpu_ex.state_items(), {"network": net.graph.name, "step": 1})
    kw = dict(batch=8, samples=16, dtype="f64")
    on_cpu = evaluate_checkpoint(net.graph, net.train, tmp_path, backend="numpy", **kw)
    on_gpu = evaluate_checkpoint(net.graph, net.train, tmp_path, backend=gpu, **kw)
    assert on_gpu.loss == pytest.approx(on_cpu.loss, rel=1e-9)
