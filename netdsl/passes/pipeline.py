"""The pass pipeline: named Graph -> Graph steps, checked as they go.

A pass is registered once with `@register_pass(name)` (netdsl.passes.registry, re-exported
here); a pipeline is a list of names, or (name, options) pairs, run in order:

    g = run_pipeline(forward, ["autodiff", ("optimizer", {"kind": "sgd", "lr": 0.1})])

After every step the graph's structure is checked (`ir.verify.check_structure`: names,
order, ops, outputs), and after the last the whole of `verify()` runs once (every shape
rule again, meta keys, in-place effects): its cost grows with the graph, and a step of
tens of thousands of nodes spent most of its build verifying the same nodes after each
pass. `verify="each"` (or NETDSL_VERIFY_EACH=1) verifies wholly after every step, so a
pass that breaks an IR invariant is caught at the step that broke it; `verify="structure"`
leaves the final verify to the caller (a split step verifies once after its reorderings).
With `dump=DIR` (or the NETDSL_DUMP_IR environment variable) each step's readable IR is
written to `DIR/NN-name.ir`, so a user or a test can see what each step did. Later layers
register their own passes (the memory planner registers "memory", the splitter
"sync_gradients"); `PASSES` lists what is known.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from netdsl.errors import NetdslError
from netdsl.ir.bulk import gc_paused
from netdsl.ir.graph import Graph
from netdsl.ir.verify import check_structure
from netdsl.passes import (  # noqa: F401  (they register)
    autodiff,
    device,
    fuse,
    optimizer,
    precision,
)
from netdsl.passes.registry import PASSES, Pass, register_pass

__all__ = ["DUMP_ENV", "PASSES", "Pass", "Step", "VERIFY_ENV", "register_pass",
           "run_pipeline"]

DUMP_ENV = "NETDSL_DUMP_IR"
VERIFY_ENV = "NETDSL_VERIFY_EACH"
VERIFY_MODES = ("last", "each", "structure")

Step = str | tuple[str, dict[str, Any]]


@gc_paused()  # (each pass copies or rebuilds the graph: netdsl.ir.bulk)
def run_pipeline(g: Graph, steps: Sequence[Step], *, dump: str | Path | None = None,
                 verify: str = "last") -> Graph:
    """Run `steps` on `g` in order, checking after each; see the module docstring for
    `verify` ("last", "each" or "structure")."""
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, not {verify!r}")
    if os.environ.get(VERIFY_ENV, "") not in ("", "0"):
        verify = "each"
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
        if verify == "each" or (verify == "last" and k == len(steps)):
            g.verify()
        else:
            check_structure(g)
        if dump is not None:
            (Path(dump) / f"{k:02d}-{name}.ir").write_text(g.to_text())
    return g

