"""Memory planning of a split training step (`netdsl split --mem`, `run --devices --mem`):
the single-device planner (`memory.search`), whose budget bounds each device's peak when
the graph places its nodes on devices. A recomputed value is rebuilt on its own device, an
offloaded one waits in its device's host memory; the rewritten step is checked against
the budget by `memory.plan.device_peaks`, the rule `predict.report` and the executor
count by.
"""
from __future__ import annotations

from netdsl.ir.graph import Graph
from netdsl.memory.profiles import Profile
from netdsl.memory.search import PlanResult, plan_and_apply
from netdsl.parallel.predict import _roles


def plan_split(g: Graph, budget: int, profile: Profile, float_dtype: str = "f32",
               strategy: str = "auto", progress=None,
               offload_state: bool = False) -> tuple[Graph | None, PlanResult]:
    """(the planned split step, the plan), or (None, the plan) when no plan fits every
    device into `budget` bytes (`plan.worst_device` names the one that does not).
    `offload_state`: each device's optimizer state (a sharded data split: its pieces')
    may live in its host's memory, streamed in for its update and out after it."""
    planned, res = plan_and_apply(g, budget, profile, strategy, float_dtype,
                                  roles=_roles(g), progress=progress,
                                  offload_state=offload_state)
    if planned is not None:
        planned.meta["split"] = dict(g.meta.get("split", {}))
    return planned, res


def summary(res: PlanResult, unplanned_step_s: float | None = None,
            unplanned_peak_bytes: int | None = None,
            predicted_step_s: float | None = None) -> dict:
    """The plan of a split step for --json: strategy, budget, per-device decisions; the
    predicted overhead is the planned split step's predicted time (`predict.report`)
    against the unplanned one's, when both are given."""
    overhead = (predicted_step_s / unplanned_step_s - 1
                if predicted_step_s and unplanned_step_s else res.predicted_overhead)
    return {"strategy": res.strategy, "profile": res.profile.name,
            "budget_bytes": res.budget_bytes, "feasible": res.feasible,
            "decisions": dict(res.counts), "offload_bytes": res.offload_bytes,
            "recompute_flops": res.recompute_flops, "plan_s": res.plan_s,
            "predicted_step_s": predicted_step_s, "unplanned_step_s": unplanned_step_s,
            "predicted_overhead": overhead, "unplanned_peak_bytes": unplanned_peak_bytes,
            "outside_plan_bytes": res.outside_plan_bytes,
            "per_device": {str(d): dict(v) for d, v in sorted(res.per_device.items())}}
