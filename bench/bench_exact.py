"""auto against the exact program (netdsl.memory.milp, SciPy HiGHS) on small networks.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/bench_exact.py

For each network, profile and budget (a fraction of the way from the smallest budget auto
reaches to the unplanned peak), the predicted step of auto's plan and of the program's
plan, both scored by the same simulator, and auto's gap (auto / exact - 1; negative when
auto's plan is faster than the program's, whose linear memory model is not the
simulator). The reference is the exact plan, solved in the same run.
"""
from __future__ import annotations

import sys
from pathlib import Path

from netdsl.api import load
from netdsl.config import TrainConfig
from netdsl.memory.milp import exact_plan
from netdsl.memory.search import plan_memory
from netdsl.step.graphs import training_graph

ROOT = Path(__file__).resolve().parent.parent
CASES = [("resnet20-cifar", 8), ("transformer-tiny", 8), ("densenet121", 1)]


def main() -> None:
    print(f"{'network':18} {'profile':9} {'budget MB':>10} {'auto ovh':>9} {'exact ovh':>10} "
          f"{'gap':>7} {'auto s':>7} {'milp s':>7}")
    for name, batch in CASES:
        net = load(ROOT / "examples" / f"{name}.net")
        g = training_graph(net.lower(batch), net.train or TrainConfig())
        for profile in ("k40-12gb", "cpu"):
            top = plan_memory(g, 10**13, profile, "none").planned_peak_bytes
            low = plan_memory(g, 1, profile, offload_state=False).min_feasible_bytes
            for f in (0.05, 0.25, 0.5):
                budget = int(low + (top - low) * f)
                a = plan_memory(g, budget, profile, offload_state=False)
                x = exact_plan(g, budget, profile, prefetch=a.prefetch)
                gap = (f"{100 * (a.predicted_step_s / x.predicted_step_s - 1):6.2f}%"
                       if x.feasible and a.feasible else "    n/a")
                exact = f"{100 * x.predicted_overhead:9.2f}%" if x.feasible else "   none* "
                print(f"{name:18} {profile:9} {budget / 1e6:10.2f} "
                      f"{100 * a.predicted_overhead:8.2f}% {exact} {gap} "
                      f"{a.plan_s:7.2f} {x.solve_s:7.2f}")
                sys.stdout.flush()
    print("* no plan from the program fits the budget in the simulator (or its linear model "
          "has no solution)")


if __name__ == "__main__":
    main()
