"""The autodiff pass: structure of the training graph, accumulation, pruning, what backward
reads (`retains`), and before/after equality of the loss."""
from __future__ import annotations

import numpy as np
import pytest
from _op_cases import SPLIT_ONLY, samples
from gradcheck import op_graph

from netdsl.errors import NetdslError, SourceLoc
from netdsl.ir import registry
from netdsl.ir.build import add_op
from netdsl.ir.graph import Graph, Node
from netdsl.ir.types import TensorType
from netdsl.passes.autodiff import GradBuilder, autodiff
from netdsl.runtime.executor import Executor

LOC = SourceLoc("toy.net", 7, 3)


def param(g, name, shape):
    g.add(Node(name, "param", (), TensorType(shape), {"shape": shape, "init": "normal"}))


def inp(g, name, shape, dtype="f32"):
    g.add(Node(name, "input", (), TensorType(shape, dtype), {"shape": shape, "dtype": dtype}))


def small_cnn(batch: int | str = 4) -> Graph:
    g = Graph("cnn", batch=batch)
    inp(g, "x", (batch, 3, 6, 6))
    inp(g, "y", (batch,), "i64")
    add_op(g, "conv", "conv2d", ["x"], {"out_channels": 4, "kernel": 3, "padding": 1},
           loc=LOC, scope=("stem",))
    add_op(g, "bn", "batchnorm", ["conv"], {})
    add_op(g, "act", "relu", ["bn"], {})
    add_op(g, "pool", "global_avgpool", ["act"], {})
    add_op(g, "flat", "flatten", ["pool"], {})
    add_op(g, "fc", "linear", ["flat"], {"out_features": 3})
    add_op(g, "loss", "softmax_cross_entropy", ["fc", "y"], {})
    g.outputs = {"output": ["fc"], "loss": ["loss"]}
    return g.verify()


def feeds_for(g, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal(g["x"].type.shape), "y": rng.integers(0, 3, 4)}


def test_training_graph_structure():
    g = small_cnn()
    t = autodiff(g)
    assert g.outputs.keys() == {"output", "loss"}  # the input graph is not modified
    params = [n.name for n in t.params()]
    assert [t.meta["grad_of"][gname] for gname in t.outputs["grads"]] == params
    for gname, p in zip(t.outputs["grads"], params, strict=True):
        assert t[gname].type == t[p].type
        assert t[gname].meta["phase"] == "backward"
    conv_grads = [n for n in t.nodes if n.meta.get("forward") == "conv"]
    assert conv_grads and all(n.loc == LOC and n.scope == ("stem",) for n in conv_grads)
    # x is the network input: nothing may compute its gradient
    assert not t.by_op("conv2d_grad_input")
    assert not any(n.name == "x" for n in t.nodes if n.meta.get("phase") == "backward")


def test_loss_is_unchanged_by_autodiff():
    """Before/after: the training graph computes exactly the forward graph's loss."""
    g = small_cnn()
    t = autodiff(g)
    fwd = Executor(g, "numpy", dtype="f64", seed=3)
    train = Executor(t, "numpy", dtype="f64", seed=3)
    for training in (True, False):
        a = fwd.run(feeds_for(g), training=training)["loss"][0]
        b = train.run(feeds_for(g), training=training)["loss"][0]
        assert float(a) == float(b)


def test_value_used_twice_accumulates():
    # loss = mean(mean(w * w + w)): w is read three times, so d/dw = 2w + 1, summed by adds
    g = Graph("twice", batch=1)
    param(g, "w", (2, 3))
    add_op(g, "sq", "mul", ["w", "w"], {})
    add_op(g, "s", "add", ["sq", "w"], {})
    add_op(g, "m0", "mean", ["s"], {"axis": 0})
    add_op(g, "m1", "mean", ["m0"], {"axis": 0})
    g.outputs = {"loss": ["m1"]}
    t = autodiff(g)
    accs = [n for n in t.nodes if n.op == "add" and n.meta.get("phase") == "backward"]
    assert len(accs) == 2  # three contributions to w
    ex = Executor(t, "numpy", dtype="f64")
    (grad,) = ex.run({})["grads"]
    w = ex.state["w"]
    assert np.allclose(grad, (2 * w + 1) / 6)


