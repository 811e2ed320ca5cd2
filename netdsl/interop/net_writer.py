"""Write a `Program` (flat netdsl calls) as a readable `.net` file: the blocks `net_fold`
finds, the network body calling them (equal consecutive calls as `repeat k { ... }`), and
single-use values nested into the expression that reads them.

Calls stay in program order, so the nodes the `.net` elaborates to come in the same order
as the program's calls (onnx_import maps the weights by that order).
"""
from __future__ import annotations

from collections import Counter

from netdsl.interop.net_fold import ABSTRACT, BlockType, block_types, call_args, segments
from netdsl.interop.onnx_read import Call, Program, net_name
from netdsl.ir import registry
from netdsl.ir.ops._util import pair

MAX_NEST = 3  # calls nested in one expression
_INFIX = {"add": "+", "sub": "-", "mul": "*"}


def literal(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "none"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return v if v == "N" else f'"{v}"'
    if isinstance(v, (tuple, list)):
        inner = ", ".join(literal(x) for x in v)
        return f"({inner},)" if len(v) == 1 else f"({inner})"
    return str(v)


def format_call(c: Call, args: list[str], value_of=None) -> str:
    """`op(args, required..., key=value...)` with defaults left out; `value_of(k, v)` may
    replace an attribute's text (a block parameter)."""
    if c.op in _INFIX:
        return f"{args[0]} {_INFIX[c.op]} {args[1]}"
    if c.op == "parameter":  # the builtin, not an operator: a free trainable tensor
        return f"parameter({literal(c.attrs['shape'])})"
    op = registry.get(c.op)
    parts: list[str] = []
    ai = 0
    for a in op.signature:
        if a.kind == "tensor":
            parts.append(args[ai])
            ai += 1
            continue
        if a.kind == "tensors":
            parts.extend(args[ai:])
            ai = len(args)
            continue
        if a.name not in c.attrs:
            continue
        v = c.attrs[a.name]
        text = value_of(a.name, v) if value_of else None
        if a.required:
            parts.append(text or literal(v))
            continue
        default = a.default
        src = op.extra.get("default_from", {}).get(a.name)
        if default is None and src is not None:
            default = c.attrs.get(src)
        if text is None and _same(a.kind, v, default):
            continue
        parts.append(f"{a.name}={text or literal(v)}")
    return f"{c.op}({', '.join(parts)})"


def _same(kind, v, default) -> bool:
    if kind == "pair" and default is not None and v is not None:
        return pair(v) == pair(default)
    if kind == "float" and default is not None:
        return abs(float(v) - float(default)) <= 1e-12 * max(1.0, abs(float(default)))
    return v == default


# -- text -----------------------------------------------------------------------------------------

class _Body:
    """Statements for a run of calls; single-use values are nested into their reader."""

    def __init__(self, names: dict[str, str], fresh):
        self.names = names
        self.fresh = fresh
        self.lines: list[str] = []
        self.pending: dict[str, tuple[str, int]] = {}  # value -> (expression, depth)
        self.infix: dict[str, bool] = {}  # pending value -> is an infix expression

    def arg(self, v: str, infix: bool) -> tuple[str, int]:
        if v in self.pending:
            expr, depth = self.pending.pop(v)
            # an infix operand that is itself an infix expression keeps its parentheses
            if infix and self.infix.pop(v, False):
                expr = f"({expr})"
            return expr, depth
        return self.names[v], 0

    def add(self, c: Call, uses: Counter, next_args: list[str], value_of=None,
            inline_ok: bool = True) -> None:
        parts = [self.arg(a, c.op in _INFIX) for a in c.args]
        depth = 1 + max((d for _, d in parts), default=0)
        expr = format_call(c, [e for e, _ in parts], value_of)
        if (inline_ok and c.out not in self.names and uses[c.out] == 1 and c.out in next_args
                and depth < MAX_NEST):
            self.pending[c.out] = (expr, depth)
            self.infix[c.out] = c.op in _INFIX
            return
        name = self.names.setdefault(c.out, self.fresh(c.out))
        self.lines.append(f"{name} = {expr}")


def _uses(calls: list[Call], outputs) -> Counter:
    u = Counter(a for c in calls for a in c.args)
    u.update(outputs)
    return u


def write_block(bt: BlockType) -> list[str]:
    s = bt.instances[0]
    count = iter(range(1, 10**9))
    names = {s.input: "x"}
    body = _Body(names, lambda v: "h" if (k := next(count)) == 1 else f"h{k}")
    uses = _uses(s.calls, [s.out])
    pos = 0
    for j, c in enumerate(s.calls):
        abstract = [k for k in c.attrs if k in ABSTRACT]
        mine = {k: bt.columns[pos + i] for i, k in enumerate(abstract)}
        pos += len(abstract)
        value_of = (lambda m: lambda k, v: bt.params[m[k]] if m.get(k) is not None else None)(mine)
        nxt = s.calls[j + 1].args if j + 1 < len(s.calls) else []
        last = j == len(s.calls) - 1
        body.add(c, uses, nxt, value_of, inline_ok=not last)
    ret = names[s.out]
    lines = body.lines
    if lines and lines[-1].startswith(f"{ret} = "):
        lines[-1] = "return " + lines[-1][len(ret) + 3:]
    else:
        lines.append(f"return {ret}")
    head = f"block {bt.name}({', '.join(['x'] + bt.params)}) {{"
    return [head] + ["    " + ln for ln in lines] + ["}"]


def write_net(p: Program, header: list[str], classifier: bool) -> str:
    segs = segments(p)
    types = block_types(segs)
    out_names = {}
    for k, o in enumerate(p.outputs):
        base = "logits" if classifier else "out"
        out_names[o] = base if k == 0 else f"{base}{k + 1}"
    names = dict(out_names)
    for name, _ in p.inputs:
        names[name] = "x" if len(p.inputs) == 1 else _input_name(name)
    cut_values = {s.out for s in segs}
    count = iter(range(1, 10**9))
    body = _Body(names, lambda v: "h" if v in cut_values else f"v{next(count)}")
    uses = _uses(p.calls, p.outputs)
    block_lines: list[tuple[str, str]] = []  # (statement, block name or "")
    for si, s in enumerate(segs):
        bt = types.get(id(s))
        if bt is not None:
            if body.pending:  # a block call reads names, not nested expressions
                v, (e, _) = next(iter(body.pending.items()))
                body.pending.clear()
                body.lines.append(f"{body.names.setdefault(v, body.fresh(v))} = {e}")
            args = [names[s.input]] + [literal(a) for a in call_args(bt, s)]
            target = names.setdefault(s.out, body.fresh(s.out))
            body.lines.append(f"{target} = {bt.name}({', '.join(args)})")
            continue
        for j, c in enumerate(s.calls):
            if j + 1 < len(s.calls):
                nxt = s.calls[j + 1].args
            else:  # the next segment's first call, unless that segment is a block call
                after = segs[si + 1] if si + 1 < len(segs) else None
                nxt = after.calls[0].args if after is not None and id(after) not in types else []
            body.add(c, uses, nxt)
    block_lines = _fold_repeats(body.lines, {bt.name for bt in types.values()})

    out = list(header)
    done = set()
    for s in segs:
        bt = types.get(id(s))
        if bt is not None and bt.name not in done:
            done.add(bt.name)
            out += write_block(bt) + [""]
    out.append(f"network {p.name} {{")
    for name, t in p.inputs:
        out.append(f"    input {names[name]}: {t}")
    if classifier:
        out.append("    input y: i64[N]")
    out.append("")
    out += ["    " + ln for ln in block_lines]
    out.append("")
    out.append("    output " + ", ".join(out_names[o] for o in p.outputs))
    if classifier:
        out.append(f"    loss softmax_cross_entropy({out_names[p.outputs[0]]}, y)")
    out.append("}")
    return "\n".join(out) + "\n"


def _fold_repeats(lines: list[str], blocks: set[str]) -> list[str]:
    out, i = [], 0
    while i < len(lines):
        j = i
        while j + 1 < len(lines) and lines[j + 1] == lines[i]:
            j += 1
        callee = lines[i].split("= ", 1)[-1].split("(", 1)[0]
        if j > i and callee in blocks:
            out += [f"repeat {j - i + 1} {{", "    " + lines[i], "}"]
        else:
            out += lines[i:j + 1]
        i = j + 1
    return out


def _input_name(name: str) -> str:
    """An input's ONNX name as a netdsl name that no generated name (h, v1, y...) takes."""
    s = net_name(name)
    return s if s.startswith("in_") else "in_" + s
