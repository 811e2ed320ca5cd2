"""Helpers for operator tests: build `op(inputs)` as a tiny graph whose float inputs are
parameters, reduce it to a scalar loss, differentiate it with `autodiff`, and compare the
gradients with central finite differences (in float64)."""
from __future__ import annotations

import numpy as np

from netdsl.ir.build import add_op
from netdsl.ir.graph import Graph, Node
from netdsl.ir.types import TensorType
from netdsl.passes.autodiff import autodiff
from netdsl.runtime.executor import Executor


def op_graph(op: str, shapes: list[tuple], attrs: dict, ints: dict[int, int] | None = None):
    """Graph `out = op(in0, in1, ...)`, loss = mean(out * r) (or `out` if it is a scalar).

    shapes: one shape per tensor argument. ints: {argument index: exclusive upper bound}
    for integer arguments (labels, ids), or "bool" for a mask; these become `input`
    nodes. Float arguments
    become `param` nodes so that autodiff computes their gradients. `r` is an input of
    random weights, so every output element matters to the loss with its own weight.
    """
    ints = ints or {}
    g = Graph(f"case_{op}", batch=shapes[0][0] if shapes and shapes[0] else 1)
    names = []
    for k, s in enumerate(shapes):
        name = f"in{k}"
        if k in ints:
            dt = "bool" if ints[k] == "bool" else "i64"
            high = 2 if dt == "bool" else ints[k]
            g.add(Node(name, "input", (), TensorType(tuple(s), dt),
                       {"shape": tuple(s), "dtype": dt, "high": high}))
        else:
            g.add(Node(name, "param", (), TensorType(tuple(s), "f32"),
                       {"shape": tuple(s), "init": "normal"}))
        names.append(name)
    out = add_op(g, "out", op, names, attrs)
    loss = "out"
    if out.type.shape != ():
        g.add(Node("r", "input", (), out.type, {"shape": out.type.shape}))
        add_op(g, "weighted", "mul", ["out", "r"], {})
        loss = "weighted"
        for k in range(out.type.rank):
            add_op(g, f"mean{k}", "mean", [loss], {"axis": 0})
            loss = f"mean{k}"
    g.outputs = {"output": ["out"], "loss": [loss]}
    return g.verify()


def random_feeds(g: Graph, rng: np.random.Generator) -> dict[str, np.ndarray]:
    feeds = {}
    for n in g.by_op("input"):
        if n.type.dtype.startswith("i") or n.type.dtype == "bool":
            feeds[n.name] = rng.integers(0, n.attrs["high"], n.type.shape)
        else:
            feeds[n.name] = rng.standard_normal(n.type.shape)
    return feeds


def randomise_params(ex: Executor, rng: np.random.Generator, positive=()) -> None:
    """Standard normal parameters; those named in `positive` (inputs of sqrt, log, a
    pow's base) are |N(0, 1)| + 0.5."""
    for n in ex.graph.nodes:
        if n.op == "param":
            v = rng.standard_normal(n.type.shape)
            ex.state[n.name][...] = np.abs(v) + 0.5 if n.name in positive else v


def check_grads(g: Graph, seed: int = 0, max_elems: int = 24, eps: float = 1e-6,
                rtol: float = 1e-4, atol: float = 1e-7,
                positive=()) -> dict[str, np.ndarray]:
    """Assert autodiff's gradients of `g` match central differences; returns them.

    At most `max_elems` elements of each parameter are probed (chosen at random), which
    keeps the test fast while any systematic error still shows.
    """
    rng = np.random.default_rng(seed)
    tg = autodiff(g).verify()  # (run_pipeline verifies after each pass; here, this)
    ex = Executor(tg, "numpy", dtype="f64", seed=seed)
    randomise_params(ex, rng, positive)
    feeds = random_feeds(tg, rng)
    res = ex.run(feeds, training=True)
    grads = {tg.meta["grad_of"][name]: v.copy() for name, v in
             zip(tg.outputs["grads"], res["grads"], strict=True)}

    def loss() -> float:
        return float(ex.run(feeds, training=True, roles=("loss",))["loss"][0])

    for p, analytic in grads.items():
        value = ex.state[p]
        flat = value.reshape(-1)
        idx = rng.choice(flat.size, size=min(max_elems, flat.size), replace=False)
        for i in idx:
            old = flat[i]
            flat[i] = old + eps
            up = loss()
            flat[i] = old - eps
            down = loss()
            flat[i] = old
            numeric = (up - down) / (2 * eps)
            a = analytic.reshape(-1)[i]
            # a wrong rule is off by O(1) relative; differencing error is ~1e-10 absolute
            assert abs(a - numeric) <= atol + rtol * abs(numeric), (
                f"d loss / d {p}[{np.unravel_index(i, value.shape)}]: autodiff {a!r}, "
                f"finite differences {numeric!r}")
    return grads
