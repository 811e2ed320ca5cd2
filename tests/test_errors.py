# ruff: noqa: E501  (the snapshots below are whole rendered lines, longer than 100)
"""Bad programs: each asserts the message (a key phrase) and the exact line and column.

Programs are written flush-left so that columns can be read off the source. A few tests
snapshot the whole rendered text (caret line and call chain included).
"""
from __future__ import annotations

import re
import textwrap

import pytest

import netdsl
from netdsl.errors import NetdslError

NET = "network n {{\n    input x: f32[N, 3, 8, 8]\n    input y: i64[N]\n{body}\n}}\n"


def fails(src: str, file: str = "bad.net") -> NetdslError:
    with pytest.raises(NetdslError) as info:
        netdsl.loads(textwrap.dedent(src).lstrip("\n"), file=file)
    return info.value


def net(body: str) -> str:
    """A network with x: f32[N, 3, 8, 8] and y: i64[N]; `body` starts at line 4."""
    return NET.format(body=textwrap.indent(textwrap.dedent(body).strip("\n"), "    "))


# (id, program, phrase in the first message, line, column)
CASES = [
    # -- syntax -------------------------------------------------------------------------
    ("missing-paren", net("h = relu(x\noutput h"),
     "the `(` at line 4, column 13 is never closed", 5, 5),
    ("extra-paren", net("h = relu(x))\noutput h"),
     "there is no `(` for this `)` to close", 4, 16),
    ("mismatched-bracket", net("h = relu(x]\noutput h"),
     "the `(` at line 4, column 13 is never closed", 4, 15),
    ("missing-brace-eof", "network n {\n    input x: f32[N, 4]\n    output x\n",
     "unexpected end of file (the `{` at line 1, column 11 is never closed)", 3, 13),
    ("missing-open-brace", "network n\n    input x: f32[N, 4]\n}\n",
     "unexpected keyword `input`; expected `{`", 2, 5),
    ("stray-token", net("h = relu(x) $\noutput h"), "unexpected character `$`", 4, 17),
    ("stray-keyword", "blok b(x) { return x }\n",
     "unexpected name `blok`; expected `import`, `block`, `network` or `train`", 1, 1),
    ("kwarg-colon", net("h = linear(x, 3, bias: true)\noutput h"),
     "keyword arguments are written `name=value`", 4, 26),
    ("kwarg-number-name", net("h = linear(x, 3, 1=2)\noutput h"),
     "keyword arguments are written `name=value`", 4, 23),
    ("positional-after-kw", net("h = linear(x, out_features=3, true)\noutput h"),
     "a positional argument follows a keyword argument", 4, 35),
    ("unterminated-string", net('h = linear(x, 3, "abc)\noutput h'),
     "unterminated string", 4, 22),
    ("bad-escape", net('k = "a\\qb"\noutput x'), "unknown escape `\\q` in a string", 4, 11),
    ("missing-expression", net("h = = x\noutput x"),
     "unexpected `=`; expected an expression", 4, 9),
    ("keyword-as-name", net("h =\noutput h"),
     "unexpected keyword `output`; expected an expression", 5, 5),
    ("input-in-block", "block b(x) {\n    input z: f32[N]\n    return x\n}\n",
     "`input` may only appear at the top level of a network", 2, 5),
    ("missing-colon", "network n {\n    input x f32[N, 4]\n    output x\n}\n",
     "unexpected name `f32`; expected `:`", 2, 13),
    # -- names ---------------------------------------------------------------------------
    ("undefined-op", net("h = rleu(x)\noutput h"), "`rleu` is not defined; did you mean `relu`?",
     4, 9),
    ("undefined-var", net("h = relu(hh)\noutput h"), "`hh` is not defined", 4, 14),
    ("unknown-kwarg", net("h = conv2d(x, 8, kernal=3)\noutput h"),
     "conv2d() has no argument `kernal`; did you mean `kernel`?", 4, 22),
    ("kwarg-twice", net("h = conv2d(x, 8, kernel=3, kernel=3)\noutput h"),
     "argument `kernel` is given twice", 4, 32),
    ("kwarg-and-positional", net("h = conv2d(x, 8, out_channels=8)\noutput h"),
     "got argument `out_channels` both by position and by name", 4, 22),
    # -- arity and kinds -----------------------------------------------------------------
    ("too-many-positional", net("h = linear(flatten(x), 3, true, 5)\noutput h"),
     "linear() takes at most 3 positional arguments (x, out_features, bias) but 4 were given",
     4, 9),
    ("missing-required", net("h = linear(flatten(x))\noutput h"),
     "linear() is missing its argument `out_features`", 4, 9),
    ("tensor-for-int", net("h = conv2d(x, x)\noutput h"),
     "conv2d() expects an integer for `out_channels`, but got `x` (input at line 2, "
     "column 11), a tensor f32[N, 3, 8, 8]", 4, 19),
    ("int-for-tensor", net("h = relu(3)\noutput x"),
     "relu() expects a tensor for `x`, but got an int 3", 4, 14),
    ("float-for-int", net("h = conv2d(x, 8, kernel=2.5)\noutput h"),
     "conv2d() expects an integer or a pair of integers for `kernel`, but got a float 2.5",
     4, 22),
    ("bool-for-float", net("h = leaky_relu(x, slope=true)\noutput h"),
     "leaky_relu() expects a number for `slope`, but got a bool true", 4, 23),
    ("call-non-function", net("h = 3(x)\noutput x"), "an int cannot be called", 4, 9),
    # -- shapes --------------------------------------------------------------------------
    ("conv-after-flatten", net("h = flatten(x)\nh = conv2d(h, 64, kernel=3)\noutput h"),
     "conv2d expects a 4-d input, but `h` (from flatten at line 4, column 9) is f32[N, 192]",
     5, 9),
    ("linear-add-mismatch", net("h = linear(flatten(x), 10)\ng = linear(flatten(x), 12)\n"
                                "output h + g"),
     "shapes do not match: `h` (from linear at line 4, column 9) is f32[N, 10] and `g` "
     "(from linear at line 5, column 9) is f32[N, 12]", 6, 12),
    ("matmul-mismatch", net("a = reshape(x, (N, 3, 64))\nb = reshape(x, (N, 8, 24))\n"
                            "output matmul(a, b)"),
     "matmul: inner dimensions differ: `a` (from reshape at line 4, column 9)", 6, 12),
    ("concat-mismatch", net("h = maxpool(x, kernel=2)\noutput concat(x, h)"),
     "concat along axis 1", 5, 12),
    ("reshape-count", net("output reshape(x, (N, 7))"),
     "reshape cannot make", 4, 12),
    ("pool-too-big", net("output maxpool(x, kernel=9)"),
     "a height of 8 is too small for kernel 9", 4, 12),
    ("groups", net("output conv2d(x, 4, groups=2)"),
     "conv2d with groups=2 needs input and output channels divisible by 2, but `x` (input "
     "at line 2, column 11) has 3 channels", 4, 12),
    ("sce-labels-shape", net("input z: i64[N, 3]\nh = linear(flatten(x), 10)\noutput h\n"
                             "loss softmax_cross_entropy(h, z)"),
     "softmax_cross_entropy expects labels shaped like the logits without the class "
     "dimension (axis 1), but `h` (from linear at line 5, column 9) is f32[N, 10] and `z`", 7, 10),
    ("sce-labels-dtype", net("input z: f32[N]\nh = linear(flatten(x), 10)\noutput h\n"
                             "loss softmax_cross_entropy(h, z)"),
     "softmax_cross_entropy expects integer class labels, but `z` (input at line 4, "
     "column 11) is f32[N]", 7, 10),
    ("index-out-of-range", net("k = shape(x)[4]\noutput x"),
     "index 4 is out of range for a tuple of 4", 4, 9),
    ("channels-of-vector", net("k = channels(y)\noutput x"),
     "channels() needs a tensor of rank 2 or more, but `y` (input at line 3, column 11) is "
     "i64[N]", 4, 9),
    # -- inputs --------------------------------------------------------------------------
    ("unknown-dtype", "network n {\n    input x: f33[N, 4]\n    output x\n}\n",
     "unknown element type `f33`; use one of f16, f32, f64, i32, i64, bool", 2, 14),
    ("batch-not-first", "network n {\n    input x: f32[4, N]\n    output x\n}\n",
     "the batch dimension N may only be the first dimension", 2, 21),
    ("no-batch", "network n {\n    input x: f32[4]\n    output x\n}\n",
     "input `x` must have the batch dimension N first", 2, 11),
    ("zero-dim", "network n {\n    input x: f32[N, 0]\n    output x\n}\n",
     "a dimension must be a positive integer or N, not an int 0", 2, 21),
    ("negative-dim", "network n {\n    input x: f32[N, -3]\n    output x\n}\n",
     "a dimension must be a positive integer or N, not an int -3", 2, 21),
    ("input-twice", net("input x: f32[N]\noutput x"), "`x` is already defined", 4, 11),
    # -- output and loss -----------------------------------------------------------------
    ("output-not-tensor", net("output 3"), "the output must be a tensor, not an int", 4, 12),
    ("output-tuple", net("output shape(x)"), "the output must be a tensor, not a tuple", 4, 12),
    ("loss-not-scalar", net("output x\nloss x"),
     "the loss must be a scalar, but it is f32[N, 3, 8, 8]", 5, 10),
    ("loss-not-tensor", net("loss 1.5"), "the loss must be a tensor, not a float", 4, 10),
    ("no-output", "network n {\n    input x: f32[N, 4]\n    h = relu(x)\n}\n",
     "network `n` declares no `output` and no `loss`", 1, 9),
    ("two-losses", net("h = linear(flatten(x), 10)\nloss softmax_cross_entropy(h, y)\n"
                       "loss softmax_cross_entropy(h, y)"), "a network has one `loss`", 6, 5),
    # -- annotations ---------------------------------------------------------------------
    ("unknown-annotation", net("@fast\nh = relu(x)\noutput h"),
     "unknown annotation @fast (known: @recompute, @offload, @keep, @stage", 4, 5),
    ("annotation-args", net("@recompute(2)\nh = relu(x)\noutput h"),
     "@recompute takes no arguments", 4, 5),
    ("annotation-bad-stage", net('@stage("a")\nh = relu(x)\noutput h'),
     "@stage takes one non-negative integer", 4, 5),
    ("annotation-kwargs", net("@stage(k=1)\nh = relu(x)\noutput h"),
     "@stage takes no keyword arguments", 4, 12),
    ("annotation-shard", net("@shard(rows, 2)\nh = relu(x)\noutput h"),
     "@shard takes a dimension (batch, channels, height, width, features, heads)", 4, 5),
    ("annotation-shard-unit", net("@shard_unit(2)\nh = relu(x)\noutput h"),
     "@shard_unit takes no arguments", 4, 5),
    ("recompute-keep", net("@recompute @keep\nh = relu(x)\noutput h"),
     "@recompute and @keep contradict each other", 4, 5),
    ("annotation-on-network", "@recompute\nnetwork n {\n    input x: f32[N, 4]\n"
                              "    output x\n}\n",
     "annotations on a network are not supported; use `parallel { }`", 1, 1),
    ("stage-beyond-pipeline", net("parallel { pipeline = 2; microbatches = 4 }\n@stage(2)\n"
                                  "h = relu(x)\noutput h"),
     "@stage(2) needs a pipeline of at least 3 stages, but `parallel` declares pipeline = 2",
     6, 9),
    ("annotation-alone", net("@keep ;\noutput x"),
     "an annotation must be followed by a statement", 4, 5),
    # -- parallel ------------------------------------------------------------------------
    ("parallel-unknown", net("parallel { pipelines = 2 }\noutput x"),
     "`parallel` has no setting `pipelines`; it has data, pipeline, microbatches, tensor, "
     "spatial, schedule", 4, 16),
    ("parallel-zero", net("parallel { data = 0 }\noutput x"),
     "invalid parallel declaration: `data` must be at least 1, not 0", 4, 16),
    ("parallel-string", net('parallel { data = "two" }\noutput x'),
     'invalid parallel declaration: `data` must be an integer, not "two"', 4, 16),
    ("parallel-schedule", net('parallel { pipeline = 2; schedule = "zigzag" }\noutput x'),
     'invalid parallel declaration: `schedule` must be "gpipe", "1f1b" or "zb-h1", not '
     '"zigzag"',
     4, 30),
    ("parallel-microbatches", net("parallel { tensor = 2; microbatches = 4 }\noutput x"),
     "microbatches apply to pipelines, to data-parallel replicas and to one device "
     "(gradient accumulation), not to tensor or spatial splits", 4, 28),
    ("parallel-shard-alone", net("parallel { data = 1; shard = 1 }\noutput x"),
     "invalid parallel declaration: shard applies to data-parallel replicas alone", 4, 26),
    ("parallel-shard-spatial", net("parallel { data = 2; spatial = 2; shard = 2 }\noutput x"),
     "shard applies to data-parallel replicas alone or with pipeline and tensor splits", 4,
     39),
    ("parallel-spatial-pipeline", net("parallel { spatial = 2; pipeline = 2 }\noutput x"),
     "spatial splits combine with data replicas only, not with pipeline or tensor", 4, 16),
    ("parallel-shard-stage", net("parallel { data = 2; shard = 4 }\noutput x"),
     "invalid parallel declaration: `shard` must be 0, 1, 2 or 3, not 4", 4, 26),
    ("parallel-twice", net("parallel { data = 2 }\nparallel { data = 2 }\noutput x"),
     "a network has one `parallel` declaration", 5, 5),
    # -- train ---------------------------------------------------------------------------
    ("train-unknown", net("output x") + "train {\n    batchsize = 3\n}\n",
     "unknown train setting `batchsize` (known: data, optimizer, schedule, batch, steps, "
     "epochs, seed, eval_every)", 7, 5),
    ("train-optimizer", net("output x") + "train {\n    optimizer = sgdd(lr=0.1)\n}\n",
     "unknown optimizer `sgdd`; use one of sgd, adam, adamw", 7, 5),
    ("train-optimizer-arg", net("output x") + "train {\n    optimizer = sgd(rl=0.1)\n}\n",
     "sgd() has no argument `rl`", 7, 5),
    ("train-batch-type", net("output x") + 'train {\n    batch = "big"\n}\n',
     '`batch` must be an integer, not "big"', 7, 5),
    ("train-batch-bool", net("output x") + "train {\n    batch = true\n}\n",
     "`batch` must be an integer, not true", 7, 5),
    ("train-lr-type", net("output x") + 'train {\n    optimizer = adam(lr="fast")\n}\n',
     '`optimizer.lr` must be a number, not "fast"', 7, 5),
    ("train-lr-negative", net("output x") + "train {\n    optimizer = sgd(lr=-0.1)\n}\n",
     "`optimizer.lr` must be greater than 0, not -0.1", 7, 5),
    ("train-steps-epochs", net("output x") + "train {\n    steps = 10\n    epochs = 2\n}\n",
     "give either `steps` or `epochs` in the train section, not both", 8, 5),
    ("train-expression", net("output x") + "train {\n    batch = 2 * 8\n}\n",
     "a train setting must be a constant or a call like sgd(lr=0.1)", 7, 13),
    ("train-positional", net("output x") + "train {\n    optimizer = sgd(0.1)\n}\n",
     "sgd() takes keyword arguments only", 7, 21),
    ("train-twice", net("output x") + "train {\n    batch = 2\n    batch = 4\n}\n",
     "train setting `batch` is given twice", 8, 5),
    ("train-two-sections", net("output x") + "train { batch = 2 }\ntrain { batch = 4 }\n",
     "a file may have only one `train` section", 7, 1),
    # -- statements and static values ----------------------------------------------------
    ("return-outside-block", net("return x"), "`return` is only allowed inside a block", 4, 5),
    ("unpack-mismatch", "block two(x) {\n    return x, x\n}\n" + net("a, b, c = two(x)\noutput a")
     .replace("network", "network", 1), "cannot unpack 2 values into 3 names", 7, 5),
    ("unpack-non-tuple", net("a, b = relu(x)\noutput a"),
     "cannot unpack a tensor f32[N, 3, 8, 8] into 2 names", 4, 5),
    ("division-by-zero", net("k = 4 // (2 - 2)\noutput conv2d(x, k)"), "division by zero", 4, 9),
    ("modulo-by-zero", net("k = 5 % 0\noutput x"), "division by zero", 4, 9),
    ("power-too-large", net("k = 10 ** 10 ** 10\noutput x"),
     "10 ** 10000000000 is too large (static integers have at most 64 bits)", 4, 9),
    ("if-not-bool", net("if 3 {\n    h = x\n}\noutput h"),
     "an `if` condition must be true or false, not an int", 4, 8),
    ("cond-on-tensor", net("h = if x then x else x\noutput h"),
     "an `if` condition must be true or false, not a tensor f32[N, 3, 8, 8]", 4, 12),
    ("and-not-bool", net("k = 1 and true\noutput x"), "`and` needs true or false, not an int",
     4, 9),
    ("N-arithmetic", net("k = N + 1\noutput x"),
     "the batch dimension N cannot take part in arithmetic", 4, 9),
    ("repeat-negative", net("repeat -1 {\n    x = relu(x)\n}\noutput x"),
     "repeat needs a non-negative integer count, not an int -1", 4, 12),
    ("repeat-float", net("repeat 2.5 {\n    x = relu(x)\n}\noutput x"),
     "repeat needs a non-negative integer count, not a float 2.5", 4, 12),
    ("tensor-attr", net("k = x.foo\noutput x"),
     "a tensor f32[N, 3, 8, 8] has no attribute `foo`", 4, 9),
    ("tensor-compare", net("k = x != x\noutput x"), "cannot apply `!=` to a tensor", 4, 9),
    # -- the operators of issue 9 ----------------------------------------------------------
    ("conv-padding-kind", net('h = conv2d(x, 4, kernel=3, padding="full")\noutput h'),
     'conv2d() expects an integer, a tuple of integers, "same" or "valid" for `padding`, but got a string "full"', 4, 32),
    ("conv-padding-len", net("h = conv2d(x, 4, kernel=3, padding=(1, 2, 3))\noutput h"),
     'padding (1, 2, 3) needs 1, 2 or 4 values, "same" or "valid"', 4, 9),
    ("conv-same-stride", net('h = conv2d(x, 4, kernel=3, stride=2, padding="same")\noutput h'),
     'conv2d: padding="same" needs stride 1', 4, 9),
    ("pool-ceil-kind", net("h = maxpool(x, 2, ceil_mode=1)\noutput h"),
     "maxpool() expects true or false for `ceil_mode`, but got an int 1", 4, 23),
    ("pad-too-many", net("h = pad(x, (1, 1, 1, 1, 1, 1, 1, 1))\noutput h"),
     "pad: pads (1, 1, 1, 1, 1, 1, 1, 1) cover 4 dims, but `x` (input at line 2, column 11) (f32[N, 3, 8, 8]) has only 3 besides the batch", 4, 9),
    ("pad-reflect-big", net('h = pad(x, (8, 0), mode="reflect")\noutput h'),
     "pad: reflect padding 8 must be smaller than the dimension (8)", 4, 9),
    ("upsample-both", net("h = upsample(x, size=(4, 4), scale_factor=2.0)\noutput h"),
     "upsample needs exactly one of `size` and `scale_factor`", 4, 9),
    ("upsample-mode", net('h = upsample(x, scale_factor=2.0, mode="linear")\noutput h'),
     'upsample: mode "linear" is for 1 spatial dimension', 4, 9),
    ("clip-no-bounds", net("h = clip(x)\noutput h"), "clip needs `min`, `max` or both", 4, 9),
    ("groupnorm-groups", net("h = groupnorm(x, 2)\noutput h"),
     "groupnorm: 3 channels of `x` (input at line 2, column 11) do not divide into 2 groups", 4, 9),
    ("ce-weights", net("h = linear(flatten(x), 3)\noutput h\nloss softmax_cross_entropy(h, y, weight=(1.0, 2.0))"),
     "softmax_cross_entropy: 2 class weights for 3 classes", 6, 10),
    ("ce-reduction", net('h = linear(flatten(x), 3)\noutput h\nloss softmax_cross_entropy(h, y, reduction="avg")'),
     'softmax_cross_entropy() `reduction` must be one of mean, sum, none, not "avg"', 6, 38),
    ("sdpa-mismatch", net("q = flatten(x, 2)\nk = linear(q, 7)\nh = scaled_dot_product_attention(q, k, q, causal=true)\noutput h"),
     "scaled_dot_product_attention: q [..., L, E] and k [..., S, E] must agree in the leading dims and E, but `q`", 6, 9),
    ("qkv-heads", net("q = flatten(x, 2)\nh = attention_qkv(q, heads=5)\noutput h"),
     "attention_qkv: the last dimension of `q` (from flatten at line 4, column 9), 64, is not "
     "3 x 5 heads x a head width", 5, 9),
    ("qkv-probs", net("q = linear(flatten(x, 2), 12)\nh = attention_qkv(q, q, heads=2)\noutput h"),
     "attention_qkv: the probabilities `q`", 5, 9),
    ("reduce-batch", net("h = sum(x, (0, 1))\noutput h"),
     "sum over the batch dimension is not supported; use a loss", 4, 9),
    ("squeeze-not-one", net("h = squeeze(x, 1)\noutput h"),
     "squeeze: dimension 1 of `x` (input at line 2, column 11) is 3, not 1", 4, 9),
    ("where-cond", net("h = where(x, x, x)\noutput h"),
     "where expects a bool condition, but `x` (input at line 2, column 11) is f32[N, 3, 8, 8]", 4, 9),
    ("float-const-int", net("k = y - 0.5\noutput x"),
     "cannot apply `-` to a tensor i64[N] and a float 0.5: use cast() to make the tensor floating-point first", 4, 9),
    ("recursion", "block b(x) {\n    return b(x)\n}\n" + net("output b(x)"),
     "block calls are nested more than 64 deep; does block `b` call itself?", 2, 12),
    ("block-too-many-args", "block b(x, k) {\n    return linear(x, k)\n}\n"
                            + net("output b(x, 1, 2)"),
     "block `b` takes at most 2 positional arguments (x, k) but 3 were given", 7, 12),
    ("block-missing-arg", "block b(x, k) {\n    return linear(x, k)\n}\n" + net("output b(x)"),
     "block `b` is missing its argument `k`", 7, 12),
    ("block-unknown-kwarg", "block b(x, width) {\n    return linear(x, width)\n}\n"
                            + net("output b(x, widht=3)"),
     "block `b` has no argument `widht`; did you mean `width`?", 7, 17),
    ("block-scope", "block b(x) {\n    return linear(flatten(x), w)\n}\n"
                    + net("w = 3\noutput b(x)"), "`w` is not defined", 2, 31),
    ("module-missing-block", "import resnet\n" + net("output resnet.stemm(x)"),
     "module `resnet` has no block `stemm`; did you mean `stem`?", 5, 12),
    ("duplicate-block", "block a(x) {\n    return x\n}\nblock a(y) {\n    return y\n}\n"
                        + net("output a(x)"),
     "block `a` is defined twice in this file (first at line 1, column 7)", 4, 7),
    ("dropout-p", net("output dropout(x, p=1.5)"),
     "dropout() `p` must be in [0, 1], not 1.5", 4, 23),
    ("reshape-batch-not-first", net("output reshape(x, (3, N, 64))"),
     "the batch dimension N may only come first, not in (3, N, 64)", 4, 12),
    ("flatten-1d", net("output flatten(y)"),
     "flatten expects a tensor of rank 2 or more, but `y`", 4, 12),
]


