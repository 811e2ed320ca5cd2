"""Memory strategies as graph rewrites: every strategy gives the unplanned step's loss,
gradients and updated parameters bit for bit, BatchNorm statistics are updated once,
dropout masks are redrawn identically, and the memory plan of the result is what the
executor counts."""
from __future__ import annotations

import numpy as np
import pytest
from _examples import example_feeds, load

from netdsl.errors import NetdslError
from netdsl.memory.plan import make_plan
from netdsl.memory.strategies import apply_decisions, phase, replayable
from netdsl.passes.autodiff import autodiff
from netdsl.passes.optimizer import add_optimizer
from netdsl.runtime.executor import Executor

ROLES = ("loss", "output", "updates")
WITH_GRADS = ("loss", "output", "grads", "updates")


def step_graph(example, batch, kind="sgd"):
    opts = {"lr": 0.05, "momentum": 0.9} if kind == "sgd" else {"lr": 1e-3}
    return add_optimizer(autodiff(load(f"{example}.net").lower(batch)), kind, **opts)


def forward_values(g):
    return [n for n in g.nodes if phase(n) == "forward" and not n.is_source]


def decide(g, mode):
    fwd = forward_values(g)
    if mode == "recompute":
        return {n.name: "recompute" for n in fwd if replayable(n)}
    if mode == "offload":
        return {n.name: "offload" for n in fwd}
    if mode == "layer-adaptive":  # Layup's rule of thumb
        heavy = ("conv2d", "linear", "matmul")
        return {n.name: "offload" if n.op in heavy else "recompute"
                for n in fwd if replayable(n)}
    if mode == "alternate":  # every other value, a mix of all three
        return {n.name: ("keep", "recompute", "offload")[k % 3]
                for k, n in enumerate(fwd) if replayable(n)}
    return {}


def run_steps(g, feeds, steps=2, roles=WITH_GRADS):
    ex = Executor(g, "numpy", dtype="f64", seed=7)
    out = []
    for _ in range(steps):
        r = ex.run(feeds, roles=roles)
        out.append([np.array(v) for k in ("loss", "grads") if k in r for v in r[k]])
    return out, ex.state_dict(), ex


@pytest.mark.parametrize("example,batch", [("resnet20-cifar", 2), ("densenet121", 1),
                                           ("transformer-tiny", 2), ("digits-mlp", 4)])
@pytest.mark.parametrize("mode", ["recompute", "offload", "layer-adaptive", "alternate",
                                  "eager-only"])
def test_every_strategy_matches_the_unplanned_step_bit_for_bit(example, batch, mode):
    g = step_graph(example, batch)
    h = apply_decisions(g, decide(g, mode))
    feeds = example_feeds(g)
    ref, ref_state, _ = run_steps(g, feeds)
    got, got_state, ex = run_steps(h, feeds)
    for a_step, b_step in zip(ref, got, strict=True):
        for a, b in zip(a_step, b_step, strict=True):
            np.testing.assert_array_equal(a, b)
    assert ref_state.keys() == got_state.keys()
    for k in ref_state:  # parameters, momentum, BN running statistics
        np.testing.assert_array_equal(ref_state[k], got_state[k], err_msg=k)
    # the executor's count is the plan's prediction for the rewritten step
    ex.reset_peak()
    ex.run(feeds, roles=ROLES)
    assert ex.peak_bytes == make_plan(h, ROLES, "f64").peak_bytes


DROPOUT_NET = """
import mlp
network drop {
    input x: f32[N, 12]
    input y: i64[N]
    logits = mlp.mlp(x, widths=(16, 16), out=3, p=0.5)
    output logits
    loss softmax_cross_entropy(logits, y)
}
"""


def test_adam_and_dropout_survive_recompute():
    import netdsl
    net = netdsl.loads(DROPOUT_NET, file="drop.net")
    g = add_optimizer(autodiff(net.lower(4)), "adam", lr=1e-2)
    masks = [n.name for n in g.nodes if n.op == "dropout_mask"]
    assert len(masks) == 2
    h = apply_decisions(g, decide(g, "recompute"))
    assert sum(n.op == "dropout_mask" for n in h.nodes) == 4  # each mask is redrawn
    feeds = example_feeds(g)
    ref, ref_state, _ = run_steps(g, feeds, roles=ROLES)
    got, got_state, _ = run_steps(h, feeds, roles=ROLES)
    assert [float(s[0]) for s in ref] == [float(s[0]) for s in got]
    for k in ref_state:
        np.testing.assert_array_equal(ref_state[k], got_state[k], err_msg=k)


def test_recompute_replays_batchnorm_without_touching_its_statistics():
    g = step_graph("resnet20-cifar", 2)
    h = apply_decisions(g, decide(g, "recompute"))
    replays = [n for n in h.nodes if n.op == "batchnorm" and n.attrs.get("replay")]
    assert replays and all(len(n.inputs) == 3 for n in replays)  # x, weight, bias only
    # every backward reader of a recomputed value reads the clone
    for n in h.nodes:
        if phase(n) == "backward":
            assert not any(h[i].op == "relu" and phase(h[i]) == "forward" for i in n.inputs)


