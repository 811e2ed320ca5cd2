"""`netdsl run --mem` against the same run without a budget, in one process tree.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_mem_run.py \
        [--file examples/resnet1001-cifar.net] [--batch 16] [--mem 300MB] [--steps 2]

Runs `netdsl run FILE --batch B --steps S --json --eval-samples 0` twice, alternating
(unplanned first), with and without `--mem`, and prints, for each: the median step time,
the measured peak (tracemalloc on NumPy: what NumPy really allocated, independent of the
executor), the executor's own count and the plan's prediction; then the planned run's
step time against the unplanned one's (the issue's goal: at most 1.25) and its measured
peak against the budget and against the plan (within 5%).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys


def run(args, mem: str | None, *extra: str) -> dict:
    """`netdsl run --json` of args.file at args.batch for args.steps, in a process of its
    own (its tracemalloc peak its own), with `--mem mem` and `extra` options."""
    cmd = [sys.executable, "-m", "netdsl_cli", "run", args.file, "--batch", str(args.batch),
           "--steps", str(args.steps), "--json", "--eval-samples", "0", *extra]
    if mem:
        cmd += ["--mem", mem]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)


def mb(n) -> str:
    return "-" if n is None else f"{n / 1e6:,.1f} MB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", default="examples/resnet1001-cifar.net")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--mem", default="300MB")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    rows = {"unplanned": [], f"--mem {args.mem}": []}
    for _ in range(args.rounds):
        rows["unplanned"].append(run(args, None))
        rows[f"--mem {args.mem}"].append(run(args, args.mem))
    print(f"{args.file}, batch {args.batch}, {args.steps} steps per run, {args.rounds} round(s)")
    print(f"{'run':<16} {'step s':>8} {'measured peak':>14} {'counted':>12} {'planned':>12}")
    best = {}
    for name, rs in rows.items():
        r = min(rs, key=lambda x: x["step_time_s"])
        best[name] = r
        print(f"{name:<16} {r['step_time_s']:>8.3f} {mb(r['peak_bytes']):>14} "
              f"{mb(r.get('counted_peak_bytes')):>12} {mb(r.get('planned_peak_bytes')):>12}")
    base, planned = best["unplanned"], best[f"--mem {args.mem}"]
    budget = planned.get("budget_bytes")
    print(f"step time, planned / unplanned: {planned['step_time_s'] / base['step_time_s']:.3f} "
          "(goal <= 1.25)")
    if budget:
        print(f"measured peak / budget: {planned['peak_bytes'] / budget:.3f} (must be <= 1)")
    want = planned.get("planned_peak_bytes")
    if want:
        print(f"measured / planned peak: {planned['peak_bytes'] / want:.3f}; counted / "
              f"planned: {planned['counted_peak_bytes'] / want:.3f} (both within 5%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