def test_branches_that_miss_the_loss_or_params_are_pruned():
    g = Graph("branches", batch=2)
    inp(g, "x", (2, 3))
    param(g, "w", (2, 3))
    param(g, "unused", (5,))
    add_op(g, "h", "mul", ["x", "w"], {})
    add_op(g, "side", "tanh", ["h"], {})  # depends on w but does not reach the loss
    add_op(g, "xonly", "sigmoid", ["x"], {})  # reaches the loss but has no parameter
    add_op(g, "s", "add", ["h", "xonly"], {})
    add_op(g, "m0", "mean", ["s"], {"axis": 0})
    add_op(g, "loss", "mean", ["m0"], {"axis": 0})
    g.outputs = {"output": ["side"], "loss": ["loss"]}
    t = autodiff(g)
    backward = [n for n in t.nodes if n.meta.get("phase") == "backward"]
    assert {n.meta["forward"] for n in backward} >= {"h", "loss"}
    assert not any(n.meta["forward"] in ("side", "xonly") for n in backward)
    assert not t.by_op("tanh_grad", "sigmoid_grad")
    # the unused parameter's gradient is an explicit zero, so every param has one
    gz = t.outputs["grads"][1]
    assert t[gz].op == "fill" and t[gz].attrs["value"] == 0.0
    ex = Executor(t, "numpy", dtype="f64")
    x = np.arange(6.0).reshape(2, 3)
    gw, gu = ex.run({"x": x})["grads"]
    assert np.allclose(gw, x / 6) and np.all(gu == 0)


def test_shared_gradient_values_get_their_own_nodes():
    # add(p, q) passes dy unchanged to both: each parameter still owns a distinct node
    g = Graph("shared", batch=1)
    param(g, "p", (3,))
    param(g, "q", (3,))
    add_op(g, "s", "add", ["p", "q"], {})
    add_op(g, "loss", "mean", ["s"], {"axis": 0})
    g.outputs = {"loss": ["loss"]}
    t = autodiff(g)
    gp, gq = t.outputs["grads"]
    assert gp != gq and set(t.meta["grad_of"].values()) == {"p", "q"}
    res = Executor(t, "numpy", dtype="f64").run({})["grads"]
    assert all(np.allclose(r, 1 / 3) for r in res)


def test_errors():
    g = small_cnn()
    g.outputs.pop("loss")
    with pytest.raises(NetdslError, match="no loss"):
        autodiff(g)
    with pytest.raises(NetdslError, match="already has gradients"):
        autodiff(autodiff(small_cnn()))


# -- retains: what the backward nodes read of the forward pass ------------------------------
def retained_values(node: Node, g: Graph, tokens: tuple[str, ...]) -> set[str]:
    """The forward values that `retains` tokens name for `node`: "inputs" (all tensor
    arguments), "inputK", "output", "mask" (a lowered dropout's mask input), "params",
    or a parameter's own name ("weight")."""
    op = registry.get(node.op)
    k = op.n_tensor_inputs(len(node.inputs))
    tensors, rest = node.inputs[:k], node.inputs[k:]
    pnames = list(op.params([g[i].type for i in tensors], node.attrs))
    out: set[str] = set()
    for t in tokens:
        if t == "inputs":
            out.update(tensors)
        elif t.startswith("input"):
            out.add(tensors[int(t[5:])])
        elif t == "output":
            out.add(node.name)
        elif t == "params":
            out.update(rest)
        elif t in pnames:
            out.add(rest[pnames.index(t)])
        elif t != "mask":
            raise AssertionError(f"{node.op}: unknown retains token {t!r}")
    return out


