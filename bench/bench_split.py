"""Splitting across devices: what `netdsl split` predicts for each strategy, and an MPI run
against one process in the same session.

    python bench/bench_split.py split  [--net examples/resnet2504.net] [--devices 4] [--batch 16]
        [--mem 1TB] [--strategies data,pipeline,hybrid,tensor,auto]
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_split.py mpi \
        [--net examples/resnet164-cifar.net] [--steps 3] [--split pipeline] [--microbatches M]

`split` runs `netdsl split --json` for each strategy and prints, per
strategy, the largest per-device peak, the bytes sent per step (and the ring lower bound),
the predicted step time and speed-up, and the bubble. `mpi` trains the same steps with
`mpiexec -n 2 netdsl run --distributed` and with one process (both cores: two BLAS
threads), alternating, and prints the per-step losses side by side, their largest relative
difference, and the median step times with their ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NETDSL = [sys.executable, "-m", "netdsl_cli"]


def split_table(net: str, devices: int, batch: int, profile: str, link: str,
                mem: str | None, strategies: list[str]) -> None:
    extra = ["--mem", mem] if mem else []
    print(f"netdsl split {net} --devices {devices} --batch {batch} --profile {profile} "
          f"--interconnect {link} {' '.join(extra)}")
    print(f"{'strategy':<10} {'split':<34} {'max peak GB':>11} {'sent/step MB':>13} "
          f"{'lower bound MB':>15} {'step s':>9} {'speed-up':>9} {'bubble':>7} {'time s':>7}")
    for strategy in strategies:
        t0 = time.perf_counter()
        r = subprocess.run([*NETDSL, "split", net, "--devices", str(devices), "--batch",
                            str(batch), "--strategy", strategy, "--profile", profile,
                            "--interconnect", link, "--json", *extra], capture_output=True,
                           text=True)
        dt = time.perf_counter() - t0
        if r.returncode != 0:
            try:
                why = json.loads(r.stdout)["errors"][0]["message"]
            except (ValueError, KeyError, IndexError):
                why = r.stderr.strip()[-300:]
            print(f"{strategy:<10} exit {r.returncode}: {why}")
            continue
        d = json.loads(r.stdout)
        peak = max(x["peak_bytes"] for x in d["per_device"])
        print(f"{strategy:<10} {d['spec']:<34} {peak / 1e9:>11.2f} "
              f"{d['comm_bytes_total'] / 1e6:>13.1f} {d['comm_bytes_lower_bound'] / 1e6:>15.1f} "
              f"{d['predicted_step_s']:>9.3f} {d['predicted_speedup']:>8.2f}x "
              f"{d['bubble']:>7.1%} {dt:>7.0f}")


def run_log(cmd: list[str], log: Path) -> tuple[list[float], list[float]]:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr}")
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    return [x["loss"] for x in recs], [x["step_time_s"] for x in recs]


def mpi_vs_one(net: str, steps: int, split: str, repeats: int,
               microbatches: int | None) -> None:
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or "mpiexec"
    tmp = Path(tempfile.mkdtemp())
    common = ["run", net, "--steps", str(steps), "--eval-samples", "0"]
    one_t, two_t = [], []
    for k in range(repeats):
        a, b = tmp / f"one{k}.jsonl", tmp / f"two{k}.jsonl"
        one_l, t1 = run_log([*NETDSL, *common, "--log", str(a)], a)
        # one BLAS thread per rank: two ranks on two cores (more would oversubscribe them)
        micro = ["--microbatches", str(microbatches)] if microbatches else []
        two_l, t2 = run_log([mpiexec, "-n", "2", "-genv", "OPENBLAS_NUM_THREADS", "1",
                             *NETDSL, *common, "--log", str(b), "--distributed", "--split",
                             split, *micro], b)
        one_t += t1[1:]  # the first step warms up
        two_t += t2[1:]
    worst = max(abs(x - y) / abs(x) for x, y in zip(one_l, two_l, strict=True))
    print(f"{net}, {steps} steps, {split} (microbatches {microbatches or 'default'}) over "
          f"2 MPI ranks (1 BLAS thread each) against one process (default threads; "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE')})")
    for s, (x, y) in enumerate(zip(one_l, two_l, strict=True), start=1):
        print(f"  step {s}: one process {x:.7f}   2 ranks {y:.7f}")
    print(f"  largest relative loss difference {worst:.2e}")
    m1, m2 = statistics.median(one_t), statistics.median(two_t)
    print(f"  median step: one process {m1:.3f} s, 2 ranks {m2:.3f} s; "
          f"ratio 2 ranks / one process = {m2 / m1:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("split", "mpi"))
    ap.add_argument("--net")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--profile", default="k40-12gb")
    ap.add_argument("--interconnect", default="pcie3")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--split", default="pipeline")
    ap.add_argument("--microbatches", type=int)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--mem", help="memory per device (default: the profile's)")
    ap.add_argument("--strategies", default="data,pipeline,hybrid,tensor,spatial,auto")
    a = ap.parse_args()
    if a.what == "split":
        split_table(a.net or "examples/resnet2504.net", a.devices, a.batch, a.profile,
                    a.interconnect, a.mem, a.strategies.split(","))
    else:
        mpi_vs_one(a.net or "examples/resnet164-cifar.net", a.steps, a.split, a.repeats,
                   a.microbatches)


if __name__ == "__main__":
    main()
