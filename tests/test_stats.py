"""netdsl.ir.stats and netdsl.ir.dot on hand-built graphs, with numbers counted by hand."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from _toy_graphs import toy

from netdsl.ir.build import add_op
from netdsl.ir.dot import to_dot
from netdsl.ir.graph import Graph, Node
from netdsl.ir.stats import (
    GroupItem,
    counts,
    fmt_si,
    group_tree,
    split_repeat,
    summarize,
)
from netdsl.ir.types import TensorType


def test_totals_counted_by_hand():
    s = summarize(toy(5).bind(2))
    # stem conv 3x3 3->4 with bias: 4*3*3*3 + 4 = 112; BN affine 4+4 = 8 (its running
    # stats are buffers); 5 x conv1x1 4->4 without bias: 5*16; linear 256->10: 2570
    assert s.params == 112 + 8 + 5 * 16 + 2570 == 2770
    assert s.buffers == 8
    assert s.param_bytes == 4 * 2770
    # FLOPs = 2 x MACs. output [2,4,8,8] = 512 elements
    stem_conv = 2 * 512 * 3 * 3 * 3
    bn = 8 * 512
    blk = 2 * 512 * 4 + 512  # conv1x1 + relu
    fc = 2 * 2 * 10 * 256
    loss = 6 * 2 * 10
    assert s.flops_forward == stem_conv + bn + 5 * blk + fc + loss == 65144
    # every op output in float32 bytes; inputs and params are not activations
    assert s.activation_bytes == 4 * (512 * 2 + 512 * 10 + 512 + 20 + 1)
    assert s.nodes == 2 + 10 + 3 and s.convs == 6 and s.batch == 2
    # the 3x3 conv's scratch with the batch folded (3 input channels, 8x8 output): the
    # padded input, the [C*kh*kw, N*Ho*Wo] columns and the [O, N*Ho*Wo] GEMM result,
    # in float32
    assert s.workspace_peak == 4 * (2 * 3 * 10 * 10 + 3 * 9 * 2 * 8 * 8 + 4 * 2 * 8 * 8)
    n = s.per_node["stem.bn"]
    assert (n.params, n.buffers, n.flops, n.out_bytes) == (8, 8, bn, 2048)


@pytest.mark.parametrize("name", ["resnet50.net", "densenet121.net", "gpt-tiny.net",
                                  "unet-small.net", "digits-cnn.net"])
def test_counts_of_check_agree_with_summarize(name):
    # `netdsl check` prints these from the symbolic graph, without binding it
    from _examples import load
    g = load(name).graph
    s = summarize(g.bind(1))
    c = counts(g)
    assert (c.params, c.nodes, c.convs) == (s.params, s.nodes, s.convs)
    assert c.params > 0 and c.nodes > 0


def test_json_keys_and_batch_scaling():
    s1, s4 = summarize(toy().bind(1)), summarize(toy().bind(4))
    j = json.loads(json.dumps(s4.to_json()))
    for k in ("network", "params", "flops_forward", "activation_bytes", "nodes", "convs",
              "batch", "rows"):
        assert k in j
    assert j["network"] == "toy" and j["batch"] == 4
    assert s4.params == s1.params
    assert s4.flops_forward == 4 * s1.flops_forward
    assert s4.activation_bytes == 4 * s1.activation_bytes - 3 * 4  # the scalar loss


def test_symbolic_graph_is_refused():
    with pytest.raises(ValueError, match="bind"):
        summarize(toy())


def test_shared_param_counted_once():
    g = Graph("shared")
    g.add(Node("x", "input", (), TensorType((2, 3)), {"shape": (2, 3)}))
    g.add(Node("w", "param", (), TensorType((3, 3)), {"shape": (3, 3)}))
    g.add(Node("a", "matmul", ("x", "w"), TensorType((2, 3))))
    g.add(Node("b", "matmul", ("a", "w"), TensorType((2, 3))))
    g.batch = 2
    s = summarize(g)
    assert s.params == 9
    assert [s.per_node[n].params for n in ("a", "b")] == [9, 0]
    assert s.flops_forward == 2 * (2 * 6 * 3)


def test_split_repeat():
    assert split_repeat("bottleneck[12]") == ("bottleneck", 12)
    assert split_repeat("stem") == ("stem", None)
    assert split_repeat("a[b]") == ("a[b]", None)


def test_repeats_fold_into_one_row():
    s = summarize(toy(5).bind(2))
    rows = s.rows(depth=2)
    labels = [(r.level, r.label, r.count) for r in rows]
    assert labels == [(0, "stem", 1), (1, "stem.conv", 1), (1, "stem.bn", 1),
                      (0, "stage", 1), (1, "blk[0..4] x5", 5),
                      (0, "flat", 1), (0, "fc", 1), (0, "loss", 1)]
    folded = rows[4]
    assert folded.params == 5 * 16 and folded.nodes == 10
    assert folded.flops == 5 * (2 * 512 * 4 + 512)
    assert str(folded.type) == "f32[2, 4, 8, 8]"
    # one level deeper: the ops of one copy, with totals over the 5 copies
    deeper = [r for r in s.rows(depth=3) if r.level == 2]
    assert [(r.op, r.count, r.params) for r in deeper] == [("conv2d", 5, 80), ("relu", 5, 0)]
    # depth 1: only top-level items; their numbers add up to the totals
    top = s.rows(depth=1)
    assert [r.label for r in top] == ["stem", "stage", "flat", "fc", "loss"]
    assert sum(r.params for r in top) == s.params
    assert sum(r.flops for r in top) == s.flops_forward
    assert sum(r.out_bytes for r in top) == s.activation_bytes
    assert s.rows(depth=0) == []


def test_different_copies_do_not_fold():
    """A first copy with a projection (different structure) stays a row of its own; copies
    not numbered as consecutive repeats never fold."""
    g = toy(4)
    # give copy 0 an extra op: now blk[0] differs from blk[1..3]
    g2 = Graph("toy2", batch=g.batch)
    for n in g.nodes:
        g2.add(n.copy())
        if n.name == "stage.blk[0].relu":
            add_op(g2, "stage.blk[0].extra", "relu", ["stage.blk[0].relu"], {},
                   scope=n.scope)
    g2["stage.blk[1].conv"].inputs = ("stage.blk[0].extra",) + g2["stage.blk[1].conv"].inputs[1:]
    g2.outputs = g.outputs
    g2.verify()
    labels = [r.label for r in summarize(g2.bind(1)).rows(2) if r.level == 1]
    assert labels == ["stem.conv", "stem.bn", "blk[0]", "blk[1..3] x3"]

    g3 = Graph("named")
    g3.add(Node("x", "input", (), TensorType((1, 4)), {"shape": (1, 4)}))
    h = "x"
    for name in ("a[0]", "a[2]", "b[3]", "b[4]", "c", "c[1]", "c[2]", "d", "d"):
        # a gap, a different base name; a bare first name is index 0; `d` then `d` again
        h = add_op(g3, g3.fresh_name(f"{name}.r"), "relu", [h], {}, scope=(name,)).name
    items = group_tree(g3.nodes)
    assert [(it.label if isinstance(it, GroupItem) else it) for it in items] == \
        ["a[0]", "a[2]", "b[3..4] x2", "c[0..2] x3", "d"]
    assert items[-1].count == 1 and len(items[-1].nodes) == 2  # one instance, two ops


def test_different_param_shapes_do_not_fold():
    g = Graph("widths")
    g.add(Node("x", "input", (), TensorType((1, 4)), {"shape": (1, 4)}))
    add_op(g, "l[0].fc", "linear", ["x"], {"out_features": 4}, scope=("l[0]",))
    # same op, attrs and output type as l[0], but its input (and so its weight) is wider
    add_op(g, "pad", "linear", ["l[0].fc"], {"out_features": 8})
    add_op(g, "l[1].fc", "linear", ["pad"], {"out_features": 4}, scope=("l[1]",))
    add_op(g, "l[2].fc", "linear", ["l[1].fc"], {"out_features": 4}, scope=("l[2]",))
    items = group_tree(g.nodes)
    assert [type(it).__name__ for it in items] == ["GroupItem", "OpItem", "GroupItem",
                                                   "GroupItem"]
    assert [it.label for it in items if isinstance(it, GroupItem)] == ["l[0]", "l[1]", "l[2]"]


def test_big_network_stays_short():
    s = summarize(toy(800).bind(1))
    rows = s.rows(depth=3)
    assert len(rows) <= 10
    assert any(r.label == "blk[0..799] x800" for r in rows)


def test_fmt():
    assert fmt_si(365_400_000_000) == "365.40 G"
    assert fmt_si(12) == "12"
    # bytes: netdsl.sizes.format_bytes, the one formatter (tests/test_sizes.py)


def test_dot_folds_repeats():
    text = to_dot(toy(6))
    assert text.startswith('digraph "toy" {') and text.rstrip().endswith("}")
    assert "blk[0..5] x6" in text and "stage.blk[3].conv" not in text
    assert "subgraph cluster_" in text
    assert '"stem.bn" -> "group' in text  # edges into the folded box
    unfolded = to_dot(toy(6), fold=False)
    assert "stage.blk[3].conv" in unfolded and "x6" not in unfolded
    shallow = to_dot(toy(6), fold=False, depth=1)
    assert "stage.blk[3].conv" not in shallow
    assert text.count("{") == text.count("}")


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")
def test_dot_is_valid_graphviz():
    for text in (to_dot(toy(3)), to_dot(toy(3), fold=False)):
        r = subprocess.run(["dot", "-Tsvg"], input=text, capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 0, r.stderr
