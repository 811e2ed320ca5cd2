"""`build_step`: the one builder of a training step, for every command.

    forward graph + train config + StepRequest
      -> the graph: one device, gradients accumulated over micro-batches, or a split
         over devices chosen among candidates (`netdsl.parallel.choose`)
      -> a budget: --mem, or on one device the free memory when the step as written
         does not fit it
      -> a memory plan into that budget (keep / recompute / offload; per device for a
         split), applied to the graph
      -> over MPI, this rank's part of the step
    = Step: the graph, its roles, the split, the plan, the budget and the prediction.

`netdsl run` executes the Step (runtime.Trainer), `plan` and `split` report on it, and
the Python API returns it; none of them builds a step another way.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from netdsl.config import ParallelConfig, TrainConfig
from netdsl.errors import NetdslError
from netdsl.ir.bulk import gc_paused
from netdsl.ir.graph import Graph
from netdsl.ir.serialize import fingerprint
from netdsl.memory.plan import MemoryPlan, device_peaks, make_plan
from netdsl.memory.search import PlanResult, infeasible_error, plan_and_apply
from netdsl.parallel.choose import Chosen, Share, choose
from netdsl.parallel.predict import get_interconnect
from netdsl.parallel.split import SplitSpec
from netdsl.passes.pipeline import run_pipeline
from netdsl.step import room
from netdsl.step.fit import (
    budget_to_fit,
    cannot_fit_even_planned,
    fewest_microbatches,
    fits_with,
)
from netdsl.step.graphs import (
    accumulating_step,
    accumulation,
    loss_labels,
    require_loss,
    roles_of,
    training_graph,
)
from netdsl.step.request import StepRequest, World


@dataclass
class Step:
    """A training step, built and (where a budget says so) planned, ready to run."""

    graph: Graph  # what runs: over MPI this rank's part
    forward: Graph  # the unbound forward graph it was built from
    bound: Graph  # the forward graph bound to the batch
    request: StepRequest
    cfg: TrainConfig
    roles: tuple[str, ...]
    labels: tuple[str, str, int] | None  # (logits node, labels input, class axis)
    split: str | None = None  # the split made, e.g. "data=2", "microbatches=4"
    microbatches: int = 1  # on one device, the parts its gradients are accumulated over
    chosen: Chosen | None = None  # a split's choice, with the candidates weighed
    memory_plan: PlanResult | None = None  # the plan into the budget (one device)
    split_plan: dict | None = None  # a split's plan per device, summarised
    budget_bytes: int | None = None
    budget_from: str | None = None  # "--mem" or "free memory"
    budget_text: str | None = None  # the budget as --mem takes it
    as_written: tuple[int, int] | None = None  # (needs, free) of the unplanned step
    full_graph: Graph | None = None  # over MPI: every rank's parts
    warnings: list[str] = field(default_factory=list)
    _storage: MemoryPlan | None = field(default=None, repr=False)

    @property
    def profile(self):
        return self.request.profile

    @property
    def arena(self) -> bool:
        """A step planned on one device runs from one packed block (the plan's arena)."""
        return self.budget_bytes is not None and not self.request.split_devices

    @property
    def budget_includes_host(self) -> bool:
        """Where host and device are one memory, the host pool counts against the budget."""
        return self.budget_bytes is not None and self.request.profile.unified

    @property
    def fits(self) -> bool:
        return self.memory_plan is None or self.memory_plan.feasible

    def storage_plan(self) -> MemoryPlan:
        """Where every value of the step lives and when (`memory.plan.make_plan`), made
        once; the executor follows it."""
        if self._storage is None:
            self._storage = make_plan(self.graph, self.roles, self.request.dtype,
                                      pack_arena=self.arena)
        return self._storage

    def planned_peak_bytes(self) -> int:
        """The step's peak as planned before it runs: in an arena run (a memory plan on one
        device) what the planner's check of the rewritten step found, the packed arena and
        what a process holds besides it (`plan_and_apply`); else the storage plan's peak,
        which the executor's count equals."""
        if self.arena and self.memory_plan is not None:
            return self.memory_plan.verified_peak_bytes
        return self.storage_plan().peak_bytes

    def planned_by_device(self) -> dict[int, int]:
        """The storage plan's peak of each device of a split step in this process."""
        if not self.request.split_devices or self.request.over_mpi:
            return {}
        return device_peaks(self.graph, self.storage_plan())

    def plan_summary(self) -> dict | None:
        """What the memory planner decided, for the log and --json."""
        p = self.memory_plan
        if p is None:
            return None
        if self.split_plan is not None:
            return self.split_plan
        return {"strategy": p.strategy, "profile": p.profile.name, "budget": self.budget_from,
                "decisions": dict(p.counts), "predicted_overhead": p.predicted_overhead,
                "offload_bytes": p.offload_bytes, "recompute_flops": p.recompute_flops,
                "arena_bytes": self.storage_plan().arena_bytes,
                "outside_plan_bytes": p.outside_plan_bytes, "plan_s": p.plan_s}

    def refusal(self, phase: Callable[[str], None] | None = None) -> NetdslError:
        """The error for a step no plan fits into its budget, naming the micro-batches
        whose step a plan would fit, where some do."""
        fitting = microbatches_to_fit(self, phase)
        if self.budget_from == "free memory":
            where = room.where_kind(self.request.device_kind)
            return cannot_fit_even_planned(self.as_written, self.memory_plan,
                                           self.request.batch, where, fitting)
        return infeasible_error(self.memory_plan, fits_with(fitting))


@gc_paused()  # (builds, plans and drops whole steps: netdsl.ir.bulk)
def build_step(forward: Graph, cfg: TrainConfig, req: StepRequest, *,
               world: World | None = None, phase: Callable[[str], None] | None = None,
               progress: Callable[[float], None] | None = None) -> Step:
    """The training step of unbound `forward` as `req` asks (module docstring). `world`:
    the MPI ranks building it together; `phase(text)` says what the build does now,
    `progress(fraction)` how far a split's choice or a plan has got."""
    require_loss(forward)
    say = phase or (lambda text: None)
    labels = loss_labels(forward) if req.fetch_logits else None
    bound = forward.bind(req.batch)
    step = Step(bound, forward, bound, req, cfg, (), labels)
    micro, order = accumulation(forward, req.microbatches, req.schedule, req.devices)
    if req.runs and not req.split_devices:
        step.warnings += _declared_split_unused(forward)
    if req.split_devices:
        _split(step, world, say, progress)
    elif micro > 1:
        say(f"building the training step ({micro} micro-batches)")
        step.graph = accumulating_step(forward, req.batch, cfg, micro, order,
                                       _gather(labels), req.device_kind)
        step.split = SplitSpec(microbatches=micro, schedule=order).describe()
        step.microbatches = micro
    else:
        step.graph = training_graph(step.graph, cfg, req.device_kind)  # (verified)
    if labels:  # the loss's own logits, for accuracy
        step.graph.outputs["logits"] = [labels[0]]
    _choose_budget(step)
    if step.budget_bytes is None and req.runs and (req.profile_given
                                                    or req.strategy != "auto"):
        step.warnings.append("--profile and --strategy have no effect without --mem (they "
                             "say how to plan the step into a memory budget)")
    if world is not None:
        from netdsl.parallel.project import project
        step.full_graph = step.graph
        agree_on_the_step(step.graph, step.split, world)
        step.graph = project(step.graph, world.rank)
    step.roles = roles_of(step.graph)
    if step.budget_bytes is not None and not req.split_devices:
        _plan(step, progress)
    return step


def _gather(labels) -> tuple[str, ...]:
    return (labels[0],) if labels else ()


def _declared_split_unused(forward: Graph) -> list[str]:
    declared = ParallelConfig(**dict(forward.parallel)).devices
    if declared == 1:
        return []
    return [f"the file's parallel {{ }} splits the step over {declared} devices, which "
            f"takes --devices {declared} (or mpiexec -n {declared} ... --distributed); "
            "this run is on one device"]


def _split(step: Step, world: World | None, say, progress) -> None:
    """The step split over the request's devices: the candidate `choose` picks."""
    req, labels = step.request, step.labels
    say(f"choosing how to split the step over {req.devices} devices"
        + (f" ({req.split})" if req.split else ""))
    share = Share(world.rank, world.size, world.allgather) if world is not None else None
    budget = req.budget_bytes
    chosen = choose(step.forward, req.batch, req.split, req.devices,
                    step.cfg.optimizer.model_dump(), req.profile,
                    get_interconnect(req.interconnect), mem=budget,
                    microbatches=req.microbatches, schedule=req.schedule, bn=req.bn,
                    shard=req.shard, virtual_stages=req.virtual_stages,
                    gather=_gather(labels), plan=budget is not None,
                    mem_strategy=req.strategy, float_dtype=req.dtype,
                    outputs={"logits": [labels[0]]} if labels else None,
                    over_mpi=req.over_mpi, share=share, jobs=req.jobs, progress=progress,
                    precision=req.precision, offload_state=req.offload_state)
    best = chosen.best
    if chosen.note:
        step.warnings.append(chosen.note)
    say(f"building the training step ({best.spec.describe()})")
    step.chosen, step.graph, step.split = chosen, best.graph, best.spec.describe()
    step.memory_plan = best.memory
    if budget is not None:
        step.budget_bytes, step.budget_from = budget, "--mem"
    if best.memory is not None:
        from netdsl.parallel.memplan import summary
        step.split_plan = summary(best.memory, best.unplanned_step_s,
                                  best.unplanned_peak_bytes, best.report.predicted_step_s)


def _choose_budget(step: Step) -> None:
    """--mem; or, for a step that runs here on one device, the free memory when the step
    as written does not fit it. An unplanned step that runs has its updates grouped, one
    node per kind (a planned one keeps each update right after its gradient, which frees
    the gradient early)."""
    req = step.request
    if req.budget_bytes is not None:
        if not req.split_devices:
            step.budget_bytes, step.budget_from = req.budget_bytes, "--mem"
        return
    if not req.runs:
        return
    # (its nodes were verified or typed by their shape rules: order and effects checked)
    grouped = run_pipeline(step.graph, ["group_updates"], verify="structure")
    grouped.verify(recheck_shapes=False)
    mem = None
    if not req.split_devices:
        mem, step.as_written, warning = budget_to_fit(grouped, req)
    if mem is None:
        step.graph = grouped
        return
    step.warnings.append(warning)
    step.budget_text, step.budget_from = mem, "free memory"
    from netdsl.sizes import parse_size
    step.budget_bytes = parse_size(mem, "--mem")


def _plan(step: Step, progress) -> None:
    """The one-device step planned into its budget, then run exactly as planned."""
    req = step.request
    planned, step.memory_plan = plan_and_apply(
        step.graph, step.budget_bytes, req.profile, req.strategy, req.dtype,
        roles=step.roles, arena=True, offload_state=req.offload_state,
        prefetch=req.prefetch, progress=progress, verify=req.verify_plan)
    if planned is not None:
        step.graph = planned
        step._storage = step.memory_plan.storage  # (the check's, made for this run)


def microbatches_to_fit(step: Step, phase=None) -> int | None:
    """For a step no plan fits into its budget: more micro-batches whose step a plan fits
    into it, for the error to name (nothing switches by itself: with batchnorm the step
    would compute other numbers), or None."""
    req, failed = step.request, step.memory_plan
    micro, _ = accumulation(step.forward, req.microbatches, req.schedule, req.devices)
    if req.batch <= micro:  # (no more parts than samples)
        return None
    if phase is not None:
        phase("no plan fits: trying more micro-batches")

    def fits(g: Graph) -> PlanResult:
        return plan_and_apply(g, failed.budget_bytes, req.profile, req.strategy, req.dtype,
                              roles=roles_of(g), arena=True,
                              offload_state=req.offload_state)[1]
    return fewest_microbatches(step.forward, req.batch, step.cfg, failed, fits, micro,
                               req.device_kind, req.dtype)


def agree_on_the_step(graph: Graph, split: str | None, world: World) -> None:
    """Every rank builds the split step itself, from its own copy of the network file, the
    stdlib, the options and a --profile file; ranks that built different steps would wait
    on messages that never come or mix unrelated values, so they compare fingerprints
    first (an allgather of a digest) and all stop with the reason."""
    rows = world.allgather((split, fingerprint(graph)))
    if all(r == rows[0] for r in rows):
        return
    if world.rank != 0:
        raise NetdslError("the ranks built different training steps (rank 0 says which)")
    groups: dict[tuple[str, str], list[int]] = {}
    for r, row in enumerate(rows):
        groups.setdefault(row, []).append(r)

    def ranks(rs: list[int]) -> str:
        return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))
    if len({s for s, _ in rows}) > 1:
        said = "; ".join(f"{ranks(rs)} chose {s}" for (s, _), rs in groups.items())
    else:
        said = "; ".join(f"{ranks(rs)} built step {fp[:12]}"
                         for (_, fp), rs in groups.items()) + f", all {split}"
    raise NetdslError(
        f"the ranks built different training steps ({said}), which cannot run together: "
        "the network file, the files it imports, a --profile file or the options differ "
        "between them; give every rank the same ones (--split and --microbatches fix the "
        "split)")
