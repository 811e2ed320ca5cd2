"""The memory planner on the flagship: `netdsl plan examples/resnet2504.net --mem 12GB
--batch 16 --profile k40-12gb`, auto against each baseline strategy at the same budget.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/bench_plan.py \
        [--mem 12GB] [--batch 16] [--profile k40-12gb] [--prefetch N] [FILE]

For each strategy: feasible or not, the planned peak, the predicted step time and its
overhead against the unconstrained step predicted in the same run (the reference: every
node once, no copies, on the same profile), bytes offloaded, FLOPs recomputed and the
planning time (target: auto under 5 s). Building the training graph is timed on its own.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from netdsl.api import load
from netdsl.config import TrainConfig
from netdsl.memory.search import STRATEGIES, plan_memory
from netdsl.step.graphs import training_graph

ROOT = Path(__file__).resolve().parent.parent
TARGET_S = 5.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file", nargs="?", default=str(ROOT / "examples" / "resnet2504.net"))
    ap.add_argument("--mem", default="12GB")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--profile", default="k40-12gb")
    ap.add_argument("--prefetch", type=int, default=None)
    a = ap.parse_args()
    t0 = time.perf_counter()
    net = load(a.file)
    g = training_graph(net.lower(a.batch), net.train or TrainConfig())
    print(f"{net.name}: training step of {len(g.nodes):,} nodes built in "
          f"{time.perf_counter() - t0:.2f} s; budget {a.mem}, batch {a.batch}, "
          f"profile {a.profile}")
    print(f"{'strategy':16} {'fits':>5} {'peak GB':>8} {'step s':>8} {'overhead':>9} "
          f"{'offload GB':>10} {'recompute TFLOP':>15} {'plan s':>7}")
    for s in STRATEGIES:
        r = plan_memory(g, a.mem, a.profile, s, prefetch=a.prefetch)
        print(f"{s:16} {'yes' if r.feasible else 'no':>5} {r.planned_peak_bytes / 1e9:8.2f} "
              f"{r.predicted_step_s:8.3f} {100 * r.predicted_overhead:8.1f}% "
              f"{r.offload_bytes / 1e9:10.1f} {r.recompute_flops / 1e12:15.2f} "
              f"{r.plan_s:7.2f}")
        if s == "auto":
            print(f"{'':16} reference (unconstrained step) {r.baseline_step_s:.3f} s; "
                  f"auto plan time {r.plan_s / TARGET_S:.2f}x the {TARGET_S:.0f} s target; "
                  f"prefetch {r.prefetch}; peak without a plan "
                  f"{r.baseline_peak_bytes / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
