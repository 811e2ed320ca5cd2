"""The optimizer's updates as groups (netdsl.passes.optimizer.group_updates): which updates
it groups, and a grouped step computing exactly what the per-parameter updates compute,
with the fused kernels and the NumPy reference, in f32 and f64."""
from __future__ import annotations

import numpy as np
import pytest
from _examples import example_feeds, load

from netdsl.backends.numpy import NumpyBackend
from netdsl.errors import ShapeError
from netdsl.ir import registry
from netdsl.ir.rewrite import make_node, splice
from netdsl.memory.strategies import apply_decisions
from netdsl.passes.autodiff import autodiff
from netdsl.passes.optimizer import add_optimizer, group_updates
from netdsl.runtime.executor import Executor

OPTIMIZERS = [("sgd", {"lr": 0.05}), ("sgd", {"lr": 0.05, "momentum": 0.9, "nesterov": True,
                                              "weight_decay": 5e-4}),
              ("adam", {"lr": 1e-3, "weight_decay": 1e-4}), ("adamw", {"lr": 1e-3})]


def _step_graph(example: str, batch: int, kind: str, hyper: dict):
    return add_optimizer(autodiff(load(f"{example}.net").lower(batch)), kind,
                         **hyper)


def _state_after(g, dtype: str, fused: bool, steps: int = 3) -> dict:
    backend = NumpyBackend()
    if not fused:
        backend._fused = None
    ex = Executor(g, backend, dtype=dtype, seed=0)
    for s in range(steps):
        ex.run(example_feeds(g, s))
    return {k: np.array(v) for k, v in ex.state.items()}


@pytest.mark.parametrize("kind,hyper", OPTIMIZERS)
def test_one_group_per_kind_at_the_end_of_the_step(kind, hyper):
    g = _step_graph("digits-cnn", 4, kind, hyper)
    h = group_updates(g).verify()
    single = f"{'sgd' if kind == 'sgd' else 'adam'}_update"
    groups = [n for n in h.nodes if n.op == f"{single}_group"]
    assert len(groups) == 1 and not h.by_op(single)
    (grp,) = groups
    params = [n.name for n in g.by_op("param")]
    arity = grp.attrs["arity"]
    shared = len(grp.inputs) - arity * len(params)
    assert shared == (1 if kind == "sgd" else 2)
    assert list(grp.inputs[shared::arity]) == params  # each member's parameter, in order
    if kind == "sgd":  # parameter, gradient (and momentum buffer)
        assert arity == (3 if hyper.get("momentum") else 2)
    else:  # parameter, gradient, exp_avg, exp_avg_sq
        assert arity == 4
    assert grp.meta["members"] == len(params)
    assert h.outputs["updates"][-1] == grp.name
    assert h.outputs["grads"] == g.outputs["grads"]
    # every written input: each parameter and its state, never a gradient or the lr
    written = {grp.inputs[i] for i in registry.OPS[grp.op].written_inputs(grp)}
    states = {n.name for n in g.by_op("buffer") if n.attrs.get("role") == "optimizer_state"
              and n.type.shape != ()}
    assert written == set(params) | states
    assert group_updates(h).nodes == h.nodes  # nothing left to group
    # batchnorm's weight and bias gradients: rows 0 and 1 of its backward statistics,
    # read by the group itself rather than through their copies
    rows = grp.attrs["grad_rows"]
    grads = [grp.inputs[shared + k * arity + 1] for k in range(len(params))]
    for p, r, gr in zip(params, rows, grads, strict=True):
        if r >= 0:
            assert h[gr].op == "batchnorm_grad_stats" and r in (0, 1)
        else:
            assert h[gr].type == g[p].type and h[gr].op != "batchnorm_grad_affine"
    assert sorted(r for r in rows if r >= 0) == [0, 0, 1, 1]  # digits-cnn's two batchnorms


@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("kind,hyper", OPTIMIZERS)
def test_grouped_steps_are_the_single_updates_bit_for_bit(kind, hyper, fused, dtype):
    if fused:
        pytest.importorskip("numba")
    g = _step_graph("digits-cnn", 4, kind, hyper)
    before, after = _state_after(g, dtype, fused), _state_after(group_updates(g), dtype, fused)
    assert before.keys() == after.keys()
    for k in before:
        assert np.array_equal(before[k], after[k]), k
    g0 = _state_after(g, dtype, fused, steps=0)
    assert not np.array_equal(g0["linear.weight"], after["linear.weight"])


