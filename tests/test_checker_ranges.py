# ruff: noqa: E501  (the cases are whole programs and messages, longer than 100)
"""The checker's range rules: 64-bit static integers, finite floats, tensor and network
sizes, attribute ranges, block parameters, the dtype rule, and train settings (in the file
and on the command line). Each bad value is reported at its own line and column."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_errors import fails, net

from netdsl.errors import SourceLoc
from netdsl.frontend.checks import check_attr
from netdsl.frontend.frames import Fail
from netdsl.ir import registry

ROOT = Path(__file__).resolve().parents[1]

# (id, program, phrase in the first message, line, column)
CASES = [
    ("int-literal", net("k = 99999999999999999999999\noutput x"),
     "does not fit in a 64-bit integer", 4, 9),
    ("int-literal-in-call", net("output linear(flatten(x), 9223372036854775808)"),
     "does not fit in a 64-bit integer", 4, 31),
    ("int-product", net("k = 2 ** 62 * 4\noutput x"),
     "does not fit in a 64-bit integer", 4, 9),
    ("int-sum", net("k = 9223372036854775807 + 1\noutput x"),
     "does not fit in a 64-bit integer", 4, 9),
    ("int-of-huge-float", net("k = int(1e30)\noutput x"),
     "int(): 1e+30 does not fit in a 64-bit integer", 4, 9),
    ("float-literal", net("k = 1e400\noutput x"), "too large for a float", 4, 9),
    ("float-overflow-no-errno", net("k = 2.0 ** 10000\noutput x"),
     "the result of `2.0 ** 10000` is too large for a float", 4, 9),
    ("float-product-inf", net("k = 1e308 * 10.0\noutput x"),
     "the result of `*` is too large for a float", 4, 9),
    ("tensor-too-big", net("output linear(flatten(x), 4000000000000000000)"),
     "more than any memory", 4, 12),
    ("input-too-big", "network n {\n    input x: f32[N, 4000000000, 4000000000]\n    output x\n}\n",
     "more than any memory", 2, 11),
    ("params-too-many", net("""
        a = parameter((2000000000, 1000000000))
        b = parameter((2000000000, 1000000000))
        c = parameter((2000000000, 1000000000))
        d = parameter((2000000000, 1000000000))
        e = parameter((2000000000, 1000000000))
        output x
        """), "more than 9.22e+18 parameters", 8, 9),
    ("negative-eps", net("output batchnorm(x, eps=-1.0)"), "`eps` must be greater than 0", 4, 25),
    ("momentum-range", net("output batchnorm(x, momentum=7)"), "`momentum` must be in [0, 1]", 4, 25),
    ("zero-stride", net("output conv2d(x, 4, stride=0)"), "`stride` must be at least 1, not 0", 4, 25),
    ("pair-element", net("output conv2d(x, 4, kernel=(3, 0))"),
     "`kernel` must be at least 1 (each value), not 0", 4, 25),
    ("negative-padding", net("output maxpool(x, 2, padding=-1)"), "`padding` must be at least 0", 4, 26),
    ("zero-features", net("output linear(flatten(x), 0)"), "`out_features` must be at least 1", 4, 31),
    ("inf-slope", net("output leaky_relu(x, slope=1e308 * 10.0)"), "too large for a float", 4, 32),
    ("dup-param", "block b(a, c, a) { return a }\nnetwork n { input x: f32[N, 4]\n output b(x, x, x) }\n",
     "two parameters named `a` (the first at line 1, column 9)", 1, 15),
    ("mixed-dtype-matmul", """network n {
    input a: f32[N, 2, 4]
    input b: f64[N, 4, 4]
    output matmul(a, b)
}
""", "floating-point dtypes differ: `a` (input at line 2, column 11) is f32[N, 2, 4] and `b` (input at line 3, column 11) is f64[N, 4, 4]", 4, 12),
    ("mixed-dtype-add", """network n {
    input a: f32[N, 4]
    input b: f16[N, 4]
    output a + b
}
""", "floating-point dtypes differ", 4, 12),
    ("mixed-dtype-concat", """network n {
    input a: f32[N, 4]
    input b: f64[N, 4]
    output concat(a, b)
}
""", "input 1 is f32[N, 4] and input 2 is f64[N, 4]", 4, 12),
    ("unknown-dtype-name", net('output fill((2, 3), 0.0, "f8")'),
     'fill() `dtype` must be one of f16, f32, f64, i32, i64, bool, not "f8"', 4, 30),
    ("train-batch-huge", net("output x") + "train { batch = 100000000000 }\n",
     "`batch` must be at most 2147483647", 6, 9),
    ("train-lr-zero", net("output x") + "train { optimizer = sgd(lr=0.0) }\n",
     "`optimizer.lr` must be greater than 0", 6, 9),
]


@pytest.mark.parametrize("src,phrase,line,col", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_range_error(src, phrase, line, col):
    e = fails(src)
    d = e.diagnostics[0]
    assert phrase in d.message
    assert (d.loc.line, d.loc.column) == (line, col), d.render()
    assert "errno" not in d.message and "(34," not in d.message


class _El:
    """Just enough of the elaborator for `check_attr`: it records the error."""

    def __init__(self):
        self.messages = []

    def error(self, message, loc, notes=()):
        self.messages.append(message)
        return Fail()


def _outside(r: registry.Range):
    """A value just outside a range (below it if it has a lower bound)."""
    if r.lo is not None:
        return r.lo if r.lo_open else r.lo - 1
    return r.hi if r.hi_open else r.hi + 1


def _ranged_args():
    registry.load_all()
    return [(op.name, a) for op in registry.OPS.values() if op.callable_from_language
            for a in op.attr_args if a.range is not None]


@pytest.mark.parametrize("op,arg", _ranged_args(), ids=lambda v: getattr(v, "name", v))
def test_every_declared_range_is_enforced(op, arg):
    loc = SourceLoc("f.net", 1, 1)
    el = _El()
    bad = _outside(arg.range)
    if arg.kind == "float":
        bad = float(bad)
    with pytest.raises(Fail):
        check_attr(el, op, arg, bad, loc)
    assert str(bad) in el.messages[0] and arg.name in el.messages[0]
    if arg.default not in (registry.REQUIRED, None):  # the default itself is valid
        # (an int given for a tuple kind comes back as a 1-tuple)
        assert check_attr(_El(), op, arg, arg.default, loc) in (arg.default, (arg.default,))


# numeric attributes whose every finite (float) or 64-bit (int) value is meaningful
UNBOUNDED = {"slope", "factor", "value", "axis", "start", "dim0", "dim1", "dims",
             "min", "max", "alpha", "threshold", "ignore_index"}


def test_every_numeric_attribute_has_a_range():
    """A new operator's count or size must declare its valid range (docs list it)."""
    registry.load_all()
    missing = [f"{op.name}.{a.name}" for op in registry.OPS.values()
               if op.callable_from_language for a in op.attr_args
               if a.kind in ("int", "float", "pair") and a.range is None
               and a.name not in UNBOUNDED]
    assert not missing, f"declare a registry.Range for: {missing}"


def test_floats_must_be_finite_and_ints_64_bit():
    loc = SourceLoc("f.net", 1, 1)
    slope = next(a for a in registry.get("leaky_relu").attr_args if a.name == "slope")
    with pytest.raises(Fail):
        check_attr(_El(), "leaky_relu", slope, float("nan"), loc)
    axis = next(a for a in registry.get("concat").attr_args if a.name == "axis")
    with pytest.raises(Fail):
        check_attr(_El(), "concat", axis, 2 ** 63, loc)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "netdsl_cli", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


@pytest.mark.parametrize("flag,value,phrase", [
    ("--lr", "0", "`--lr` must be greater than 0, not 0.0"),
    ("--lr", "inf", "`--lr` must be a finite number"),
    ("--batch", "100000000000000000000000", "`--batch` must be at most 2147483647"),
])
def test_cli_values_are_checked_in_words(flag, value, phrase):
    r = _cli("run", "examples/digits-mlp.net", "--steps", "1", flag, value)
    assert r.returncode == 1, r.stderr
    assert phrase in r.stderr
    for leak in ("pydantic", "validation error", "Input should", "internal error"):
        assert leak not in r.stderr
