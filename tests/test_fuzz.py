"""Property tests: whatever the text, the front end raises NetdslError or succeeds.

Random text, random soups of the language's tokens, and mutations (delete / duplicate /
swap tokens or characters) of examples/resnet2504.net and a small network that uses most
features. Never another exception; every diagnostic with a location points inside the
file it names. Deterministic (derandomize) and bounded (about 200 examples in all).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import netdsl
from netdsl.errors import NetdslError

ROOT = Path(__file__).resolve().parents[1]
RESNET = (ROOT / "examples" / "resnet2504.net").read_text()
FILE = str(ROOT / "examples" / "fuzzed.net")  # so `import resnet` resolves as usual

SMALL = """\
import resnet
block mlp(x, hidden, out=10) {
    h = relu(linear(x, hidden))
    return linear(h, out)
}
@recompute
block cheap(x) { return relu(batchnorm(x)) }
network small {
    input x: f32[N, 1, 8, 8]
    input y: i64[N]
    parallel { data = 2; pipeline = 2; microbatches = 4 }
    h = resnet.cifar_stem(x, 8)
    @stage(1)
    h = maxpool(cheap(h), kernel=2)
    repeat 2 as i { h = h + conv2d(h, 8, kernel=3, padding=1) * 0.5 }
    a, b = split(h, 2)
    h = concat(a, b, axis=1)
    s = shape(h)
    k = if s[2] == 4 and channels(h) >= 8 then 16 else -8 // 2
    if k > 0 { k = k * 2 } else { k = 1 }
    logits = mlp(flatten(h), k)
    output logits
    loss softmax_cross_entropy(logits, y)
}
train { optimizer = adam(lr=1e-3); schedule = cosine(warmup=2); batch = 8; steps = 10 }
"""

# 200 examples in all: 30 + 30 + 30 + 60 + 20 + 30
SETTINGS = settings(derandomize=True, deadline=None, database=None, max_examples=30,
                    suppress_health_check=list(HealthCheck))

_TOKEN = re.compile(r'\s+|[A-Za-z_]\w*|\d[\d_]*\.?\d*(?:[eE][-+]?\d+)?|"[^"\n]*"|\*\*|//|==|'
                    r'!=|<=|>=|#[^\n]*|.')


def check(text: str) -> None:
    """Load `text`; only NetdslError may escape, and its locations must be in range."""
    try:
        netdsl.loads(text, file=FILE)
    except NetdslError as e:
        lines = text.split("\n")  # lines as the lexer counts them
        for d in e.diagnostics:
            assert d.message
            if d.loc is None or d.loc.file != FILE:
                continue  # in an imported file (the stdlib) or about the file as a whole
            assert 1 <= d.loc.line <= max(len(lines), 1), (d.loc, d.message)
            width = len(lines[d.loc.line - 1]) if lines else 0
            assert 1 <= d.loc.column <= width + 1, (d.loc, d.message)
            for site in d.stack:
                assert site.loc.line >= 1 and site.loc.column >= 1
            d.render()


def test_the_seeds_are_valid():
    netdsl.loads(SMALL, file=FILE)
    netdsl.loads(RESNET, file=FILE)


WORDS = ["network", "block", "input", "output", "loss", "repeat", "as", "if", "then", "else",
         "return", "import", "train", "parallel", "and", "or", "not", "true", "false", "none",
         "N", "x", "h", "y", "f32", "i64", "relu", "conv2d", "linear", "shape", "channels",
         "split", "concat", "reshape", "parameter", "fill", "resnet", "stem", "(", ")", "{",
         "}", "[", "]", ",", "=", ":", ";", "@", "stage", "recompute", "keep", "shard", ".",
         "+", "-", "*", "/", "//", "%", "**", "==", "<", "0", "1", "2", "-1", "3.5", "1e400",
         '"s"', '"a.net"', '"\\q"', "\n", "#", "99999999999999999999", "\\"]


@SETTINGS
@given(st.text(max_size=200))
def test_random_text(text):
    check(text)


@SETTINGS
@given(st.lists(st.sampled_from(WORDS), max_size=40))
def test_token_soup(words):
    check(" ".join(words))


@SETTINGS
@given(st.lists(st.sampled_from(WORDS), max_size=25))
def test_token_soup_inside_a_network(words):
    check("network n {\n    input x: f32[N, 3, 8, 8]\n    " + " ".join(words) +
          "\n    output x\n}\n")


def _mutations(seed_text: str, n_max: int):
    tokens = _TOKEN.findall(seed_text)
    assert "".join(tokens) == seed_text
    edit = st.tuples(st.sampled_from(["delete", "duplicate", "swap", "char-delete",
                                      "char-duplicate"]),
                     st.integers(0, len(tokens) - 1), st.integers(0, len(tokens) - 1))
    return st.lists(edit, min_size=1, max_size=n_max).map(lambda edits: _apply(tokens, edits))


def _apply(tokens, edits) -> str:
    toks = list(tokens)
    for kind, i, j in edits:
        i, j = i % len(toks), j % len(toks)
        if kind == "delete":
            del toks[i]
        elif kind == "duplicate":
            toks.insert(i, toks[j])
        elif kind == "swap":
            toks[i], toks[j] = toks[j], toks[i]
        else:  # a character inside token i
            t = toks[i]
            if not t:
                continue
            k = j % len(t)
            toks[i] = t[:k] + t[k + 1:] if kind == "char-delete" else t[:k] + t[k] + t[k:]
        if not toks:
            toks = [""]
    return "".join(toks)


@settings(SETTINGS, max_examples=60)
@given(_mutations(SMALL, 3))
def test_mutated_small_network(text):
    check(text)


# the flagship takes ~0.5 s when a mutant still parses, so fewer examples here
@settings(SETTINGS, max_examples=20)
@given(_mutations(RESNET, 2))
def test_mutated_resnet2504(text):
    check(text)


@settings(SETTINGS, max_examples=30)
@given(st.text(alphabet=st.sampled_from(list("()[]{}\"#\\@=,.:;*+-/ \nxN12eif")), max_size=80))
def test_punctuation_soup(text):
    check("network n {\n    input x: f32[N, 4]\n    h = " + text + "\n    output x\n}\n")


# -- the checker's classes (issue 10): numbers, attributes, dtypes, depth, bytes -------------
_NUMBERS = st.one_of(
    st.integers(-(2 ** 70), 2 ** 70).map(str),
    st.sampled_from(["1e400", "1e308 * 10.0", "2 ** 63", "2 ** 62 * 2", "-(2 ** 63)",
                     "int(1e30)", "int(1e18)", "10.0 ** 400", "0.0", "-1", "9223372036854775807",
                     "(3, 0)", "(1, -2)", "(2 ** 40, 2 ** 40)"]),
    st.floats(allow_nan=False, allow_infinity=False).map(repr))

_CALLS = ["linear(flatten(x), {})", "conv2d(x, {}, kernel=1)", "conv2d(x, 4, kernel={})",
          "conv2d(x, 4, stride={})", "conv2d(x, 4, padding={})", "maxpool(x, {})",
          "batchnorm(x, eps={})", "batchnorm(x, momentum={})", "dropout(x, p={})",
          "leaky_relu(x, slope={})", "reshape(x, (N, {}))", "parameter(({}, 4))",
          "fill(({}, 2), 1.0)", "split(x, {})", "x * {}", "slice(x, 1, {}, 2)"]


@settings(SETTINGS, max_examples=40)
@given(st.sampled_from(_CALLS), _NUMBERS)
def test_numbers_in_every_attribute_position(call, number):
    """Any number (huge, negative, fractional, infinite) in an attribute: a located error
    or a network, never an internal error or a network with impossible sizes."""
    text = ("network n {\n    input x: f32[N, 3, 8, 8]\n    h = " + call.format(number) +
            "\n    output h\n}\n")
    check(text)
    try:
        g = netdsl.loads(text, file=FILE).graph
    except NetdslError:
        return
    for n in g.nodes:
        assert n.type.size_error() is None, n


@settings(SETTINGS, max_examples=15)
@given(st.sampled_from(["f16", "f32", "f64", "i32", "i64", "bool"]),
       st.sampled_from(["f16", "f32", "f64", "i32", "i64", "bool"]),
       st.sampled_from(["a + b", "a * b", "a - b", "matmul(a, b)", "concat(a, b)",
                        "mse(a, b)"]))
def test_mixed_dtypes(da, db, expr):
    text = (f"network n {{\n    input a: {da}[N, 4, 4]\n    input b: {db}[N, 4, 4]\n"
            f"    output {expr}\n}}\n")
    check(text)
    if da != db and da in ("f16", "f32", "f64") and db in ("f16", "f32", "f64"):
        try:
            netdsl.loads(text, file=FILE)
        except NetdslError as e:
            assert "dtype" in e.message or "one type" in e.message
        else:
            raise AssertionError(f"{da} {expr} {db} was accepted")


@settings(SETTINGS, max_examples=12)
@given(st.lists(st.sampled_from(["relu(", "(", "-(", "if true {\n", "repeat 1 {\n",
                                 "1 + "]), min_size=1, max_size=4),
       st.integers(1, 2500))
def test_deep_nesting(openers, depth):
    """Mixed nesting thousands of levels deep: compiles or a located limit error."""
    closers = {"relu(": ")", "(": ")", "-(": ")", "if true {\n": "}\n",
               "repeat 1 {\n": "}\n", "1 + ": ""}
    seq = [openers[i % len(openers)] for i in range(depth)]
    stmt_level = [o.endswith("\n") for o in seq]
    # statements may not sit inside an expression: put statement openers first
    seq = [o for o, s in zip(seq, stmt_level) if s] + [o for o, s in zip(seq, stmt_level)
                                                       if not s]
    expr_open = "".join(o for o in seq if not o.endswith("\n"))
    expr_close = "".join(closers[o] for o in reversed(seq) if not o.endswith("\n"))
    stmts = [o for o in seq if o.endswith("\n")]
    body = "".join(stmts) + "k = " + expr_open + "1" + expr_close + "\n" + \
        "".join(closers[o] for o in reversed(stmts))
    check("network n {\n    input x: f32[N, 4]\n" + body + "    output x\n}\n")


@settings(SETTINGS, max_examples=25)
@given(st.binary(max_size=60), st.booleans(), st.integers(0, 200))
def test_bytes_in_a_file(tmp_path_factory, junk, bom, at):
    """Any bytes spliced into a valid file, with or without a byte-order mark: loads, or a
    NetdslError whose location is inside the file."""
    src = SMALL.encode()
    at = min(at, len(src))
    data = (b"\xef\xbb\xbf" if bom else b"") + src[:at] + junk + src[at:]
    p = tmp_path_factory.mktemp("bytes") / "fuzzed.net"
    p.write_bytes(data)
    try:
        netdsl.load(p)
    except NetdslError as e:
        lines = data.decode("utf-8-sig", errors="replace").split("\n")
        for d in e.diagnostics:
            if d.loc is not None and d.loc.file == str(p):
                assert 1 <= d.loc.line <= len(lines), (d.loc, d.message)
            d.render()


# -- `netdsl run`'s options (issue 10): any combination fails before the first step, in
# words, or trains ---------------------------------------------------------------------------
TINY_RUN = """
network tiny {
    input x: f32[N, 4]
    input y: i64[N]
    logits = linear(x, 3)
    output logits
    loss softmax_cross_entropy(logits, y)
}
train { data = synthetic(samples=16, test_samples=4); batch = 4; steps = 2 }
"""


@settings(SETTINGS, max_examples=30)
@given(st.fixed_dictionaries({}, optional={
    "steps": st.sampled_from([1, 2, 3, 10 ** 20]),
    "batch": st.sampled_from([1, 4, 64, 2 ** 31, 10 ** 23]),
    "lr": st.sampled_from([0.0, -1.0, 1e-3, 1e40, float("inf"), float("nan")]),
    "dtype": st.sampled_from(["f32", "f64", "f16", "i8"]),
    "device": st.sampled_from([0, 3]),
    "checkpoint": st.sampled_from(["dir", "file", "deep/new/dir"]),
    "checkpoint_every": st.sampled_from([1, 5]),
    "resume": st.booleans(),
    "log": st.sampled_from(["m.jsonl", "dir", "missing/x.jsonl"]),
    "eval_every": st.sampled_from([1, 2]),
    "eval_samples": st.sampled_from([-1, 0, 1, 1000]),
}))
def test_run_option_combinations(tmp_path_factory, options):
    from netdsl.runtime.options import RunOptions
    from netdsl.runtime.trainer import Callback, Trainer

    class Count(Callback):
        steps = 0

        def on_step(self, record):
            Count.steps += 1

    root = tmp_path_factory.mktemp("run")
    (root / "file").write_text("x")
    (root / "dir").mkdir()
    for key in ("checkpoint", "log"):
        if key in options:
            options[key] = str(root / options[key])
    net = netdsl.loads(TINY_RUN, file=str(root / "tiny.net"))
    try:
        r = Trainer(net.graph, net.train, RunOptions(**options), Count()).fit()
    except NetdslError as e:
        assert e.message and "Traceback" not in e.render()
        # a bad option or path is found before any step; only divergence comes later
        if Count.steps:
            assert "NaN or Inf" in e.message, e.message
        return
    assert r.final_loss is None or np.isfinite(r.final_loss) or options.get("lr", 0) > 1