def test_only_updates_that_run_together_are_grouped():
    """A node between the updates (here a relu of a gradient) splits them into two groups,
    each at its last member's place; an update whose value is read stays alone; the step
    is unchanged."""
    g = _step_graph("digits-cnn", 4, "sgd", {"lr": 0.1, "momentum": 0.9})
    ups = g.by_op("sgd_update")
    mid = make_node(g, "between", "relu", [g.outputs["grads"][0]], like=ups[0])
    splice(g, before={ups[3].name: [mid]})
    g.outputs["output"] = [*g.outputs.get("output", []), mid.name]
    h = group_updates(g)
    first, second = h.by_op("sgd_update_group")
    names = [n.name for n in h.nodes]
    assert names.index(first.name) < names.index("between") < names.index(second.name)
    assert first.meta["members"] == 3 and second.meta["members"] == len(ups) - 3
    before, after = _state_after(g, "f64", True, 2), _state_after(h, "f64", True, 2)
    for k in before:
        assert np.array_equal(before[k], after[k]), k
    # the memory plan's eager updates follow each gradient: nothing runs together there
    eager = apply_decisions(_step_graph("resnet20-cifar", 2, "sgd", {"lr": 0.1}), {})
    assert [n.name for n in group_updates(eager).nodes] == [n.name for n in eager.nodes]
    # an update whose value a later node reads (a write-back) is not grouped
    g.outputs["output"].append(ups[5].name)
    assert group_updates(g).by_op("sgd_update") == [g[ups[5].name]]


def test_a_group_whose_gradient_rows_do_not_fit_is_a_shape_error():
    g = _step_graph("digits-cnn", 4, "sgd", {"lr": 0.1})
    u = next(n for n in g.by_op("sgd_update") if g[n.inputs[1]].op == "batchnorm_grad_affine")
    st = g[u.inputs[1]].inputs[0]
    ins = [g["lr"].name, u.inputs[0], st]
    make_node(g, "ok", "sgd_update_group", ins, {"arity": 2, "grad_rows": (1,)})
    with pytest.raises(ShapeError, match="has no row 4"):
        make_node(g, "bad", "sgd_update_group", ins, {"arity": 2, "grad_rows": (4,)})
    with pytest.raises(ShapeError, match="2 grad_rows for 1 members"):
        make_node(g, "bad", "sgd_update_group", ins, {"arity": 2, "grad_rows": (0, 1)})
    with pytest.raises(ShapeError, match="does not match"):  # the whole statistics
        make_node(g, "bad", "sgd_update_group", ins, {"arity": 2})


def test_a_group_with_inputs_that_do_not_split_into_members_is_a_shape_error():
    g = _step_graph("digits-cnn", 4, "sgd", {"lr": 0.1, "momentum": 0.9})
    u = g.by_op("sgd_update")
    ins = [g["lr"].name, *u[0].inputs[:2], u[0].inputs[3], *u[1].inputs[:2]]
    with pytest.raises(ShapeError, match="members of 3"):
        make_node(g, "bad", "sgd_update_group", ins, {"momentum": 0.9, "arity": 3})
    bad = [g["lr"].name, u[0].inputs[0], u[1].inputs[1], u[0].inputs[3]]
    assert g[u[0].inputs[0]].type != g[u[1].inputs[1]].type  # another parameter's gradient
    with pytest.raises(ShapeError, match="does not match"):
        make_node(g, "bad", "sgd_update_group", bad, {"momentum": 0.9, "arity": 3})


def test_the_trainer_groups_an_unplanned_step_only():
    from netdsl.runtime.options import RunOptions
    from netdsl.runtime.trainer import Trainer
    net = load("digits-cnn.net")
    plain = Trainer(net.graph, net.train, RunOptions(steps=1))
    assert plain.train_graph.by_op("adam_update_group")
    assert not plain.train_graph.by_op("adam_update")
    for split, members in (("data", [8, 8]), ("pipeline", [4, 4])):  # a group a device
        g = Trainer(net.graph, net.train, RunOptions(steps=1, devices=2, split=split)
                    ).train_graph
        groups = g.by_op("adam_update_group")
        assert sorted(n.device for n in groups) == [0, 1] and not g.by_op("adam_update")
        assert [n.meta["members"] for n in groups] == members
    planned = Trainer(net.graph, net.train, RunOptions(steps=1, mem="1GB"))
    assert planned.train_graph.by_op("adam_update")
    assert not planned.train_graph.by_op("adam_update_group")
