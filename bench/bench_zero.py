"""Sharded data parallelism (ZeRO stages 1 to 3) over MPI: per-rank memory against the
plan, and the step time against plain data parallelism (issue 47).

Memory (`--ranks 4`, ResNet-50 by default): `mpiexec -n 4` ranks each build the data=4
step with its state replicated (shard 0) or sharded (1, 2) and train two steps. Each
rank reports its planned peak (the storage plan of its part), the peak tracemalloc
measured over the steps (`RunResult.peak_bytes`, not the executor's count), its state as
planned and as tracemalloc measures an executor of its part allocating it, its optimizer
state as planned, and the bytes its collectives sent (the communicator's counter) against
the report's analytic figure.

Time (`--time-ranks 2`, resnet164-cifar at batch 16 by default): plain data parallelism
and each shard stage trained in turn, rounds interleaved so that a loaded machine loads
each alike; the median step of each and its ratio to plain data parallelism's.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/bench_zero.py

(the OpenBLAS variables are unset for this command only: docs/benchmarks.md says why).
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or "mpiexec"

RANK = """
import gc, json, sys, tracemalloc
from pathlib import Path
import netdsl
from netdsl.memory.profiles import get_profile
from netdsl.parallel.predict import get_interconnect, report
from netdsl.runtime.executor import Executor
from netdsl.runtime.mpi import world
from netdsl.runtime.options import RunOptions
from netdsl.runtime.trainer import Trainer
net_file, shard, batch, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
net = netdsl.load(net_file)
t = Trainer(net.graph, net.train, RunOptions(steps=2, eval_samples=0, distributed=True,
                                             split="data", shard=shard, batch=batch))
g = t.executor.graph
tracemalloc.start()
held = Executor(g, "numpy", "f32", seed=0)
state_measured = tracemalloc.get_traced_memory()[0]
tracemalloc.stop()
del held
gc.collect()
r = t.fit()
rank = world()[0]
rep, _ = report(t.full_graph, 1.0, get_profile("cpu"), get_interconnect("shm"))
mine = next(d for d in rep.per_device if d.device == rank)
Path(out, f"rank{rank}.json").write_text(json.dumps({
    "rank": rank, "planned": t.planned_peak_bytes(), "measured": r.peak_bytes,
    "counted": t.executor.peak_bytes, "state_planned": mine.state_bytes,
    "state_measured": state_measured, "optimizer_state": mine.optimizer_state_bytes,
    "sent": int(r.comm_bytes_per_step.get(str(rank), r.comm_bytes_per_step.get(rank, 0))),
    "sent_predicted": mine.comm_bytes}))
"""


def memory(net: str, ranks: int, batch: int) -> list[dict]:
    rows = []
    script = Path(tempfile.mkdtemp()) / "rank.py"
    script.write_text(RANK)
    for shard in (0, 1, 2, 3):
        out = Path(tempfile.mkdtemp())
        cmd = [MPIEXEC, "-n", str(ranks), sys.executable, str(script), net, str(shard),
               str(batch), str(out)]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
        for r in range(ranks):
            rows.append({"shard": shard, **json.loads((out / f"rank{r}.json").read_text())})
    return rows


def step_times(net: str, ranks: int, batch: int, steps: int, rounds: int) -> dict:
    times: dict[int, list[float]] = {0: [], 1: [], 2: [], 3: []}
    for _ in range(rounds):
        for shard in times:
            cmd = [MPIEXEC, "-n", str(ranks), sys.executable, "-m", "netdsl_cli", "run", net,
                   "--distributed", "--split", "data", "--shard", str(shard), "--batch",
                   str(batch), "--steps", str(steps), "--eval-samples", "0", "--json"]
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                               env=dict(os.environ))
            if p.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
            times[shard].append(json.loads(p.stdout)["step_time_s"])
    return times


def mb(x: int) -> str:
    return f"{x / 1e6:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net", default=str(ROOT / "examples" / "resnet50.net"))
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--time-net", default=str(ROOT / "examples" / "resnet164-cifar.net"))
    ap.add_argument("--time-ranks", type=int, default=2)
    ap.add_argument("--time-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-time", action="store_true")
    a = ap.parse_args()
    if not a.skip_memory:
        rows = memory(a.net, a.ranks, a.batch)
        print(f"{Path(a.net).name}, data={a.ranks}, batch {a.batch}, float32 (MB)")
        print("shard | rank | planned peak | counted peak | measured peak | state planned "
              "| state measured | optimizer state | sent (counted / analytic)")
        for r in rows:
            print(f"{r['shard']} | {r['rank']} | {mb(r['planned'])} | {mb(r['counted'])} | "
                  f"{mb(r['measured'])} | "
                  f"{mb(r['state_planned'])} | {mb(r['state_measured'])} | "
                  f"{mb(r['optimizer_state'])} | {mb(r['sent'])} / {mb(r['sent_predicted'])}")
        base = {r["rank"]: r for r in rows if r["shard"] == 0}
        for r in rows:
            if r["shard"]:
                b = base[r["rank"]]
                print(f"shard {r['shard']} rank {r['rank']}: optimizer state "
                      f"{r['optimizer_state'] / b['optimizer_state']:.4f} of shard 0's; state "
                      f"measured {r['state_measured'] / b['state_measured']:.4f} of shard "
                      f"0's; peak measured {r['measured'] / b['measured']:.3f}; sent "
                      f"{r['sent'] / b['sent']:.3f}x shard 0's")
    if not a.skip_time:
        times = step_times(a.time_net, a.time_ranks, a.time_batch, a.steps, a.rounds)
        plain = statistics.median(times[0])
        print(f"{Path(a.time_net).name}, data={a.time_ranks} over MPI, batch {a.time_batch}: "
              f"median step (s) of {a.rounds} interleaved runs")
        for shard, ts in times.items():
            m = statistics.median(ts)
            print(f"shard {shard}: {m:.3f} s (runs {', '.join(f'{t:.3f}' for t in ts)}), "
                  f"{m / plain:.3f}x plain data parallelism")


if __name__ == "__main__":
    main()
