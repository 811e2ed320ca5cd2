"""Checking a file costs work in proportion to its size (issue 10: a 10 MB file checks in
seconds, not minutes).

Not a timed test: the work is the number of Python lines executed (line events of a
tracer, in every module: netdsl, Lark, the standard library, generated dataclass code)
to do what `netdsl check` does (parse, elaborate, verify, bind the batch, statistics) for
programs of n, 2n and 4n statements. Linear work grows by equal steps, so the second step
is twice the first; a step per statement that scans everything before it (a quadratic
term) makes the ratio grow well past 2 (a scan of one line per earlier statement already
gives about 2.7 here).
"""
from __future__ import annotations

import sys
import threading

import netdsl
from netdsl.frontend.descent import parse_items
from netdsl.ir.stats import summarize


def program(n: int) -> str:
    lines = ["block mix(x, k=2) {", "    y = relu(x) * 0.5", "    return x + y", "}",
             "network big {", "    input x: f32[N, 16]", "    h = x"]
    for i in range(n):
        lines.append(f"    h = relu(h + linear(h, 16, bias=false) * 0.5)  # step {i}")
        if i % 4 == 0:
            lines += ["    @recompute", f"    h = mix(h, k={i % 3})"]
        if i % 8 == 0:
            lines += ["    repeat 2 as j { h = h + relu(h) }",
                      "    if i > 0 { h = h * 2 } else { h = -h }".replace("i > 0", f"{i} > 0")]
    return "\n".join(lines + ["    output h", "}"]) + "\n"


def lines_executed(text: str) -> int:
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    old = sys.gettrace()
    threading.settrace(tracer)  # the front end runs on a thread of its own (deep.py)
    sys.settrace(tracer)
    try:
        net = netdsl.loads(text, file="big.net")
        summarize(net.lower(1))
    finally:
        sys.settrace(old)
        threading.settrace(None)
    return count


def test_checking_work_grows_linearly_with_the_program():
    n = 120
    texts = [program(n), program(2 * n), program(4 * n)]
    assert all(parse_items(t, "big.net") is not None for t in texts)  # the fast parser
    lines_executed(texts[0])  # warm up: first-use work (parser tables, imports) once
    w1, w2, w4 = (lines_executed(t) for t in texts)
    first, second = w2 - w1, w4 - w2
    assert first > 0
    ratio = second / first
    assert 1.9 <= ratio <= 2.15, (
        f"checking {n}, {2 * n} and {4 * n} statements executed {w1:,}, {w2:,} and {w4:,} "
        f"lines: the second step is {ratio:.2f}x the first (linear: 2)")