# one sample of every differentiable op (shapes, attrs, integer args)
SAMPLES = {
    "conv2d": ([(2, 2, 5, 5)], {"out_channels": 2, "kernel": 3}, {}),
    "maxpool": ([(1, 2, 4, 4)], {"kernel": 2}, {}),
    "avgpool": ([(1, 2, 4, 4)], {"kernel": 2}, {}),
    "global_avgpool": ([(1, 2, 4, 4)], {}, {}),
    "relu": ([(3, 4)], {}, {}), "leaky_relu": ([(3, 4)], {}, {}), "gelu": ([(3, 4)], {}, {}),
    "sigmoid": ([(3, 4)], {}, {}), "tanh": ([(3, 4)], {}, {}),
    "add": ([(3, 4), (4,)], {}, {}), "sub": ([(3, 4), (4,)], {}, {}),
    "mul": ([(3, 4), (4,)], {}, {}), "scale": ([(3, 4)], {"factor": 2.0}, {}),
    "mean": ([(3, 4)], {"axis": 1}, {}), "softmax": ([(3, 4)], {}, {}),
    "linear": ([(3, 4)], {"out_features": 2}, {}), "matmul": ([(3, 4), (4, 2)], {}, {}),
    "embedding": ([(3,)], {"num": 5, "dim": 2}, {0: 5}),
    "softmax_cross_entropy": ([(3, 4), (3,)], {}, {1: 4}),
    "mse": ([(3, 4), (3, 4)], {}, {}),
    "batchnorm": ([(3, 2, 2)], {}, {}), "layernorm": ([(3, 4)], {}, {}),
    "batchnorm_relu": ([(3, 2, 2)], {}, {}),
    "flatten": ([(2, 3, 2)], {}, {}), "reshape": ([(2, 6)], {"shape": (3, 4)}, {}),
    "permute": ([(2, 3)], {"dims": (1, 0)}, {}), "transpose": ([(2, 3)], {}, {}),
    "concat": ([(2, 3), (2, 1)], {}, {}), "slice": ([(2, 3)], {"axis": 1, "start": 1,
                                                                  "stop": 3}, {}),
    "dropout": ([(3, 4)], {"p": 0.5}, {}),
    "to_host": ([(3, 4)], {}, {}), "to_device": ([(3, 4)], {}, {}),
}
SAMPLES.update({k: v for k, v in samples().items() if k not in SAMPLES})


@pytest.mark.parametrize("op", sorted(SAMPLES))
def test_retains_matches_what_backward_reads(op):
    shapes, attrs, ints = SAMPLES[op]
    t = autodiff(op_graph(op, shapes, attrs, ints))
    fwd = t["out"]
    forward_values = set(fwd.inputs) | {"out"}
    read = {i for n in t.nodes if n.meta.get("forward") == "out" for i in n.inputs
            if i in forward_values}
    want = retained_values(fwd, t, registry.get(op).retains)
    if op == "dropout":  # lowered to mul(x, mask): backward reads exactly the mask
        want = {"out.mask"}
    assert read == want, f"{op}: backward reads {sorted(read)}, retains says {sorted(want)}"


def test_every_differentiable_op_has_a_retains_sample():
    # the ops whose rules span a split's copies: tests/test_syncbn.py checks
    # sync_batchnorm's retains on a split graph
    ops = {n for n, o in registry.load_all().items()
           if o.differentiable and n not in ("input", "param", "buffer") + SPLIT_ONLY}
    assert ops == set(SAMPLES)


def test_builder_names_and_meta():
    g = small_cnn()
    b = GradBuilder(g)
    b.fwd = g["fc"]
    name = b.emit("sum_except", ["fc"], {"axis": -1}, tag="bias")
    name2 = b.emit("sum_except", ["fc"], {"axis": -1}, tag="bias")
    assert (name, name2) == ("fc.grad.bias", "fc.grad.bias_1")
    assert g[name].meta == {"phase": "backward", "forward": "fc"}
    assert g[name].type == TensorType((3,))