@pytest.mark.parametrize("src,phrase,line,col", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_error(src, phrase, line, col):
    e = fails(src)
    d = e.diagnostics[0]
    assert phrase in d.message
    assert d.loc is not None and d.loc.file == "bad.net"
    assert (d.loc.line, d.loc.column) == (line, col), d.message
    assert e.render().startswith(f"bad.net:{line}:{col}: error: ")


def test_enough_distinct_cases():
    assert len({c[0] for c in CASES}) == len(CASES) >= 40


SYNTAX = [c for c in CASES if fails(c[1]).message.startswith("syntax error")]
RAW_TOKEN = re.compile(r"\b(RPAR|LPAR|RBRACE|LBRACE|RSQB|LSQB|NAME|INT|FLOAT|STRING|COMMA|"
                       r"EQUAL|COLON|SEMICOLON|MUL_OP|ADD_OP|COMP_OP|POW|\$END|__ANON\w*)\b")


@pytest.mark.parametrize("src", [c[1] for c in SYNTAX], ids=[c[0] for c in SYNTAX])
def test_syntax_errors_use_words(src):
    msg = fails(src).message
    assert not RAW_TOKEN.search(msg), msg
    assert "..." not in msg


def test_syntax_cases_cover_many_forms():
    assert len(SYNTAX) >= 10


# -- errors inside blocks: the call-site chain --------------------------------------------
CHAIN = """\
block inner(x) {
    h = flatten(x)
    return conv2d(h, 4)
}
block outer(x) {
    return inner(x)
}
network n {
    input x: f32[N, 3, 8, 8]
    h = outer(x)
    output h
}
"""


def test_error_in_nested_block_has_call_chain():
    e = fails(CHAIN)
    (d,) = e.diagnostics
    assert d.message.startswith("conv2d expects a 4-d input, but `h` (from flatten at line 2")
    assert (d.loc.line, d.loc.column) == (3, 12)
    assert [(s.block, s.loc.line, s.loc.column) for s in d.stack] == [
        ("outer", 10, 9), ("inner", 6, 12)]


def test_error_in_imported_block_is_located_in_its_file(tmp_path):
    (tmp_path / "lib.net").write_text("block head(x) {\n    return linear(x, 10)\n}\n")
    main = tmp_path / "main.net"
    main.write_text('import "lib.net" as lib\nnetwork n {\n    input x: f32[N, 4]\n'
                    '    output lib.head(conv2d(x, 3))\n}\n')
    with pytest.raises(NetdslError) as info:
        netdsl.load(main)
    d = info.value.diagnostics[0]
    assert "conv2d expects a 4-d input" in d.message
    assert (d.loc.line, d.loc.column) == (4, 21)
    main.write_text('import "lib.net" as lib\nnetwork n {\n    input x: f32[N, 4]\n'
                    '    output lib.head(x, 3)\n}\n')
    with pytest.raises(NetdslError) as info:
        netdsl.load(main)
    assert "block `head` takes at most 1 positional arguments" in info.value.message
    main.write_text('import "lib.net" as lib\nnetwork n {\n    input x: f32[N, 4]\n'
                    '    h = lib.head(x)\n    output h + x\n}\n')
    with pytest.raises(NetdslError) as info:
        netdsl.load(main)
    assert (info.value.loc.line, info.value.loc.column) == (5, 12)
    (tmp_path / "lib.net").write_text("block head(x) {\n    return linear(x, zz)\n}\n")
    main.write_text('import "lib.net" as lib\nnetwork n {\n    input x: f32[N, 4]\n'
                    '    output lib.head(x)\n}\n')
    with pytest.raises(NetdslError) as info:
        netdsl.load(main)
    d = info.value.diagnostics[0]
    assert d.loc.file.endswith("lib.net") and (d.loc.line, d.loc.column) == (2, 22)
    assert d.stack[0].loc.file == str(main) and d.stack[0].loc.line == 4


def test_error_inside_repeat_is_reported_once():
    src = """\
block b(x) {
    return linear(x, 4)
}
network n {
    input x: f32[N, 8]
    h = x
    repeat 50 {
        h = b(h) + h
    }
    repeat 30 {
        h = relu(hh)
    }
    output h
}
"""
    e = fails(src)
    assert [d.message.split(":")[0] for d in e.diagnostics] == ["add", "`hh` is not defined; did you mean `h`?"]
    assert [(d.loc.line, d.loc.column) for d in e.diagnostics] == [(8, 13), (11, 18)]


def test_error_in_block_called_in_repeat_is_reported_once_with_its_stack():
    src = """\
block b(x) {
    return relu(x) + linear(x, 3)
}
network n {
    input x: f32[N, 8]
    repeat 790 {
        x = b(x)
    }
    output x
}
"""
    (d,) = fails(src).diagnostics
    assert (d.loc.line, d.loc.column) == (2, 12)
    assert [(s.block, s.loc.line) for s in d.stack] == [("b", 7)]


# -- imports -------------------------------------------------------------------------------
def test_import_missing_module():
    e = fails("import nosuch\nnetwork n {\n    input x: f32[N, 4]\n    output x\n}\n")
    assert "cannot import `nosuch`: there is no nosuch.net next to this file and no stdlib " \
           "module of that name (the stdlib has: " in e.message
    assert (e.loc.line, e.loc.column) == (1, 1)


def test_import_missing_relative_file(tmp_path):
    f = tmp_path / "main.net"
    f.write_text('\nimport "sub/blocks.net" as b\nnetwork n {\n    input x: f32[N, 4]\n'
                 '    output x\n}\n')
    with pytest.raises(NetdslError) as info:
        netdsl.load(f)
    assert 'cannot import "sub/blocks.net": no file' in info.value.message
    assert (info.value.loc.line, info.value.loc.column) == (2, 1)


def test_import_cycle(tmp_path):
    (tmp_path / "a.net").write_text('import "b.net" as b\nblock fa(x) {\n    return x\n}\n')
    (tmp_path / "b.net").write_text('# b imports a\nimport "a.net" as a\n'
                                    'block fb(x) {\n    return x\n}\n')
    with pytest.raises(NetdslError) as info:
        netdsl.load(tmp_path / "a.net")
    (d,) = info.value.diagnostics
    assert d.message == "import cycle: a.net -> b.net -> a.net"
    assert d.loc.file.endswith("b.net") and (d.loc.line, d.loc.column) == (2, 1)


def test_import_twice_and_block_shadowing_import():
    e = fails("import resnet\nimport resnet\nblock resnet(x) {\n    return x\n}\n"
              "network n {\n    input x: f32[N, 4]\n    output x\n}\n")
    assert [(d.message, d.loc.line, d.loc.column) for d in e.diagnostics] == [
        ("`resnet` is imported twice", 2, 1),
        ("block `resnet` is defined twice in this file (the name of an import)", 3, 7)]


# -- several independent errors in one run --------------------------------------------------
def test_several_errors_in_one_run_in_source_order():
    src = """\
network n {
    input x: f32[N, 4]
    input w: f33[N, 4]
    a = rleu(x)
    b = linear(x, 4, bais=true)
    c = x + linear(x, 5)
    d = linear(w, 3)
    @fast
    e = relu(x)
    output a, b, c, d, e
    loss x
}
train {
    batch = 0
}
"""
    e = fails(src)
    got = [(d.loc.line, d.loc.column, d.message.split(";")[0].split(":")[0])
           for d in e.diagnostics]
    assert got == [
        (3, 14, "unknown element type `f33`"),
        (4, 9, "`rleu` is not defined"),
        (5, 22, "linear() has no argument `bais`"),
        (6, 9, "add"),
        (8, 5, "unknown annotation @fast (known"),
        (11, 10, "the loss must be a scalar, but it is f32[N, 4]"),
        (14, 5, "invalid train section"),
    ]
    # the poisoned names (a, b, c, d, w) report nothing more
    assert len(e.diagnostics) == 7


def test_failed_statement_poisons_without_cascade():
    e = fails(net("if 3 {\n    h = x\n    g = x\n}\n@nope\nk = relu(x)\noutput h, g, k"))
    assert [d.loc.line for d in e.diagnostics] == [4, 8]


# -- snapshots of the whole rendered text ----------------------------------------------------
def test_snapshot_shape_error_in_block_chain():
    assert fails(CHAIN, file="examples/bad.net").render() == """\
examples/bad.net:3:12: error: conv2d expects a 4-d input, but `h` (from flatten at line 2, column 9) is f32[N, 192]
    3 |     return conv2d(h, 4)
      |            ^^^^^^
    in block `inner`, called from examples/bad.net:6:12
    in block `outer`, called from examples/bad.net:10:9"""


def test_snapshot_syntax_error():
    src = "network n {\n    input x: f32[N, 4]\n    h = relu(x\n    output h\n}\n"
    assert fails(src).render() == """\
bad.net:4:5: error: syntax error: unexpected keyword `output`; expected an operator, `)`, `,` or `=` (the `(` at line 3, column 13 is never closed)
    4 |     output h
      |     ^"""


def test_snapshot_undefined_name_and_train():
    src = net("h = rleu(x)\noutput h") + "train {\n    optimizer = sgd(lr=0)\n}\n"
    assert fails(src).render() == """\
bad.net:4:9: error: `rleu` is not defined; did you mean `relu`?
    4 |     h = rleu(x)
      |         ^^^^
bad.net:8:5: error: invalid train section: `optimizer.lr` must be greater than 0, not 0
    8 |     optimizer = sgd(lr=0)
      |     ^^^^^^^^^"""


def test_json_form_of_an_error():
    j = fails(CHAIN).to_json()
    assert j["errors"][0]["location"] == {"file": "bad.net", "line": 3, "column": 12}
    assert [s["block"] for s in j["errors"][0]["stack"]] == ["outer", "inner"]


def test_annotation_arguments_see_the_statement_scope():
    """`@stage(i)` may use a repeat index, and a block's annotations its parameters."""
    net = netdsl.loads(textwrap.dedent("""
        @stage(k)
        block part(x, k) {
            return relu(x)
        }
        network n {
            parallel { pipeline = 4; microbatches = 4 }
            input x: f32[N, 4]
            h = x
            repeat 2 as i {
                @stage(i)
                h = relu(h)
            }
            output part(h, 3)
        }
    """), "st.net")
    stages = [n.annotations.get("stage") for n in net.graph.nodes if n.op == "relu"]
    assert stages == [0, 1, 3]
