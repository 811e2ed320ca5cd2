"""Gradient accumulation on one device: the batch in micro-batches, each part's forward
then its backward, the gradients summed and one update (`run --microbatches M`, the
file's `parallel { microbatches = M }` declared alone, `plan --microbatches M`), and the
fewest parts whose step a memory budget holds, for the messages of a budget no plan of
the whole batch meets."""
from __future__ import annotations

from netdsl.config import ParallelConfig, TrainConfig
from netdsl.errors import NetdslError
from netdsl.ir.graph import Graph
from netdsl.memory.plan import value_bytes


def require_loss(forward: Graph) -> None:
    if "loss" not in forward.outputs:
        raise NetdslError(f"network `{forward.name}` declares no `loss`, so it cannot be "
                          "trained; add e.g. `loss softmax_cross_entropy(logits, y)`")


def accumulating_step(forward: Graph, batch: int, cfg: TrainConfig, microbatches: int,
                      schedule: str = "1f1b", gather: tuple[str, ...] = (),
                      device: str = "cpu") -> Graph:
    """The training step of unbound `forward` at `batch` on one device with its gradients
    accumulated over `microbatches` parts of the batch: netdsl.parallel's split onto one
    device, whose `1f1b` order runs each part's forward then its backward, so that one
    part's activations are alive at a time (`gpipe`: every forward first; the same numbers
    and no saving). The loss is the rows-weighted sum of the parts' losses, so the
    gradients are the whole batch's, except through batchnorm, which normalises each part
    with its own statistics (as a pipeline's micro-batches do; the running statistics are
    updated once, from every part's combined: parallel.syncbn.defer_running_stats).
    `gather`: outputs made whole (the trainer's logits).
    `device` ("cpu" or "gpu") picks the fusions and marks the kernels' variants, as
    `trainer.training_graph` does."""
    from netdsl.parallel.split import SplitSpec, split_step
    require_loss(forward)
    return split_step(forward, batch, SplitSpec(microbatches=microbatches,
                                                 schedule=schedule),
                      cfg.optimizer.model_dump(), gather, device=device)


def accumulation(forward: Graph, microbatches: int | None, schedule: str | None,
                 devices: int = 1) -> tuple[int, str]:
    """The micro-batches a one-device run accumulates its gradients over, and their
    order: `microbatches` (--microbatches), else the file's `parallel { microbatches }`
    declared alone (1: none). A split over devices takes them as its own."""
    declared = dict(forward.parallel)
    if devices > 1:
        return 1, "1f1b"
    alone = ParallelConfig(**declared).devices == 1
    m = microbatches if microbatches is not None else (
        declared.get("microbatches", 1) if alone else 1)
    return m, schedule or (declared.get("schedule") if alone else None) or "1f1b"


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
    most; none where the state, workspace and gradients alone are over the budget: a
    deep network's parameters, resnet2504's 3.7 GB, can make that so). Counts whose
    copies of the forward graph would pass `max_nodes` nodes are not tried: this runs
    before an error, and resnet2504's step in 16 parts took two minutes to build and
    plan."""
    fixed = failed.state_bytes + failed.workspace_bytes + failed.outside_plan_bytes
    grads = sum(value_bytes(p.type, float_dtype) for p in forward.params())
    # what shrinks with the parts: the failed plan's values less the gradients it held
    varying = (failed.min_feasible_bytes or 0) - fixed - (grads if have > 1 else 0)
    room = failed.budget_bytes - fixed - grads
    if room <= 0 or varying <= 0 or batch <= have:
        return None
    most = min(batch, max(have + 1, max_nodes // max(len(forward.nodes), 1)))
    counts = [m for m in range(have + 1, most + 1) if batch % m == 0]
    if not counts or counts == [batch]:  # (say a prime batch: parts need not be even)
        counts = list(range(have + 1, most + 1))
    guess = have * varying / room
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
