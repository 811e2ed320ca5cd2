"""Command-line options made from their one declaration (`netdsl.options`): `option(name)`
is the annotated type of a command's parameter, its default `DEFAULTS.name`, and
`with_options(fn, model)` gives a command every field of a model as an option."""
from __future__ import annotations

import functools
import inspect
import typing
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any

import typer

from netdsl.options import RunOptions, cli_name, flag_of

DEFAULTS = RunOptions()
_HINTS = typing.get_type_hints(RunOptions)


def option(name: str, *aliases: str, model: type = RunOptions, help: str | None = None) -> Any:
    """The annotated type of option `name` (extra `aliases` where a command keeps an older
    spelling; `help` where a command says more than the declaration)."""
    flag = flag_of(model, name)
    hint = _HINTS[name]
    if flag.cli_type == "path":
        hint = Path | None
    elif flag.cli_type is not None:
        hint = flag.cli_type | None if _optional(hint) else flag.cli_type
    kw = {"help": help or flag.help}
    if flag.min is not None:
        kw["min"] = flag.min
    return Annotated[hint, typer.Option(*(flag.flags or (cli_name(name),)), *aliases, **kw)]


def _optional(hint) -> bool:
    return type(None) in typing.get_args(hint)


def with_options(model: type, leading: list[inspect.Parameter],
                 trailing: list[inspect.Parameter], exclude: tuple[str, ...] = ()):
    """Decorate `fn(**kwargs)` into a command whose parameters are `leading`, every field
    of `model` but `exclude` as an option (in declaration order), then `trailing`."""
    params = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                                annotation=option(f.name, model=model), default=f.default)
              for f in fields(model) if f.name not in exclude]

    def decorate(fn):
        @functools.wraps(fn)
        def command(**kwargs):
            return fn(**kwargs)
        everything = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
                      for p in (*leading, *params, *trailing)]
        command.__signature__ = inspect.Signature(everything)
        command.__annotations__ = {p.name: p.annotation for p in everything}
        del command.__wrapped__  # (typer reads the signature above, not fn's)
        return command
    return decorate


def options_from(model: type, kwargs: dict) -> Any:
    """The model built from a command's keyword arguments (paths as strings; a field the
    command does not take keeps its default)."""
    values = {f.name: kwargs[f.name] for f in fields(model) if f.name in kwargs}
    return model(**{k: str(v) if isinstance(v, Path) else v for k, v in values.items()})


# the options several commands take
BatchOpt = option("batch")
BackendOpt = option("backend")
DeviceOpt = option("device")
DtypeOpt = option("dtype")
PrecisionOpt = option("precision")
MemOpt = option("mem")
ProfileOpt = option("profile")
StrategyOpt = option("strategy")
OffloadStateOpt = option("offload_state")
MicrobatchesOpt = option("microbatches")
SplitOpt = option("split", "--strategy")  # (`split` took the scheme as --strategy)
ScheduleOpt = option("schedule")
BnOpt = option("bn")
ShardOpt = option("shard")
VirtualStagesOpt = option("virtual_stages")
InterconnectOpt = option("interconnect")
JobsOpt = option("jobs")
SeedOpt = option("seed")
