"""What `netdsl plan` prints: the decisions by block and layer type, repeats folded as
`netdsl show` folds them (netdsl/ir/stats.py's `group_tree`), and the JSON summary."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from netdsl.ir import registry
from netdsl.ir.bulk import gc_paused
from netdsl.ir.stats import OpItem, group_tree
from netdsl.memory.search import PlanResult
from netdsl.memory.simulate import DECISIONS, FWD, KEEP


@dataclass
class DecisionRow:
    label: str
    level: int
    count: int  # copies the row stands for
    by_type: dict[str, Counter]  # layer type -> decision counts (totals over copies)

    def to_json(self) -> dict:
        return {"name": self.label, "level": self.level, "count": self.count,
                "by_layer_type": {t: {d: c.get(d, 0) for d in DECISIONS}
                                  for t, c in sorted(self.by_type.items())}}


@gc_paused()  # (tabulates the whole step: netdsl.ir.bulk)
def decision_rows(res: PlanResult, depth: int = 2) -> list[DecisionRow]:
    """Rows of the decision table: top-level blocks, then `depth - 1` levels inside."""
    prep = res.prep
    ops = registry.load_all()
    g = prep.g
    planned = {prep.pos[k]: d for k, d in res.decisions.items()}
    cands = set(prep.candidates) | set(planned)
    fwd = [g[name] for k, name in enumerate(prep.names)
           if prep.phase[k] == FWD or g[name].is_source]

    def counts(nodes) -> dict[str, Counter]:
        out: dict[str, Counter] = {}
        for n in nodes:
            p = prep.pos[n.name]
            if p in cands:
                out.setdefault(ops[n.op].layer_type, Counter())[planned.get(p, KEEP)] += 1
        return out

    rows: list[DecisionRow] = []

    def walk(copies_items: list[list], level: int) -> None:
        # copies_items: for each copy, its items at this level (structures agree)
        for j, it in enumerate(copies_items[0]):
            same = [c[j] for c in copies_items]
            if isinstance(it, OpItem):
                c = counts([s.node for s in same])
                if c:
                    rows.append(DecisionRow(it.node.name, level, len(same), c))
                continue
            nodes = [n for s in same for n in s.nodes]
            c = counts(nodes)
            if not c:
                continue
            rows.append(DecisionRow(it.label, level, it.count * len(same), c))
            if level + 1 < depth:
                kids = [group_tree(copy, it.level + 1, it.types)
                        for s in same for copy in s.copies]
                if all(len(k) == len(kids[0]) for k in kids):
                    walk(kids, level + 1)

    walk([group_tree(fwd, 0)], 0)
    return rows


def plan_json(res: PlanResult, batch: int, depth: int = 2, extra: dict | None = None,
              microbatches: int = 1) -> dict:
    """The `netdsl plan --json` object (docs/memory.md lists the keys)."""
    arena, bound = res.sim.arena()
    d = {
        "network": res.network, "batch": batch, "microbatches": microbatches,
        "profile": res.profile.name,
        "strategy": res.strategy, "budget_bytes": res.budget_bytes,
        "feasible": res.feasible, "baseline_peak_bytes": res.baseline_peak_bytes,
        "planned_peak_bytes": res.planned_peak_bytes,
        "predicted_step_s": res.predicted_step_s, "baseline_step_s": res.baseline_step_s,
        "predicted_overhead": res.predicted_overhead, "offload_bytes": res.offload_bytes,
        "host_bytes": res.host_bytes, "recompute_flops": res.recompute_flops,
        "state_bytes": res.state_bytes, "workspace_bytes": res.workspace_bytes,
        "prefetch": res.prefetch, "plan_s": res.plan_s,
        "arena_bytes": arena, "lower_bound_bytes": bound,
        "verified_peak_bytes": res.verified_peak_bytes, "verify_s": res.verify_s,
        "outside_plan_bytes": res.outside_plan_bytes,
        "min_feasible_bytes": res.min_feasible_bytes,
        "dominant": res.dominant or None,
        "decisions": {**{k: res.counts.get(k, 0) for k in DECISIONS},
                      "optimizer_state_offloaded": res.state_offloaded,
                      "optimizer_state_buffers": res.state_buffers,
                      "by_layer_type": res.by_layer_type,
                      "by_block": [r.to_json() for r in decision_rows(res, depth)],
                      "values": res.decisions},
    }
    d.update(extra or {})
    return d
