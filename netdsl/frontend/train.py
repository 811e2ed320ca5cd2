"""The `train { }` section: settings evaluated to plain data, validated by TrainConfig.

`optimizer = sgd(lr=0.1, momentum=0.9)` becomes {"kind": "sgd", "lr": 0.1, ...}.
"""
from __future__ import annotations

from pydantic import ValidationError

from netdsl.config import POSITIONAL, TrainConfig
from netdsl.errors import Diagnostic, NetdslError
from netdsl.frontend import ast

_KIND_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false",
               "string": "a string"}


def _show_input(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, dict) and "kind" in v:  # from `seed = N` or `lr = adam(...)`
        return f"`{v['kind']}`" if len(v) == 1 else f"{v['kind']}(...)"
    if isinstance(v, (list, tuple)):
        return "a tuple"
    return repr(v)


def pydantic_message(err: dict, field: str, describe=_show_input) -> str:
    """One Pydantic error in the words of the language: "`batch` must be an integer, not
    "big"" rather than "Input should be a valid integer, unable to parse string"."""
    t, ctx, v = err["type"], err.get("ctx", {}), err.get("input")
    what = f"`{field}`" if field else "the value"
    got = describe(v)
    for prefix, words in _KIND_WORDS.items():
        if t.startswith(prefix + "_"):
            return f"{what} must be {words}, not {got}"
    bounds = {"greater_than_equal": ("at least", "ge"), "greater_than": ("greater than", "gt"),
              "less_than_equal": ("at most", "le"), "less_than": ("less than", "lt")}
    if t in bounds:
        words, key = bounds[t]
        bound = ctx.get(key)
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)  # "greater than 0", not "greater than 0.0"
        return f"{what} must be {words} {bound}, not {got}"
    if t == "finite_number":
        return f"{what} must be a finite number, not {got}"
    if t == "literal_error":
        return f"{what} must be {ctx.get('expected', '').replace(chr(39), chr(34))}, not {got}"
    if t == "missing":
        return f"{what} is required"
    if t == "value_error":
        return str(ctx.get("error", err["msg"]))
    return f"{what}: {err['msg']}" if field else err["msg"]


# the kinds Pydantic names in an error's path: left out of the field named to the user
_KINDS = {"sgd", "adam", "adamw", "step", "cosine", "constant", "synthetic", "digits", "npz",
          "images", "arrays", "shards", "hf", "random_resized_crop", "random_crop", "flip",
          "resize", "center_crop", "normalize"}


class _Bad(Exception):
    def __init__(self, msg, loc):
        self.msg, self.loc = msg, loc


def _value(e: ast.Expr):
    if isinstance(e, ast.Const):
        return e.value
    if isinstance(e, ast.TupleExpr):
        return tuple(_value(x) for x in e.items)
    if isinstance(e, ast.Unary) and e.op == "-":
        v = _value(e.operand)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return -v
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Name):
        return {"kind": e.func.id, **_positional(e), **{k: _value(v) for k, v, _ in e.kwargs}}
    if isinstance(e, ast.Name):  # `schedule = cosine`: a call with no arguments
        return {"kind": e.id}
    raise _Bad("a train setting must be a constant or a call like sgd(lr=0.1)", e.loc)


def _positional(e: ast.Call) -> dict:
    """A call's positional arguments by name (`images("dir")`: path="dir"), for the calls
    that take them (config.POSITIONAL); the others take keywords only."""
    name, names = e.func.id, POSITIONAL.get(e.func.id, ())
    if len(e.args) > len(names):
        extra = e.args[len(names)]
        if not names and name not in _KINDS:
            return {}  # (an unknown call: the check names it, with the known ones)
        if not names:
            raise _Bad(f"{name}() takes keyword arguments only, e.g. {name}(lr=0.1)",
                       extra.loc)
        raise _Bad(f"{name}() takes at most {len(names)} positional argument(s) "
                   f"({', '.join(names)})", extra.loc)
    given = {k for k, _, _ in e.kwargs}
    for k, v in zip(names, e.args):
        if k in given:
            raise _Bad(f"{name}() is given `{k}` twice", v.loc)
    return {k: _value(v) for k, v in zip(names, e.args)}


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
    if "steps" in data and "epochs" in data:  # say where, not just "train section"
        later = max(locs["steps"], locs["epochs"], key=lambda s: (s.loc.line, s.loc.column))
        diags.append(Diagnostic("give either `steps` or `epochs` in the train section, not "
                                "both", later.loc))
    if diags:
        raise NetdslError(diagnostics=diags)
    try:
        # strict: `batch = "16"` or `batch = true` are mistakes, not 16 and 1
        return TrainConfig.model_validate(data, strict=True)
    except ValidationError as e:
        errs = []
        for err in e.errors():
            path = [p for p in err["loc"] if isinstance(p, str)]
            setting = locs.get(path[0]) if path else None
            loc = setting.loc if setting else tdef.loc
            errs.append((loc, err, path))
        # report in source order, as everywhere else
        errs.sort(key=lambda x: (x[0].line, x[0].column))
        for loc, err, path in errs:
            field = ".".join(p for p in path if p not in _KINDS)
            if err["type"] == "extra_forbidden":
                top = path[0] if path else "?"
                if len(path) == 1:
                    aside = ("val", "train_transforms", "eval_transforms",
                             *TrainConfig.STEP_SETTINGS)
                    loop = [k for k in TrainConfig.model_fields if k not in aside]
                    msg = (f"unknown train setting `{top}` (known: {', '.join(loop)}); the "
                           f"data's: {', '.join(aside[:3])}; of how the step computes: "
                           f"{', '.join(TrainConfig.STEP_SETTINGS)}")
                else:
                    kind = data.get(top, {}).get("kind", top)
                    msg = f"{kind}() has no argument `{path[-1]}`"
            elif err["type"] == "union_tag_invalid":
                kinds = err["ctx"]["expected_tags"].replace("'", "")
                msg = f"unknown {path[0]} `{err['ctx']['tag']}`; use one of {kinds}"
            elif err["type"] == "model_attributes_type" or err["type"] == "model_type":
                msg = f"`{field}` must be a call like sgd(lr=0.1)"
            else:
                msg = pydantic_message(err, field)
            diags.append(Diagnostic(f"invalid train section: {msg}", loc))
        raise NetdslError(diagnostics=diags) from None