def test_offload_moves_bytes_to_the_host_pool_and_back():
    g = step_graph("resnet20-cifar", 4)
    h = apply_decisions(g, decide(g, "offload"))
    plan, base = make_plan(h, ROLES), make_plan(g, ROLES)
    assert plan.host_peak_bytes > 0 and plan.peak_bytes < 0.7 * base.peak_bytes
    ex = Executor(h, "numpy")
    ex.run(example_feeds(g), roles=ROLES)
    assert ex.host_peak_bytes == plan.host_peak_bytes
    # a prefetch runs before the backward node that needs it, after the one before that
    order = [n.name for n in h.nodes]
    for n in h.nodes:
        if n.op == "to_device":
            first_use = min(order.index(r) for r in order if n.name in h[r].inputs)
            assert order.index(n.name) < first_use


def test_eager_updates_free_each_gradient_at_once():
    g = step_graph("resnet20-cifar", 2)
    h = apply_decisions(g, {})
    order = [n.name for n in h.nodes]
    grad_of = {u: h[u].inputs[1] for u in h.outputs["updates"]}
    for u, gp in grad_of.items():  # each update comes right after its gradient is ready
        assert order.index(u) > order.index(gp)
    first_update = min(order.index(u) for u in grad_of)
    last_backward = max(k for k, n in enumerate(h.nodes) if phase(n) == "backward")
    assert first_update < last_backward  # updates interleave with the backward pass
    assert make_plan(h, ROLES).peak_bytes < make_plan(g, ROLES).peak_bytes


def test_bad_decisions_are_clear_errors():
    g = step_graph("digits-mlp", 2)
    fwd = forward_values(g)[0].name
    with pytest.raises(NetdslError, match="unknown memory strategy `swap`"):
        apply_decisions(g, {fwd: "swap"})
    with pytest.raises(NetdslError, match="not in graph"):
        apply_decisions(g, {"nope": "offload"})
    upd = g.outputs["updates"][0]
    with pytest.raises(NetdslError, match="not a forward value"):
        apply_decisions(g, {upd: "recompute"})


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_optimizer_state_streamed_from_the_host_changes_no_number(kind):
    """Momentum / Adam moments kept in the host pool, copied in before each update and
    written back after it: three steps equal the unplanned ones bit for bit, and the
    device holds that state only while its update runs."""
    from netdsl.memory.strategies import is_optimizer_state
    g = step_graph("resnet20-cifar", 2, kind=kind)
    dec = {n.name: "offload" for n in g.nodes if is_optimizer_state(n) and n.type.shape}
    assert dec
    h = apply_decisions(g, {**decide(g, "recompute"), **dec})
    feeds = example_feeds(g)
    ref, ref_state, _ = run_steps(g, feeds, steps=3, roles=ROLES)
    got, got_state, ex = run_steps(h, feeds, steps=3, roles=ROLES)
    assert [float(s[0]) for s in ref] == [float(s[0]) for s in got]
    for k in ref_state:
        np.testing.assert_array_equal(ref_state[k], got_state[k], err_msg=k)
    plan, base = make_plan(h, ROLES, "f64"), make_plan(g, ROLES, "f64")
    state_bytes = sum(g[k].type.numel() * 8 for k in dec)
    assert plan.state_bytes == base.state_bytes - state_bytes
    assert plan.host_peak_bytes >= state_bytes and ex.host_peak_bytes == plan.host_peak_bytes
    # each prefetch runs before its update, each write-back right after it
    order = [n.name for n in h.nodes]
    for n in h.nodes:
        if n.op == "to_host_into":
            upd = n.inputs[2]
            between = order[order.index(upd) + 1:order.index(n.name)]
            assert all(h[b].op == "to_host_into" for b in between)  # Adam writes back two
            assert order.index(n.inputs[1]) < order.index(upd)


POINTWISE = """
network pointwise {
    input x: f32[N, 8, 6, 6]
    input y: i64[N]
    h = relu(batchnorm(conv2d(x, 16, kernel=1, bias=false)))
    h = conv2d(h, 8, kernel=1) + x
    h = conv2d(relu(batchnorm(h, affine=false)), 4, kernel=1, padding=(0, 0, 1, 1))
    logits = linear(flatten(h), 3)
    output logits
    loss softmax_cross_entropy(logits, y)
}
"""


@pytest.mark.parametrize("example,batch", [("resnet20-cifar", 2), ("pointwise", 3)])
def test_arena_step_matches_the_plain_step_bit_for_bit(example, batch):
    """Kernels that write into their planned slot (1x1 convolutions and their input
    gradients, batchnorm and its input gradient) give what they return without a slot."""
    if example == "pointwise":
        import netdsl
        g = add_optimizer(autodiff(netdsl.loads(POINTWISE).lower(batch)), "sgd", lr=0.05,
                          momentum=0.9)
    else:
        g = step_graph(example, batch)
    feeds = example_feeds(g)
    plain = run_steps(g, feeds)
    ex = Executor(g, "numpy", dtype="f64", seed=7, arena=True)
    arena = []
    for _ in range(2):
        r = ex.run(feeds, roles=WITH_GRADS)
        arena.append([np.array(v) for k in ("loss", "grads") for v in r[k]])
    for a, b in zip(plain[0], arena):
        assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    for k, v in plain[1].items():
        assert np.array_equal(v, ex.state_dict()[k]), k
