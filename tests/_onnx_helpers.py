"""Shared by the ONNX tests: run a model in onnxruntime, calibrate batchnorm statistics,
and the error measure the comparisons use."""
from __future__ import annotations

import numpy as np

from netdsl.ir.graph import Graph
from netdsl.runtime.executor import Executor


def run_ort(path, feeds: dict) -> list[np.ndarray]:
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    inputs = {}
    for i in sess.get_inputs():
        v = np.asarray(feeds[i.name])
        inputs[i.name] = v.astype(np.int64 if i.type == "tensor(int64)" else np.float32)
    return sess.run(None, inputs)


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| over max |ref|: the error relative to the output's scale."""
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.isfinite(ref).all()
    return float(np.abs(got.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))


def calibrated_state(g: Graph, feeds: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """The seeded initial state with every batchnorm's running statistics set to the batch
    statistics of `feeds` (one training-mode pass with momentum 1), so that evaluation mode
    stays well scaled through hundreds of layers and the statistics are not just 0 and 1."""
    g1 = g.copy()
    for n in g1.nodes:
        if n.op == "batchnorm":
            n.attrs["momentum"] = 1.0
    ex = Executor(g1, dtype="f32", seed=seed)
    ex.run(feeds, training=True, roles=("output",))
    return ex.state_dict()


def netdsl_forward(g: Graph, state: dict, feeds: dict, dtype: str = "f32") -> list[np.ndarray]:
    """netdsl's evaluation-mode outputs on `state`."""
    ex = Executor(g, dtype=dtype)
    ex.load_state_dict(state)
    return [np.asarray(v) for v in ex.run(feeds, training=False, roles=("output",))["output"]]


def assert_matches(got: list[np.ndarray], g: Graph, state: dict, feeds: dict,
                   tol: float = 1e-5) -> None:
    """onnxruntime's float32 outputs against netdsl's: within `tol` of netdsl's float32 run,
    or, for deep networks where float32 rounding alone exceeds `tol` (ResNet-50: 2e-5,
    ResNet-1001: 5e-3 between netdsl's own float32 and float64 runs), no further from the
    float64 reference than 3 times netdsl's own float32 error."""
    ref32 = netdsl_forward(g, state, feeds)
    assert len(got) == len(ref32) == len(g.outputs["output"])
    ref64 = None
    for k, (a, b) in enumerate(zip(got, ref32)):
        if rel_err(a, b) <= tol:
            continue
        ref64 = ref64 or netdsl_forward(g, state, feeds, "f64")
        own = rel_err(b, ref64[k])
        assert rel_err(a, ref64[k]) <= 3 * own, (rel_err(a, ref64[k]), own)
