"""Mixed precision on a GPU: cuDNN's f16 descriptors (checked here without a GPU, on the
calls they make), and on CuPy (skipped without CuPy and a CUDA device): f16 products that
accumulate in f32, an f16 training step against the NumPy one, the memory pool against
the plan, and bf16 refused by name where CuPy has no bfloat16 arrays."""
from __future__ import annotations

import numpy as np
import pytest
from _examples import example_feeds, load

from netdsl.backends import cudnn
from netdsl.config import TrainConfig
from netdsl.errors import NetdslError
from netdsl.runtime.executor import Executor
from netdsl.step.graphs import training_graph


class _Recorder:
    """A Library stand-in that records the calls a geometry makes."""

    def __init__(self):
        self.calls = []

    def call(self, name, *args):
        self.calls.append((name, args))

    _new = cudnn.Library._new
    geometry = cudnn.Library.geometry


@pytest.mark.parametrize("dtype,data,compute,math", [
    ("float16", 2, 0, 1),  # HALF data, FLOAT compute (f32 accumulation), tensor-op math
    ("float32", 0, 0, 3),  # FLOAT, FMA math (no TF32)
    ("float64", 1, 1, 3),
])
def test_cudnn_descriptors_of_each_dtype(dtype, data, compute, math):
    lib = _Recorder()
    lib.geometry(dtype, (2, 3, 8, 8), (4, 3, 3, 3), (2, 4, 8, 8), (1, 1), (1, 1), (1, 1), 1)
    calls = dict((name, args) for name, args in lib.calls)
    assert calls["cudnnSetTensor4dDescriptor"][2] == data
    assert calls["cudnnSetFilter4dDescriptor"][1] == data
    assert calls["cudnnSetConvolution2dDescriptor"][-1] == compute
    assert calls["cudnnSetConvolutionMathType"][1] == math


# -- on a GPU ---------------------------------------------------------------------------------
def _gpu():
    try:
        from netdsl.backends import get_backend
        return get_backend("cupy", 0)
    except Exception as e:  # DeviceError: no CuPy, no driver, no device
        pytest.skip(f"no usable CuPy GPU: {e}")


@pytest.mark.gpu
def test_f16_products_accumulate_in_f32_on_the_gpu():
    """4,096 ones summed in f16 stop at 2,048 (2,049 is no f16); in f32 they reach 4,096,
    an f16 value: cupy.matmul's f16 GEMM (cuBLAS, tensor cores) accumulates in f32."""
    gpu = _gpu()
    xp = gpu.xp
    a = xp.ones((1, 4096), xp.float16)
    assert float(gpu.to_host(a @ a.T)[0, 0]) == 4096.0


@pytest.mark.gpu
@pytest.mark.parametrize("example,batch", [("resnet20-cifar", 4), ("transformer-tiny", 4)])
def test_an_f16_step_on_the_gpu_matches_numpy_and_its_plan(example, batch):
    """The f16 step (products and convolutions in f16 on cuBLAS/cuDNN, the rest converted
    to f32 around its kernel) against the same graph on NumPy; the pool's high-water mark
    within the plan."""
    gpu = _gpu()
    net = load(f"{example}.net")
    cfg = (net.train or TrainConfig()).model_copy(update={"precision": "f16"})
    g = training_graph(net.lower(batch), cfg, "gpu")
    feeds = {**example_feeds(g), "loss_scale": np.float32(2 ** 10)}
    roles = ("loss", "grads", "found_inf")
    a = Executor(g, "numpy", seed=1).run(feeds, roles=roles)
    ex = Executor(g, gpu, seed=1)
    b = ex.run(feeds, roles=roles)
    assert float(gpu.to_host(b["found_inf"][0])) == 0.0
    np.testing.assert_allclose(float(gpu.to_host(b["loss"][0])), float(a["loss"][0]),
                               rtol=4 * 2 ** -11)
    for x, y in zip(a["grads"], b["grads"]):
        y = gpu.to_host(y)
        assert np.linalg.norm(y - x) <= 0.05 * np.linalg.norm(x) + 1e-6
    with gpu.memory_meter() as m:
        ex.run(feeds, roles=roles)
    plan = ex.plan(roles)
    assert m.peak_bytes <= plan.peak_bytes - plan.state_bytes


@pytest.mark.gpu
def test_bf16_on_cupy_runs_or_is_refused_by_name():
    gpu = _gpu()
    try:
        gpu.check_precision("bf16")
    except NetdslError as e:
        assert "--precision bf16 on the cupy backend needs bfloat16 arrays" in e.message
        return
    g = training_graph(load("digits-cnn.net").lower(4), TrainConfig(precision="bf16"), "gpu")
    out = Executor(g, gpu).run(example_feeds(g), roles=("loss",))
    assert np.isfinite(float(gpu.to_host(out["loss"][0])))
