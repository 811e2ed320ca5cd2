"""Gradient accumulation (`netdsl run --microbatches M`) against the plain step, in one
process tree.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_accumulate.py \
        [--file examples/resnet20-cifar.net] [--batch 64] [--micro 2,4,8] [--steps 10] \
        [--rounds 2]

Each round runs `netdsl run FILE --batch B --steps S --json --eval-samples 0` once plainly
and once per M (`--microbatches M`), one after the other, each in a process of its own,
and prints for each the best round's median step time, the measured peak (tracemalloc
on NumPy, independent of the plan) and the plan's peak, then each M's step time and
measured peak against the plain run's.
"""
from __future__ import annotations

import argparse
import sys

from bench_mem_run import mb, run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", default="examples/resnet20-cifar.net")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--micro", default="2,4,8")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    counts = [1] + [int(m) for m in args.micro.split(",")]
    rows: dict[int, list[dict]] = {m: [] for m in counts}
    for _ in range(args.rounds):
        for m in counts:
            rows[m].append(run(args, None, "--microbatches", str(m)))
    print(f"{args.file}, batch {args.batch}, {args.steps} steps per run, "
          f"{args.rounds} round(s)")
    print(f"{'micro-batches':<14} {'step s':>8} {'measured peak':>14} {'planned':>12} "
          f"{'step / plain':>13} {'peak / plain':>13} {'final loss':>11}")
    best = {m: min(rs, key=lambda x: x["step_time_s"]) for m, rs in rows.items()}
    for m, r in best.items():
        print(f"{m:<14} {r['step_time_s']:>8.3f} {mb(r['peak_bytes']):>14} "
              f"{mb(r['planned_peak_bytes']):>12} "
              f"{r['step_time_s'] / best[1]['step_time_s']:>13.3f} "
              f"{r['peak_bytes'] / best[1]['peak_bytes']:>13.3f} {r['final_loss']:>11.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