GOLDEN = """\
graph reg(batch=2) {
  %x = input() {shape=(2, 3), dtype=f32} : f32[2, 3]
  %t = input() {shape=(2, 1), dtype=f32} : f32[2, 1]
  %fc.weight = param() {shape=(1, 3), init=kaiming_uniform, fan_in=3} : f32[1, 3]
  %fc.bias = param() {shape=(1,), init=uniform_fan_in, fan_in=3} : f32[1]
  %fc = linear(%x, %fc.weight, %fc.bias) {out_features=1, bias=true} : f32[2, 1]
  %loss = mse(%fc, %t) {reduction=mean} : f32[]
  %loss.grad.seed = fill() {shape=(), value=1.0, dtype=f32} : f32[]
  %loss.grad.pred = mse_grad(%loss.grad.seed, %fc, %t) {reduction=mean} : f32[2, 1]
  %fc.grad.weight = linear_grad_weight(%loss.grad.pred, %x) : f32[1, 3]
  %fc.grad.bias = sum_except(%loss.grad.pred) {axis=-1} : f32[1]
  %lr = input() {shape=(), dtype=f32, default=0.1, role=lr} : f32[]
  %fc.weight.momentum_buffer = buffer() {shape=(1, 3), init=zeros, fan_in=1, dtype=f32, \
role=optimizer_state} : f32[1, 3]
  %fc.weight.update = sgd_update(%fc.weight, %fc.grad.weight, %lr, \
%fc.weight.momentum_buffer) {momentum=0.9, nesterov=false, weight_decay=0.0} : f32[1, 3]
  %fc.bias.momentum_buffer = buffer() {shape=(1,), init=zeros, fan_in=1, dtype=f32, \
role=optimizer_state} : f32[1]
  %fc.bias.update = sgd_update(%fc.bias, %fc.grad.bias, %lr, %fc.bias.momentum_buffer) \
{momentum=0.9, nesterov=false, weight_decay=0.0} : f32[1]
  output %fc
  loss %loss
  grads %fc.grad.weight, %fc.grad.bias
  updates %fc.weight.update, %fc.bias.update
}
"""


def test_golden_training_step_graph():
    """The whole training step of a linear regression, as text: no gradient for the input
    x or the target t, the bias gradient is a sum, one momentum buffer per parameter."""
    from test_executor import regression

    from netdsl.passes.optimizer import add_optimizer
    t = add_optimizer(autodiff(regression(2)), "sgd", lr=0.1, momentum=0.9)
    assert t.to_text() == GOLDEN


def test_training_graph_survives_json_and_bind():
    t = autodiff(small_cnn())
    back = Graph.from_json(t.to_json()).verify()
    assert back.to_text() == t.to_text() and back.meta["grad_of"] == t.meta["grad_of"]
    # the symbolic batch: backward shapes (attrs["shape"]) follow Graph.bind
    g = small_cnn()
    t2 = autodiff(small_cnn("N"))
    assert any("N" in map(str, n.attrs.get("shape", ())) for n in t2.nodes
               if n.meta.get("phase") == "backward")
    bound = t2.bind(4).verify()
    assert float(Executor(bound, "numpy", dtype="f64", seed=2).run(feeds_for(g))["loss"][0]) \
        == float(Executor(t, "numpy", dtype="f64", seed=2).run(feeds_for(g))["loss"][0])


def test_clip_grad_norm_without_parameters_is_a_step_with_nothing_to_update():
    """(An IndexError before: the clipping looked at the first gradient's dtype.)"""
    import netdsl
    from netdsl.passes.optimizer import add_optimizer
    net = netdsl.loads("network f { input x: f32[N, 4]\n input y: f32[N, 4]\n output x\n"
                       " loss mse(x, y) }", "f.net")
    t = add_optimizer(autodiff(net.graph.bind(2)), "sgd", clip_grad_norm=1.0).verify()
    assert t.outputs["updates"] == [] and not t.by_op("grad_sumsq")


def test_grad_sumsq_reads_strided_gradients_in_place():
    """The clipping norm's sum of squares over contiguous and strided gradients (a
    transposed view) is NumPy's, and a strided one is not copied to be flattened."""
    import tracemalloc
    kernel = registry.get("grad_sumsq").kernel
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((300, 200)), rng.standard_normal((400, 300)).T
    assert not b.flags.c_contiguous
    tracemalloc.start()
    got = kernel(np, [a, b], {}, None)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert float(got) == pytest.approx(float((a * a).sum() + (b * b).sum()), rel=1e-12)
    assert peak < b.nbytes // 4  # (flattening the view copied all 960 kB of it)
