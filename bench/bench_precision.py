"""Mixed precision against f32: memory measured and planned, and the step time.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_precision.py \
        [--file examples/resnet164-cifar.net] [--batch 16] [--steps 5] [--rounds 2]

Runs `netdsl run FILE --batch B --steps S --json --eval-samples 0 --precision P` for f32,
bf16 and f16, each in a process of its own (its tracemalloc peak its own), the three in
turn for each round, and prints per precision: the median step time (the steps after the
two metered ones), the measured peak (tracemalloc: what NumPy allocated, independent of
the executor) and the planned peak. Then, against f32: the step time; what a step
allocates besides the persistent state (measured peak less the parameters, buffers and
optimizer state, which stay f32), the issue's bound being 0.55; the storage plan's value
bytes (activations and gradients); and each run's measured peak against its plan (within
5%).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

PRECISIONS = ("f32", "bf16", "f16")


def run(args, precision: str) -> dict:
    cmd = [sys.executable, "-m", "netdsl_cli", "run", args.file, "--batch", str(args.batch),
           "--steps", str(args.steps), "--json", "--eval-samples", "0", "--precision",
           precision]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)


def planned(args, precision: str):
    """The step's storage plan as the run builds it (its state and value bytes)."""
    import netdsl
    from netdsl.options import RunOptions
    net = netdsl.load(args.file)
    return netdsl.api.build(net, RunOptions(batch=args.batch, precision=precision),
                            runs=True).storage_plan()


def mb(n) -> str:
    return f"{n / 1e6:,.1f} MB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", default="examples/resnet164-cifar.net")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {p: [] for p in PRECISIONS}
    for _ in range(args.rounds):
        for p in PRECISIONS:
            runs[p].append(run(args, p))
    plans = {p: planned(args, p) for p in PRECISIONS}
    print(f"{args.file}, batch {args.batch}, {args.steps} steps a run, {args.rounds} "
          "round(s); step time: the median over the rounds' medians")
    print(f"{'precision':<10} {'step s':>8} {'measured peak':>14} {'planned peak':>13} "
          f"{'measured/planned':>17} {'step less state':>16} {'plan values':>12}")
    row = {}
    for p in PRECISIONS:
        rs = runs[p]
        step = statistics.median(r["step_time_s"] for r in rs)
        peak = max(r["peak_bytes"] for r in rs)  # (the rounds' own meters)
        plan = rs[0]["planned_peak_bytes"]
        state = plans[p].state_bytes
        row[p] = (step, peak - state, plans[p].lower_bound_bytes)
        print(f"{p:<10} {step:>8.3f} {mb(peak):>14} {mb(plan):>13} {peak / plan:>17.3f} "
              f"{mb(peak - state):>16} {mb(plans[p].lower_bound_bytes):>12}")
    base = row["f32"]
    for p in ("bf16", "f16"):
        step, held, values = row[p]
        print(f"{p} / f32: step time {step / base[0]:.2f}x, measured step bytes besides the "
              f"state {held / base[1]:.3f}x (bound 0.55), planned values "
              f"{values / base[2]:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
