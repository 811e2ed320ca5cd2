"""The pass pipeline: named Graph -> Graph steps, each followed by `verify()`.

A pass is registered once with `@register_pass(name)` (netdsl.passes.registry, re-exported
here); a pipeline is a list of names, or (name, options) pairs, run in order:

    g = run_pipeline(forward, ["autodiff", ("optimizer", {"kind": "sgd", "lr": 0.1})])

After every step the graph is verified (a pass that breaks an IR invariant is caught at
the step that broke it, not at run time; a pass does not verify its own result, so a split
step of hundreds of thousands of nodes is verified once a step, not twice), and with
`dump=DIR` (or the NETDSL_DUMP_IR environment variable) its readable IR is written to
`DIR/NN-name.ir`, so a user or a test can see what each step did. Later layers register
their own passes (the memory planner registers "memory", the splitter "sync_gradients");
`PASSES` lists what is known.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from netdsl.errors import NetdslError
from netdsl.ir.bulk import gc_paused
from netdsl.ir.graph import Graph
from netdsl.passes import (  # noqa: F401  (they register)
    autodiff,
    device,
    fuse,
    optimizer,
    precision,
)
from netdsl.passes.registry import PASSES, Pass, register_pass

__all__ = ["DUMP_ENV", "PASSES", "Pass", "Step", "register_pass", "run_pipeline"]

DUMP_ENV = "NETDSL_DUMP_IR"

Step = str | tuple[str, dict[str, Any]]


@gc_paused()  # (each pass copies or rebuilds the graph: netdsl.ir.bulk)
def run_pipeline(g: Graph, steps: Sequence[Step], *, dump: str | Path | None = None,
                 recheck_shapes: bool = True) -> Graph:
    """Run `steps` on `g` in order, verifying after each; see the module docstring.
    `recheck_shapes=False` leaves re-running every shape rule to the caller's final
    verify (a split step of half a million nodes spends most of its build in them; every
    node a pass makes got its type from its shape rule already)."""
    dump = dump if dump is not None else os.environ.get(DUMP_ENV) or None
    if dump is not None:
        Path(dump).mkdir(parents=True, exist_ok=True)
        (Path(dump) / "00-input.ir").write_text(g.to_text())
    for k, step in enumerate(steps, start=1):
        name, options = (step, {}) if isinstance(step, str) else step
        if name not in PASSES:
            raise NetdslError(f"unknown pass `{name}`; the passes are "
                              f"{', '.join(sorted(PASSES))}")
        g = PASSES[name].fn(g, **options)
        g.verify(recheck_shapes=recheck_shapes)
        if dump is not None:
            (Path(dump) / f"{k:02d}-{name}.ir").write_text(g.to_text())
    return g

