"""The IR foundations rewrites rely on: effects (in-place writes, views, keyed random
draws) checked by verify(), the rewrite toolkit, a name index that cannot go stale, and
the pass pipeline."""
from __future__ import annotations

import numpy as np
import pytest

from netdsl.errors import NetdslError, ShapeError
from netdsl.ir import registry
from netdsl.ir.build import add_op
from netdsl.ir.graph import Graph, Node
from netdsl.ir.rewrite import clone, make_node, move_after, replace_uses, splice
from netdsl.ir.types import TensorType
from netdsl.ir.verify import IRError
from netdsl.passes.pipeline import PASSES, run_pipeline
from netdsl.runtime.executor import Executor


def inp(g, name, shape, dtype="f32"):
    g.add(Node(name, "input", (), TensorType(shape, dtype), {"shape": shape, "dtype": dtype}))


def bn_graph() -> Graph:
    g = Graph("bn", batch=4)
    inp(g, "x", (4, 3, 5, 5))
    add_op(g, "bn", "batchnorm", ["x"], {})
    add_op(g, "drop", "dropout", ["bn"], {"p": 0.5})
    g.outputs = {"output": ["drop"]}
    return g.verify()


# -- effects ------------------------------------------------------------------------------
def test_effects_are_declared_in_the_registry():
    ops = registry.load_all()
    g = bn_graph()
    assert ops["batchnorm"].written_inputs(g["bn"]) == (3, 4)  # running mean and var
    replay = clone(g["bn"], "bn.replay", attrs={"replay": True})
    assert ops["batchnorm"].written_inputs(replay) == ()
    assert ops["dropout"].random and ops["dropout_mask"].random
    assert ops["reshape"].view_of == 0 and ops["transpose"].view_of == 0
    assert ops["sgd_update"].writes == (0, 3) and not ops["sgd_update"].adds_storage(
        Node("u", "sgd_update", ("p", "g", "lr"), TensorType((1,))))
    assert ops["relu"].pure and not ops["batchnorm"].pure


def test_verify_rejects_a_read_after_an_in_place_write():
    g = bn_graph()
    # a node reading the running mean after batchnorm overwrote it
    g.add(make_node(g, "late", "relu", ["bn.running_mean"]))
    with pytest.raises(IRError, match="after %bn overwrote it"):
        g.verify()


def test_verify_follows_views_to_the_storage_they_alias():
    g = Graph("v", batch=2)
    inp(g, "x", (2, 3))
    g.add(Node("p", "param", (), TensorType((2, 3)), {"shape": (2, 3), "init": "zeros"}))
    g.add(Node("lr", "input", (), TensorType(()), {"shape": (), "default": 0.1}))
    g.add(make_node(g, "pv", "reshape", ["p"], {"shape": (3, 2)}))
    g.add(make_node(g, "gp", "relu", ["x"]))
    g.add(make_node(g, "upd", "sgd_update", ["p", "gp", "lr"]))
    g.outputs = {"updates": ["upd"]}
    g.verify()  # the view is read before the update: fine
    g.add(make_node(g, "late", "relu", ["pv"]))
    with pytest.raises(IRError, match="reads %pv after %upd"):
        g.verify()


@pytest.mark.parametrize("edit, message", [
    (lambda g: g.nodes.append(g["bn"].copy()), "duplicate node name %bn"),
    (lambda g: g.nodes.append(g["bn"].copy(name="b2", op="nope")), "b2: unknown op 'nope'"),
    (lambda g: g.nodes.insert(1, g["drop"].copy(name="early")),
     "%early reads %bn, which is not defined before it"),
    (lambda g: g.nodes.append(g["x"].copy(name="x2", inputs=("x",))),
     "%x2: a input node takes no inputs"),
    (lambda g: g.nodes.append(g["drop"].copy(name="d2", type=TensorType((4, 3)))),
     r"%d2: recorded type f32\[4, 3\] but dropout gives f32\[4, 3, 5, 5\]"),
    (lambda g: g.nodes.append(g["drop"].copy(name="d3", attrs={"p": "half"})),
     "%d3: shape rule of dropout fails"),
    (lambda g: g.outputs.update(output=["gone"]), "output output names %gone"),
    (lambda g: g.outputs.update(loss=["drop"]), "loss %drop is not a scalar"),
])
def test_verify_names_each_broken_invariant(edit, message):
    g = bn_graph()
    edit(g)
    with pytest.raises(IRError, match=message):
        g.verify()


def test_graph_building_leaves_no_reference_cycles():
    """The passes, splits and memory plans run with the cyclic collector paused
    (netdsl.ir.bulk), so what they drop must be freed by reference counting alone: a cycle
    through a graph (its node list, autodiff's builder, move_after's recursive closure)
    would keep every discarded step alive."""
    import gc

    from netdsl.api import load, plan, split
    from netdsl.step.graphs import training_graph
    net = load("examples/resnet20-cifar.net")
    others = [net, load("examples/transformer-tiny.net")]
    gc.collect()  # (the front end's parse trees hold cycles: loaded before)
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for strategy in ("data", "pipeline", "tensor", "spatial"):
            split(net, 2, strategy, batch=4)
        plan(net, "30MB", batch=4)  # recomputation rewrites (move_after)
        for other in others:  # the trainer's passes, fused
            training_graph(other.lower(4), other.train)
        gc.collect()
        kinds = sorted({type(o).__name__ for o in gc.garbage})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert kinds == []


