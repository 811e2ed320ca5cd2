"""auto's predicted order of the split candidates against their measured order on two MPI
ranks (issue 47: auto must choose by figures that hold).

For each network, `netdsl.api.split(..., mpi=True)` gives auto's candidates and predicted
step times as `run --distributed` would run them; each candidate then trains a few steps
under `mpiexec -n 2 ... --distributed` with that split forced, and its median step is
measured. Prints both orders, Spearman's rank correlation, and whether auto's choice is
the fastest measured of the exact candidates (those that compute one device's numbers).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/bench_split_order.py

(the OpenBLAS variables are unset for this command only: docs/benchmarks.md says why).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import netdsl  # noqa: E402

NETS = {"resnet164-cifar.net": 8, "transformer-tiny.net": 32}


def candidates(net_file: str, batch: int) -> list[dict]:
    net = netdsl.load(ROOT / "examples" / net_file)
    res = netdsl.api.split(net, 2, "auto", batch=batch, profile="cpu", interconnect="shm",
                           mpi=True, jobs=1)
    out = []
    for c in res.chosen.considered:
        s = c.spec
        out.append({"spec": s.describe(), "exact": c.exact,
                    "predicted_s": c.report.predicted_step_s,
                    "chosen": c.spec == res.chosen.best.spec, "args": _args(s)})
    return out


def _args(s) -> list[str]:
    if s.pipeline > 1:
        return ["--split", "pipeline", "--microbatches", str(s.microbatches),
                "--schedule", s.schedule]
    scheme = "data" if s.data > 1 else "tensor" if s.tensor > 1 else "spatial"
    return ["--split", scheme]


def measure(net_file: str, batch: int, args: list[str], steps: int) -> float:
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or "mpiexec"
    cmd = [mpiexec, "-n", "2", sys.executable, "-m", "netdsl_cli", "run",
           str(ROOT / "examples" / net_file), "--distributed", "--batch", str(batch),
           "--steps", str(steps), "--eval-samples", "0", "--json", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr}")
    return json.loads(p.stdout)["step_time_s"]


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0] * len(x)
        for k, i in enumerate(order):
            r[i] = k
        return r
    ra, rb, n = ranks(a), ranks(b), len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--nets", nargs="*", default=list(NETS))
    a = ap.parse_args()
    for net_file in a.nets:
        batch = NETS[net_file]
        rows = candidates(net_file, batch)
        for r in rows:
            r["measured_s"] = measure(net_file, batch, r["args"], a.steps)
        print(f"\n{net_file} at batch {batch}, two MPI ranks, profile cpu over shm")
        print(f"{'split':38s} {'exact':>5s} {'predicted':>10s} {'measured':>9s}")
        for r in sorted(rows, key=lambda r: r["measured_s"]):
            print(f"{r['spec'] + (' *' if r['chosen'] else ''):38s} "
                  f"{'yes' if r['exact'] else 'no':>5s} {r['predicted_s']:10.3f} "
                  f"{r['measured_s']:9.3f}")
        rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
        exact = [r for r in rows if r["exact"]]
        best = min(exact, key=lambda r: r["measured_s"])
        print(f"Spearman's rho (predicted against measured order): {rho:.2f}; auto's "
              f"choice {'is' if best['chosen'] else 'is not'} the fastest measured exact "
              f"split ({best['spec']})")


if __name__ == "__main__":
    main()
