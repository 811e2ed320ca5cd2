"""A step replayed as a CUDA graph (CuPy, opt-in: NETDSL_CUDA_GRAPH=1).

A small network's GPU step is host-bound: every kernel launch costs CuPy's Python dispatch
(tens of microseconds), far more than the launch's work on an H200. The step's graph is
static - the same kernels on the same shapes every step - so its launches can be recorded
once as a CUDA graph and replayed with one call. For each kind of run of an executor
(roles, training or not):

1. the first run is an ordinary run, on the backend's graph stream (it compiles the
   kernels and fills that stream's memory pool);
2. the second is captured: the inputs are copied into device buffers kept for replays,
   the run is recorded (nothing executes while recording) and then launched;
3. later runs copy their feeds into those buffers and launch the graph.

What replays differently, so the caller knows (docs/training.md):
- the outputs are the same arrays every run, overwritten by the next one: copy what you
  keep (the Trainer reads the loss and logits at once);
- host-side checks of device values run on the first run only (labels in range,
  maxpool's NaN test; a loss without ignored labels takes the general path), and a
  non-finite loss is noticed after the whole step, its updates included;
- random draws (dropout) read the step from a device buffer on a backend that has
  `device_rng` (CuPy's: netdsl.backends.counter_rng), which each replay sets, so every
  replay draws its own step's masks;
- runs that cannot be recorded run as before, and `reasons` says why: random draws
  from a host generator (a replay would repeat the masks), host transfers (offload), updates the f16
  loss scale may skip - each such node named with its source line - a split step,
  check_numerics, or a capture that failed (its error).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from netdsl.config import env_switch
from netdsl.errors import NonFinite
from netdsl.ir import registry

GRAPH_ENV = "NETDSL_CUDA_GRAPH"
_WHY = {"gate": ("is skipped on a step whose gradients overflowed (the f16 loss scale reads "
                 "its flag back)"),
        "random": "draws random numbers (a replay would repeat them)",
        "transfer": "moves values between memories ({})"}
_WARM = object()  # a kind run once, to be recorded on its next run


def wanted(backend) -> bool:
    """NETDSL_CUDA_GRAPH=1 and a backend that records graphs (CuPy's)."""
    return env_switch(GRAPH_ENV, False) and hasattr(backend, "capture")


@dataclass
class Recorded:
    graph: Any  # the backend's graph (cupy.cuda.Graph)
    inputs: dict[str, Any]  # input node -> the device buffer the graph reads
    outputs: dict[str, list]  # role -> the arrays the graph writes


class StepReplay:
    """Runs an executor's steps as described in the module docstring."""

    def __init__(self, executor):
        self.ex = executor
        # (roles, training) -> _WARM | Recorded | why it runs unrecorded
        self.kinds: dict[tuple, Any] = {}

    @property
    def reasons(self) -> dict[tuple, str]:
        """The kinds of run that run unrecorded, and why."""
        return {k: v for k, v in self.kinds.items() if isinstance(v, str)}

    def blocker(self, roles: tuple[str, ...]) -> str | None:
        """Why a run of `roles` cannot be recorded, or None."""
        ex = self.ex
        if ex.check_numerics:
            return "check_numerics reads every value back"
        if len(ex._devices) > 1:
            return "a split step (several devices)"
        on_device = hasattr(ex.backend, "device_rng")  # (draws keyed by a device step)
        found: dict[tuple, list[str]] = {}  # why -> the nodes, each with its source line
        for name in ex.plan(roles).order:
            n = ex.graph[name]
            op = registry.OPS[n.op]
            why = (("gate", "") if "gate" in n.meta
                   else ("random", "") if op.random and not on_device
                   else ("transfer", op.name) if op.layer_type == "transfer" else None)
            if why is not None:
                at = f" at {n.loc}" if n.loc is not None else ""
                found.setdefault(why, []).append(f"%{name} ({n.op}{at})")
        return "; ".join(f"{', '.join(names)}: {'each ' if len(names) > 1 else ''}"
                         f"{_WHY[kind].format(detail)}"
                         for (kind, detail), names in found.items()) or None

    def run(self, feeds: dict, training: bool, roles: tuple[str, ...], step: int | None):
        ex = self.ex
        key = (roles, training)
        kind = self.kinds.get(key)
        with ex.backend.graph_stream():
            if kind is None:
                self.kinds[key] = self.blocker(roles) or _WARM
            elif kind is _WARM:
                return self._record(key, feeds, training, roles, step)
            elif isinstance(kind, Recorded):
                return self._replay(kind, feeds, training, step)
            return ex._run(feeds, training, roles, step)

    def _record(self, key, feeds, training, roles, step):
        ex = self.ex
        inputs = {name: ex._feed(ex.graph[name], feeds) for name in ex.plan(roles).order
                  if ex.graph[name].op == "input"}
        ex.write_step(ex.step if step is None else step)  # (before: the capture reads it)
        try:
            graph, outputs = ex.backend.capture(
                lambda: ex._run(feeds, training, roles, step, inputs=inputs, capturing=True))
        except Exception as e:  # nothing ran while recording: run it as before
            cause = e.__cause__ or e  # the array library's own error, under the node's
            where = f" ({str(e).splitlines()[0][:300]})" if cause is not e else ""
            why = f"the capture failed: {type(cause).__name__}: {cause}{where}"
            self.kinds[key] = why
            return ex._run(feeds, training, roles, step)
        rec = Recorded(graph, inputs, outputs)
        self.kinds[key] = rec
        ex.backend.replay(graph)  # recording ran nothing: this is the step
        self._check(outputs)
        return {r: list(v) for r, v in outputs.items()}

    def _replay(self, rec: Recorded, feeds, training, step):
        ex = self.ex
        for name, buf in rec.inputs.items():
            ex.xp.copyto(buf, ex._feed(ex.graph[name], feeds))
        at = ex.step if step is None else step
        ex.write_step(at)  # the random draws' step, read by the recorded kernels
        if training:
            ex.step = at + 1
        ex.backend.replay(rec.graph)
        self._check(rec.outputs)
        return {r: list(v) for r, v in rec.outputs.items()}

    def _check(self, outputs: dict[str, list]) -> None:
        """The watched nodes' values (the loss, the logits), after the step."""
        ex = self.ex
        if not ex.stop_if_nonfinite:
            return
        for role, arrays in outputs.items():
            for name, v in zip(ex.graph.outputs[role], arrays, strict=True):
                if name in ex.stop_if_nonfinite and not bool(ex.xp.isfinite(v).all()):
                    raise NonFinite(name)