def test_replayed_batchnorm_and_dropout_repeat_the_original_exactly():
    g = bn_graph()
    # a recompute-style copy of both nodes: the batchnorm replay must not touch the
    # running statistics, the dropout copy must draw the same mask
    g.add(clone(g["bn"], "bn.re", inputs=g["bn"].inputs[:3], attrs={"replay": True}))
    g.add(clone(g["drop"], "drop.re", inputs=["bn.re"]))
    g.outputs = {"output": ["drop", "drop.re"]}
    g.verify()
    ex = Executor(g, "numpy", dtype="f64", seed=3)
    x = np.random.default_rng(0).standard_normal((4, 3, 5, 5))
    a, b = ex.run({"x": x}, training=True)["output"]
    np.testing.assert_array_equal(a, b)
    assert (a == 0).any()  # dropout really dropped
    # one update of the running mean (momentum 0.1 from zeros), not two
    np.testing.assert_allclose(ex.state["bn.running_mean"], 0.1 * x.mean(axis=(0, 2, 3)))
    # the next step draws a different mask; the same step number draws the same one
    c = ex.run({"x": x}, training=True)["output"][0]
    assert not np.array_equal(a != 0, c != 0)
    d = ex.run({"x": x}, training=True, step=0)["output"][0]
    np.testing.assert_array_equal(a != 0, d != 0)


# -- the toolkit ---------------------------------------------------------------------------
def test_index_follows_every_edit_of_the_node_list():
    g = bn_graph()
    assert "bn" in g
    other = clone(g["bn"], "bn2")
    g.nodes[g.nodes.index(g["bn"])] = other
    assert "bn2" in g and "bn" not in g
    g.nodes = [n for n in g.nodes if n.name != "drop"]
    assert "drop" not in g
    g.nodes.insert(0, Node("z", "input", (), TensorType((1,)), {"shape": (1,)}))
    assert g["z"].op == "input"


def test_make_node_inherits_position_and_checks_shapes():
    g = bn_graph()
    n = make_node(g, "r", "relu", ["bn"], like=g["bn"], meta={"phase": "x"})
    assert n.type == g["bn"].type and n.scope == g["bn"].scope and n.meta == {"phase": "x"}
    with pytest.raises(ShapeError, match="4-d"):
        make_node(g, "c", "conv2d", ["bn.running_mean"], {"out_channels": 2, "kernel": 1})


def test_replace_uses_splice_and_move_after():
    g = bn_graph()
    r = make_node(g, "bn.copy", "scale", ["bn"], {"factor": 1.0})
    splice(g, after={"bn": [r]})
    assert replace_uses(g, "bn", "bn.copy") == 1
    assert g["drop"].inputs == ("bn.copy",)
    g.verify()
    order = [n.name for n in g.nodes]
    assert order.index("bn.copy") == order.index("bn") + 1
    move_after(g, {"drop": "bn.copy"})
    g.verify()
    with pytest.raises(KeyError):
        splice(g, before={"nope": [r]})


def test_move_after_follows_a_chain_longer_than_the_recursion_limit():
    import sys
    g = Graph("chain", batch=2)
    inp(g, "x", (2, 3))
    k = sys.getrecursionlimit() + 100
    for i in range(k):
        add_op(g, f"r{i}", "relu", ["x"], {})
    g.outputs = {"output": [f"r{i}" for i in range(k)]}
    # every node after the next one: the order reverses, each anchor moved itself
    move_after(g, {f"r{i}": f"r{i + 1}" for i in range(k - 1)})
    assert [n.name for n in g.nodes] == ["x"] + [f"r{i}" for i in reversed(range(k))]
    g.verify()


# -- the pipeline --------------------------------------------------------------------------
def test_pipeline_runs_registered_passes_verifies_and_dumps(tmp_path):
    g = Graph("p", batch=2)
    inp(g, "x", (2, 4))
    inp(g, "y", (2,), "i64")
    add_op(g, "fc", "linear", ["x"], {"out_features": 3})
    add_op(g, "loss", "softmax_cross_entropy", ["fc", "y"], {})
    g.outputs = {"output": ["fc"], "loss": ["loss"]}
    out = run_pipeline(g, ["autodiff", ("optimizer", {"kind": "sgd", "lr": 0.5})],
                       dump=tmp_path)
    assert {"autodiff", "optimizer"} <= set(PASSES)
    assert "updates" in out.outputs
    dumps = sorted(p.name for p in tmp_path.iterdir())
    assert dumps == ["00-input.ir", "01-autodiff.ir", "02-optimizer.ir"]
    assert "sgd_update" in (tmp_path / "02-optimizer.ir").read_text()
    with pytest.raises(NetdslError, match="unknown pass `nope`"):
        run_pipeline(g, ["nope"])
