"""The one error type users see, and the source locations it points at.

Every failure caused by user input (a typo in a `.net` file, a shape mismatch, a corrupt
checkpoint, a missing GPU) is raised as a `NetdslError`; the CLI prints it and exits 1.
Anything else escaping is a bug in netdsl.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SourceLoc:
    """A position in a `.net` file; lines and columns count from 1."""

    file: str
    line: int
    column: int
    end_line: int | None = None
    end_column: int | None = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"

    def to_json(self) -> dict:
        return {"file": self.file, "line": self.line, "column": self.column}


@dataclass(frozen=True)
class CallSite:
    """One frame of the chain of block calls that led to a node or an error."""

    block: str
    loc: SourceLoc


_source_cache: dict[str, list[str]] = {}


def _lines(text: str) -> list[str]:
    # split on "\n" only, as the lexer counts lines: str.splitlines() also breaks at "\r",
    # "\f", "\x1c" and others, and then quoted the wrong line for a location
    return [ln.removesuffix("\r") for ln in text.split("\n")]


def register_source(file: str, text: str) -> None:
    """Remember a file's text so errors can quote its lines (also for in-memory sources)."""
    _source_cache[file] = _lines(text)


def source_line(file: str, line: int) -> str | None:
    lines = _source_cache.get(file)
    if lines is None:
        try:
            # as the loader reads it (a byte-order mark is not text); a byte that is not
            # UTF-8 must not turn the report of that very error into a crash
            with open(file, encoding="utf-8-sig", errors="replace") as fh:
                lines = _lines(fh.read())
        except OSError:
            return None
        _source_cache[file] = lines
    if 1 <= line <= len(lines):
        return lines[line - 1]
    return None


@dataclass
class Diagnostic:
    """One error: a message, where it happened, and the block calls that led there."""

    message: str
    loc: SourceLoc | None = None
    stack: tuple[CallSite, ...] = ()
    notes: list[str] = field(default_factory=list)

    def render(self) -> str:
        head = f"{self.loc}: error: {self.message}" if self.loc else f"error: {self.message}"
        out = [head]
        if self.loc is not None:
            text = source_line(self.loc.file, self.loc.line)
            if text is not None:
                gutter = f"{self.loc.line:>5} | "
                out.append(gutter + text)
                width = 1
                if self.loc.end_line == self.loc.line and self.loc.end_column:
                    width = max(1, self.loc.end_column - self.loc.column)
                pad = " " * (len(gutter) - 2) + "| "
                out.append(pad + " " * (self.loc.column - 1) + "^" * width)
        # innermost call first: "in block `b`, called from FILE:LINE:COL"
        for site in reversed(self.stack):
            out.append(f"    in block `{site.block}`, called from {site.loc}")
        out.extend(f"    note: {n}" for n in self.notes)
        return "\n".join(out)

    def to_json(self) -> dict:
        return {
            "message": self.message,
            "location": self.loc.to_json() if self.loc else None,
            "stack": [{"block": s.block, **s.loc.to_json()} for s in self.stack],
            "notes": list(self.notes),
        }


class NetdslError(Exception):
    """An error caused by user input; carries one or more diagnostics. The command exits
    with `exit_code` (1; 3 for a memory budget no plan can meet)."""

    exit_code = 1

    def __init__(self, message: str | None = None, loc: SourceLoc | None = None,
                 stack: tuple[CallSite, ...] = (), diagnostics: list[Diagnostic] | None = None):
        if diagnostics is None:
            diagnostics = [Diagnostic(message or "unknown error", loc, tuple(stack))]
        self.diagnostics = diagnostics
        super().__init__(self.render())

    def __reduce__(self):
        # pickled with its attributes (a worker process raises it in rank 0: fanout),
        # not rebuilt from the rendered text as Exception's args would be
        return _rebuilt, (type(self), self.__dict__)

    @property
    def message(self) -> str:
        return self.diagnostics[0].message

    @property
    def loc(self) -> SourceLoc | None:
        return self.diagnostics[0].loc

    def render(self) -> str:
        return "\n".join(d.render() for d in self.diagnostics)

    def to_json(self) -> dict:
        return {"errors": [d.to_json() for d in self.diagnostics]}


def _rebuilt(cls: type, state: dict) -> NetdslError:
    e = cls.__new__(cls)
    e.__dict__.update(state)
    Exception.__init__(e, e.render())
    return e


class ShapeError(Exception):
    """Raised by operator shape rules; the front end turns it into a located NetdslError."""


class CheckpointError(NetdslError):
    pass


class DeviceError(NetdslError):
    pass


class NoSuchGpu(DeviceError):
    """A GPU number the machine does not have."""


class InteropError(NetdslError):
    """A model that cannot be exported to or imported from another format (ONNX)."""


class BudgetError(NetdslError):
    """No plan fits the memory budget: the message names the smallest budget that works
    and what dominates it. Exit code 3."""

    exit_code = 3


class SplitError(NetdslError):
    """A parallel split that cannot be made (more stages than layers, a batch that does not
    divide over the devices, a device whose part does not fit its memory). Exit code 3."""

    exit_code = 3


class CommError(NetdslError):
    """A communication failure between devices or ranks: a peer that failed, was killed
    or did not answer in time. The message names the rank."""


class NonFinite(NetdslError):
    """A watched node (`Executor.stop_if_nonfinite`) produced NaN or Inf; the run stopped
    before the nodes after it, so the state is as it was before the step's updates."""

    def __init__(self, node: str):
        self.node = node
        super().__init__(f"`{node}` produced NaN or Inf")
