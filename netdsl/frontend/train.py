"""The `train { }` section: settings evaluated to plain data, validated by TrainConfig.

`optimizer = sgd(lr=0.1, momentum=0.9)` becomes {"kind": "sgd", "lr": 0.1, ...}.
"""
from __future__ import annotations

from pydantic import ValidationError

from netdsl.config import TrainConfig
from netdsl.errors import Diagnostic, NetdslError
from netdsl.frontend import ast


class _Bad(Exception):
    def __init__(self, msg, loc):
        self.msg, self.loc = msg, loc


def _value(e: ast.Expr):
    if isinstance(e, ast.Const):
        return e.value
    if isinstance(e, ast.TupleExpr):
        return [_value(x) for x in e.items]
    if isinstance(e, ast.Unary) and e.op == "-":
        v = _value(e.operand)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return -v
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Name):
        if e.args:
            raise _Bad(f"{e.func.id}() takes keyword arguments only, e.g. "
                       f"{e.func.id}(lr=0.1)", e.args[0].loc)
        return {"kind": e.func.id, **{k: _value(v) for k, v, _ in e.kwargs}}
    if isinstance(e, ast.Name):
        return {"kind": e.func.id} if isinstance(e, ast.Call) else {"kind": e.id}
    raise _Bad("a train setting must be a constant or a call like sgd(lr=0.1)", e.loc)


def train_config(tdef: ast.TrainDef | None) -> TrainConfig | None:
    if tdef is None:
        return None
    data, locs, diags = {}, {}, []
    for s in tdef.settings:
        if s.name in data:
            diags.append(Diagnostic(f"train setting `{s.name}` is given twice", s.loc))
            continue
        try:
            data[s.name] = _value(s.value)
            locs[s.name] = s
        except _Bad as b:
            diags.append(Diagnostic(b.msg, b.loc))
    if diags:
        raise NetdslError(diagnostics=diags)
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as e:
        for err in e.errors():
            path = [p for p in err["loc"] if isinstance(p, str)]
            setting = locs.get(path[0]) if path else None
            loc = setting.loc if setting else tdef.loc
            field = ".".join(p for p in path if p not in ("sgd", "adam", "adamw", "step",
                                                            "cosine", "constant", "synthetic",
                                                            "digits", "npz"))
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                top = path[0] if path else "?"
                if len(path) == 1:
                    msg = (f"unknown train setting `{top}` (known: "
                           f"{', '.join(TrainConfig.model_fields)})")
                else:
                    msg = f"`{path[-1]}` is not an argument of this {top}"
            elif err["type"] == "union_tag_invalid":
                kinds = err["ctx"]["expected_tags"]
                msg = f"unknown {path[0]} `{err['ctx']['tag']}`; use one of {kinds}"
            elif err["type"] == "model_attributes_type" or err["type"] == "model_type":
                msg = f"`{field}` must be a call like sgd(lr=0.1)"
            else:
                msg = f"`{field}`: {msg}" if field else msg
            diags.append(Diagnostic(f"invalid train section: {msg}", loc))
        raise NetdslError(diagnostics=diags) from None
