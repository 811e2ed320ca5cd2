"""The executor's own cost per node: a chain of cheap nodes, this checkout against another
revision in the same run (issue 8: a GPU step is bound by the host's time per node, and
small CPU steps pay it too).

    .venv/bin/python bench/bench_dispatch.py --baseline HEAD~1 [--nodes 500] [--rounds 5]

Runs `relu` N times over a [2, 4] float32 array (a kernel of about 1 us), evaluation runs
and training runs of a chain with a parameter (so autodiff and SGD nodes take part), in
alternating child processes, and prints the time per node (the run's time over its
nodes), the kernels' own time (each kernel called alone, the same inputs) and the
difference: what the executor adds per node. The ratio compares the executor's share.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

CHILD = r"""
import json, statistics, sys, time
if len(sys.argv) > 2:
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not getattr(f, "__module__", "").startswith("__editable__")]
    sys.path.insert(0, sys.argv[2])
import numpy as np
import netdsl
from netdsl.ir import registry
from netdsl.passes.autodiff import autodiff
from netdsl.passes.optimizer import add_optimizer
from netdsl.runtime.executor import Executor, KernelContext

n = int(sys.argv[1])
src = ("network chain {\n    input x: f32[N, 4]\n    input y: i64[N]\n"
       "    h = linear(x, 4)\n" + "    h = relu(h)\n" * n +
       "    output h\n    loss softmax_cross_entropy(h, y)\n}\n")
fwd = netdsl.loads(src).lower(2)
step = add_optimizer(autodiff(fwd), "sgd", lr=0.01)
feeds = {"x": np.ones((2, 4), np.float32), "y": np.zeros(2, np.int64)}
out = {}
for what, g, training in (("evaluation", fwd, False), ("training", step, True)):
    ex = Executor(g, "numpy")
    roles = ("loss",) if not training else ("loss", "updates")
    for _ in range(10):
        ex.run(feeds, training=training, roles=roles)
    times = []
    for _ in range(50):
        t = time.perf_counter()
        ex.run(feeds, training=training, roles=roles)
        times.append(time.perf_counter() - t)
    nodes = len(ex.plan(roles).order)
    out[what] = {"nodes": nodes, "run_us_per_node": 1e6 * statistics.median(times) / nodes}
k = registry.OPS["relu"].kernel
node = fwd.nodes[-3]
ctx = KernelContext(False, None, "float32")
x = np.ones((2, 4), np.float32)
t = time.perf_counter()
for _ in range(200000):
    k(np, [x], node.attrs, ctx)
out["relu_kernel_us"] = 1e6 * (time.perf_counter() - t) / 200000
print(json.dumps(out))
"""


def run(nodes: int, src: str | None) -> dict:
    args = [sys.executable, "-c", CHILD, str(nodes)] + ([src] if src else [])
    res = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", metavar="REV", help="another revision, in the same run")
    ap.add_argument("--nodes", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    sources = {"netdsl": None}
    if a.baseline:
        from bench_step import export_revision
        sources[f"netdsl@{a.baseline}"] = str(export_revision(a.baseline))
    results: dict[str, list] = {k: [] for k in sources}
    for r in range(a.rounds):
        for label, src in sources.items():
            res = run(a.nodes, src)
            results[label].append(res)
            print(f"[round {r + 1}/{a.rounds}] {label:20s} evaluation "
                  f"{res['evaluation']['run_us_per_node']:.2f} us/node, training "
                  f"{res['training']['run_us_per_node']:.2f} us/node, relu kernel "
                  f"{res['relu_kernel_us']:.2f} us", flush=True)
    summary = {}
    for label, rs in results.items():
        kern = statistics.median(r["relu_kernel_us"] for r in rs)
        summary[label] = {
            what: {"us_per_node": statistics.median(r[what]["run_us_per_node"] for r in rs),
                   "nodes": rs[0][what]["nodes"]} for what in ("evaluation", "training")}
        ev = summary[label]["evaluation"]
        ev["executor_us_per_node"] = ev["us_per_node"] - kern
        summary[label]["relu_kernel_us"] = kern
    print(json.dumps(summary, indent=1))
    if a.baseline:
        new, old = (summary[k]["evaluation"]["executor_us_per_node"] for k in sources)
        print(f"executor's own time per node: {new:.2f} us against {old:.2f} us at "
              f"{a.baseline} ({new / old:.2f})")


if __name__ == "__main__":
    main()
