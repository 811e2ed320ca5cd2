"""Scalar constants and tensor operators in expressions, and the run-time index checks of
embedding and gather."""
from __future__ import annotations

import numpy as np
import pytest

import netdsl
from netdsl.errors import NetdslError
from netdsl.runtime.executor import Executor


def forward(src: str, feeds: dict, batch: int = 2):
    g = netdsl.loads(src).graph.bind(batch)
    return g, Executor(g, "numpy", dtype="f64").run(feeds, training=False)["output"]


def test_scalar_constants_compute_what_they_say():
    src = """network t {
  input x: f32[N, 4]
  a = x * 0.5 - 1
  b = 2 / (a ** 2 + 1)
  c = where(x > 0, b, 1 - x)
  d = maximum(c, x) - minimum(c, 0.25 * x)
  output a, b, c, d
}"""
    x = np.random.default_rng(0).standard_normal((2, 4))
    g, (a, b, c, d) = forward(src, {"x": x})
    np.testing.assert_allclose(a, x * 0.5 - 1)
    np.testing.assert_allclose(b, 2 / (a ** 2 + 1))
    np.testing.assert_allclose(c, np.where(x > 0, b, 1 - x))
    np.testing.assert_allclose(d, np.maximum(c, x) - np.minimum(c, 0.25 * x))
    fills = g.by_op("fill")
    assert fills and all(n.type.shape == () and n.attrs["dtype"] == "f32" for n in fills)


def test_integer_tensor_with_a_float_constant_is_an_error():
    src = """network t {
  input ids: i64[N, 3]
  k = ids + 1
  z = ids - 0.5
  output k
}"""
    with pytest.raises(NetdslError, match=r"cannot apply `-` to a tensor i64\[N, 3\].*cast"):
        netdsl.loads(src)


def test_integer_constant_keeps_an_integer_tensor_integer():
    src = "network t {\n  input ids: i64[N, 3]\n  k = ids + 1\n  m = ids == 2\n  output k, m\n}"
    g, (k, m) = forward(src, {"ids": np.array([[0, 1, 2], [2, 3, 4]])})
    assert k.dtype == np.int64 and (k == [[1, 2, 3], [3, 4, 5]]).all()
    assert m.dtype == bool and m.sum() == 2


EMB = """network t {
  input ids: i64[N, 3]
  e = embedding(ids, 5, 2)
  output e
}"""


@pytest.mark.parametrize("bad", [5, -1])
def test_embedding_rejects_out_of_range_ids_naming_the_node(bad):
    with pytest.raises(NetdslError) as info:
        forward(EMB, {"ids": np.array([[0, 1, 2], [3, bad, 4]])})
    msg = info.value.message
    assert "embedding %embedding: id" in msg and str(bad) in msg and "values are 0 to 4" in msg
    assert info.value.loc is not None and info.value.loc.line == 3


def test_gather_takes_negative_indices_and_rejects_out_of_range_ones():
    from gradcheck import op_graph
    g = op_graph("gather", [(2, 5), (3,)], {"axis": 1}, ints={1: 5})
    ex = Executor(g, "numpy", dtype="f64")
    x = ex.state["in0"]
    r = np.ones((2, 3))
    out = ex.run({"in1": np.array([-1, 0, 2]), "r": r}, training=False)["output"][0]
    np.testing.assert_array_equal(out, x[:, [4, 0, 2]])
    with pytest.raises(NetdslError, match=r"gather %out: index 5 is out of range; valid "
                                          r"values are -5 to 4"):
        ex.run({"in1": np.array([-1, 5, 2]), "r": r}, training=False)


def test_cross_entropy_rejects_out_of_range_labels_but_skips_ignored_ones():
    src = """network t {
  input x: f32[N, 3]
  input y: i64[N]
  loss softmax_cross_entropy(x, y, ignore_index=-1)
}"""
    g = netdsl.loads(src).graph.bind(3)
    ex = Executor(g, "numpy", dtype="f64")
    x = np.random.default_rng(0).standard_normal((3, 3))
    ok = ex.run({"x": x, "y": np.array([2, -1, 0])}, training=False)["loss"][0]
    lp = x - np.log(np.exp(x).sum(1, keepdims=True))
    assert np.isclose(ok, -(lp[0, 2] + lp[2, 0]) / 2)
    with pytest.raises(NetdslError, match=r"softmax_cross_entropy %softmax_cross_entropy: "
                                          r"label 3 is out of range for 3 classes"):
        ex.run({"x": x, "y": np.array([2, 3, 0])}, training=False)


def test_causal_mask_and_softmax_equal_the_fused_causal_attention():
    src = """network t {
  input q: f32[N, 5, 4]
  input k: f32[N, 5, 4]
  input v: f32[N, 5, 3]
  s = matmul(q, transpose(k)) * 0.5
  manual = matmul(softmax(causal_mask(s)), v)
  fused = scaled_dot_product_attention(q, k, v, causal=true)
  output manual, fused
}"""
    rng = np.random.default_rng(1)
    feeds = {n: rng.standard_normal((2, 5, 4 if n != "v" else 3)) for n in "qkv"}
    _, (manual, fused) = forward(src, feeds)
    np.testing.assert_allclose(manual, fused, rtol=1e-12)
    # query 0 sees only key 0
    np.testing.assert_allclose(fused[:, 0], feeds["v"][:, 0], rtol=1e-12)


def test_builtin_max_and_min_are_element_wise_on_tensors():
    src = """network t {
  input x: f32[N, 4]
  input z: f32[N, 4]
  a = max(x, 0)
  b = min(x, z, 0.5)
  k = max(3, 7)
  output a, b
}"""
    rng = np.random.default_rng(2)
    x, z = rng.standard_normal((2, 4)), rng.standard_normal((2, 4))
    g, (a, b) = forward(src, {"x": x, "z": z})
    np.testing.assert_array_equal(a, np.maximum(x, 0))
    np.testing.assert_array_equal(b, np.minimum(np.minimum(x, z), 0.5))
    assert len(g.by_op("maximum")) == 1 and len(g.by_op("minimum")) == 2
    with pytest.raises(NetdslError, match=r"max\(\) of a tensor needs a second argument; "
                                          r"for a reduction use amax"):
        netdsl.loads("network t {\n  input x: f32[N, 4]\n  a = max(x)\n  output a\n}")


def test_gather_elements_selects_per_example():
    src = """network t {
  input x: f32[N, 5]
  input i: i64[N, 2]
  y = gather_elements(x, i, axis=1)
  output y
}"""
    x = np.arange(10.0).reshape(2, 5)
    _, (y,) = forward(src, {"x": x, "i": np.array([[4, 0], [1, 1]])})
    np.testing.assert_array_equal(y, [[4.0, 0.0], [6.0, 6.0]])


def test_manual_causal_attention_passes_check_numerics():
    src = """network t {
  input q: f32[N, 4, 3]
  s = matmul(q, transpose(q))
  p = softmax(causal_mask(s))
  output p
}"""
    g = netdsl.loads(src).graph.bind(2)
    q = np.random.default_rng(3).standard_normal((2, 4, 3))
    (p,) = Executor(g, "numpy", dtype="f32", check_numerics=True).run(
        {"q": q}, training=False)["output"]
    assert (np.triu(np.ones((4, 4)), 1)[None] * p == 0).all()
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-6)
