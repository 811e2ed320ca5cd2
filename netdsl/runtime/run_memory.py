"""What a run checks before and while it steps: that the planned step fits what is free
now, and, when a step's loss goes non-finite, the first node that made it so."""
from __future__ import annotations

from netdsl.errors import NetdslError, NonFinite
from netdsl.ir.graph import Graph
from netdsl.step import room


def refuse_what_cannot_fit(need: int, state: int, backend, batch: int, budget: int | None,
                           comm=None, devices: int = 1) -> None:
    """Refuse, before the first step, a step whose planned peak `need` (with what the
    process holds besides its plan) is more than the memory left once the `state` is
    allocated: Linux lets the allocations through and then kills the process, and a GPU's
    step would fail only after the build. The plan's peak is the executor's own count, so
    the refusal is not a guess. Over MPI (`comm`) the ranks that share one machine's memory
    (or one GPU) are counted together, each alone could fit where all of them cannot; so
    are the `devices` of a split run in one process (whose plan's peak is all of them)."""
    ranks, part = 1, "rank"
    if comm is None:
        free = room.available_bytes(backend)
        ranks, part = devices, "device"
    else:
        need, state, free, ranks = comm.memory_totals(
            getattr(backend, "device", 0) if backend.name == "cupy" else 0, need, state,
            lambda: room.available_bytes(backend))
    if free is not None and need - state > free:
        raise room.out_of_memory(need, backend, batch, "before the first step", free + state,
                                 budget, ranks, part)


def non_finite_error(executor, step_graph: Graph, losses: list[str], e: NonFinite,
                     feeds: dict, lr: float, step: int) -> NetdslError:
    """The loss (a node of `losses`) or logits of step `step + 1` went NaN/Inf; the step
    stopped before its updates, so replaying it with --check-numerics finds the first
    such node."""
    what = "loss" if e.node in losses else "logits"
    head = f"the {what} became NaN or Inf at step {step + 1} (lr {lr:g})"
    try:  # the same step number: the same dropout masks
        executor.with_graph(step_graph, check_numerics=True).run(
            feeds, training=True, roles=("loss",), step=step)
    except NetdslError as found:
        if not isinstance(found, NonFinite):
            where = found.message.removeprefix("check-numerics: ")
            return NetdslError(f"{head}: the first non-finite value: {where}; lower the "
                               "learning rate, or check the data and the initialisation",
                               loc=found.loc, stack=found.diagnostics[0].stack)
    return NetdslError(f"{head}; lower the learning rate or run with --check-numerics")


def replay_warnings(executor) -> list[str]:
    """NETDSL_CUDA_GRAPH=1: the kinds of run that were not replayed, and why."""
    rep = executor.replay
    if rep is None:
        return []
    return [f"NETDSL_CUDA_GRAPH: {'training' if training else 'evaluation'} runs were not "
            f"recorded as a CUDA graph: {why}" for (_, training), why in rep.reasons.items()]
