"""The elaborator's evaluation state: a frame of local names, and the two signals that
unwind evaluation (a failed statement, a block's `return`)."""
from __future__ import annotations

from dataclasses import dataclass

from netdsl.frontend import ast
from netdsl.frontend.modules import ModuleEnv
from netdsl.frontend.values import POISON


class Fail(Exception):
    """Aborts the current statement; the diagnostic has already been recorded."""


class Return(Exception):
    """Carries a block's `return` value out of its body."""

    def __init__(self, value):
        self.value = value


@dataclass
class Frame:
    locals: dict
    module: ModuleEnv
    block: str | None  # None at network level



def poison_assigned(stmts, frame: Frame) -> None:
    """Bind every name a skipped body would have assigned to POISON."""
    for st in stmts:
        if isinstance(st, ast.Assign):
            for t in st.targets:
                frame.locals[t] = POISON
        elif isinstance(st, ast.Repeat):
            poison_assigned(st.body, frame)
        elif isinstance(st, ast.If):
            poison_assigned(st.body + st.orelse, frame)

