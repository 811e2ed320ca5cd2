"""Fitting a step into memory: the budget a step as written needs planning into when it
does not fit the free memory (`budget_to_fit`), the fewest micro-batches whose step a
budget holds (`fewest_microbatches`), and the errors that say so."""
from __future__ import annotations

from netdsl.config import TrainConfig
from netdsl.errors import NetdslError
from netdsl.ir.graph import Graph
from netdsl.memory.plan import make_plan, unplanned_bytes, value_bytes
from netdsl.sizes import format_bytes
from netdsl.step import room
from netdsl.step.graphs import accumulating_step, roles_of
from netdsl.step.request import StepRequest


def held_besides_plan(step: Graph, dtype: str, on_host: bool) -> int:
    """What a process running `step` holds besides its storage plan in the memory that
    `room` reads: where the step runs on the host, the fed batch and the interpreter's
    objects (`memory.plan.unplanned_bytes`; over MPI `step` is this rank's part); on a
    GPU those are host memory, not the device's."""
    return unplanned_bytes(step, dtype) if on_host else 0


def budget_to_fit(step: Graph, req: StepRequest) -> tuple[str | None, tuple[int, int] | None,
                                                         str | None]:
    """For a step run on one device without --mem: (None, ...) when `step` as written fits
    the free memory, else the budget within it to plan the step into (what the refusal
    would tell the user to give), with (what it needs, what is free) and a warning."""
    free = req.free_bytes
    if free is None:
        return None, None, None
    need = (make_plan(step, roles_of(step), req.dtype, pack_arena=False).peak_bytes
            + held_besides_plan(step, req.dtype, req.device_kind == "cpu"))
    if need <= free:
        return None, (need, free), None
    mem = room.budget_within(free)
    where = room.where_kind(req.device_kind)
    return mem, (need, free), (
        f"the step as written needs about {format_bytes(need)} and about "
        f"{format_bytes(free)} is free on {where}: planned into --mem {mem} (activations "
        "recomputed or offloaded, so a step takes longer; give --mem to choose the budget)")


def cannot_fit_even_planned(as_written: tuple[int, int], failed, batch: int, where: str,
                            fitting: int | None = None) -> NetdslError:
    """The error for a run without --mem whose step fits the free memory neither as
    written nor planned (`failed`: the plan's result; `fitting`: micro-batches a plan of
    whose step would fit)."""
    need, free = as_written
    return NetdslError(
        f"out of memory before the first step: a training step needs about "
        f"{format_bytes(need)} as written (at batch {batch}), about "
        f"{format_bytes(free)} is free on {where}, and no memory plan "
        f"fits {format_bytes(failed.budget_bytes)} of it: the least a plan needs is about "
        f"{format_bytes(failed.min_feasible_bytes)}, "
        f"dominated by {failed.dominant or 'the persistent state'}; use a smaller batch "
        f"(e.g. --batch {max(batch // 2, 1)}: activations shrink with it)"
        f"{room.ACCUMULATE if batch > 1 else ''}, or a smaller network"
        f"{fits_with(fitting)}")


def fewest_microbatches(forward: Graph, batch: int, cfg: TrainConfig, failed, plan,
                        have: int = 1, device: str = "cpu", float_dtype: str = "f32",
                        tries: int = 3, max_nodes: int = 100_000) -> int | None:
    """The fewest micro-batches above `have` that divide the batch (any count where
    none does) whose accumulating step a plan fits, for a budget that no plan of the step
    in `have` parts meets (`failed`: that PlanResult), or None. `plan(step)` plans a step
    into the budget and returns its PlanResult. The activations shrink about in
    proportion to the parts while the state and workspace stay, and from two parts on
    every parameter's gradient is held from the first part's backward to the update (a
    plain step frees each at its update): the search starts at the count that predicts
    and walks down the counts while they fit, up while they do not (`tries` plans at
    most; none where the state, workspace and gradients alone are over the budget).
    Counts whose copies of the forward graph would pass `max_nodes` nodes are not tried:
    this runs before an error, and building and planning such a step takes minutes."""
    fixed = failed.state_bytes + failed.workspace_bytes + failed.outside_plan_bytes
    grads = sum(value_bytes(p.type, float_dtype) for p in forward.params())
    # what shrinks with the parts: the failed plan's values less the gradients it held
    varying = (failed.min_feasible_bytes or 0) - fixed - (grads if have > 1 else 0)
    left = failed.budget_bytes - fixed - grads
    if left <= 0 or varying <= 0 or batch <= have:
        return None
    most = min(batch, max(have + 1, max_nodes // max(len(forward.nodes), 1)))
    counts = [m for m in range(have + 1, most + 1) if batch % m == 0]
    if not counts or counts == [batch]:  # (say a prime batch: parts need not be even)
        counts = list(range(have + 1, most + 1))
    guess = have * varying / left
    if guess > 2 * counts[-1]:  # (not even one sample a part comes near)
        return None
    k = next((i for i, m in enumerate(counts) if m >= guess), len(counts) - 1)
    best, tried = None, set()
    for _ in range(tries):
        if k in tried or not 0 <= k < len(counts):
            break
        tried.add(k)
        if plan(accumulating_step(forward, batch, cfg, counts[k], device=device)).feasible:
            best, k = counts[k], k - 1
        elif best is None:
            k += 1
        else:
            break
    return best


def fits_with(m: int | None) -> str:
    """The sentence a budget error ends with when `m` micro-batches fit (else nothing)."""
    return (f"; with --microbatches {m} (the gradients accumulated over {m} parts of the "
            "batch, one after the other) a plan fits") if m else ""
