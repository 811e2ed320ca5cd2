"""netdsl's own training step on one network file, for bench_step.py.

    .venv/bin/python bench/refs/netdsl_step.py --file examples/resnet164-cifar.net \
        --batch 16 --steps 5 [--profile]

Builds the run exactly as `netdsl run` does (Trainer: forward graph bound to the batch,
autodiff, SGD with momentum; synthetic data; the file's schedule) and times the same call
that Trainer.fit times - `executor.run(feeds, training=True, roles=Trainer.ROLES)` plus
reading the loss - without fit's logging and final evaluation, and holds what fit holds
around its loop (the backend's `running()`, the batch's draw included; a revision from
before fit held it gets it here too). Besides the times it
reports the step's FLOPs (the registry's counts over the training graph, forward and
backward and update: `summarize(train_graph)`), the process's peak RSS and the executor's
own peak. With --profile, one more
step runs under cProfile and the report gives the kernels (registry ops' kernel
functions) by cumulative time and the functions by own time.
Prints one JSON line.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import statistics
import sys
import time
from pathlib import Path

from threads import threads_info  # (this folder)


def _use_source(argv: list[str]) -> None:
    """--src DIR: import netdsl and its stdlib from DIR (another revision's files, which
    bench_step.py --baseline exports) instead of this checkout's editable install."""
    if "--src" in argv:
        src = argv[argv.index("--src") + 1]
        sys.meta_path[:] = [f for f in sys.meta_path
                            if not getattr(f, "__module__", "").startswith("__editable__")]
        sys.path.insert(0, src)


_use_source(sys.argv)
import numpy as np  # noqa: E402

import netdsl  # noqa: E402
from netdsl.ir import registry  # noqa: E402
from netdsl.ir.stats import summarize  # noqa: E402
from netdsl.runtime.options import RunOptions  # noqa: E402
from netdsl.runtime.schedule import lr_at  # noqa: E402
from netdsl.runtime.trainer import Trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def one_step(tr: Trainer) -> tuple[float, float, float]:
    be = tr.executor.backend
    with be.running():  # as Trainer.fit holds it around its loop, the draws included
        return _step(tr, be)


def _step(tr: Trainer, be) -> tuple[float, float, float]:
    arrays = tr.loader.next()
    lr = lr_at(tr.cfg.schedule, tr.cfg.optimizer.lr, tr.step, tr.total)
    feeds = tr.feeds(arrays)
    feeds["lr"] = np.float32(lr)
    tr.executor.rng = be.rng(tr.cfg.seed * 1_000_003 + tr.step)
    t0, c0 = time.perf_counter(), time.process_time()
    out = tr.executor.run(feeds, training=True, roles=Trainer.ROLES)
    loss = float(be.to_host(out["loss"][0]))
    be.synchronize()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    tr.step += 1
    return dt, cpu, loss


def kernel_table(prof: cProfile.Profile, step_s: float, top: int) -> dict:
    st = pstats.Stats(prof)
    st.calc_callees()
    raw = st.stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    total = sum(v[2] for v in raw.values())
    by_code: dict[tuple, list[str]] = {}
    for name, op in registry.OPS.items():
        fn = op.kernel
        if fn is not None:
            c = fn.__code__
            by_code.setdefault((c.co_filename, c.co_firstlineno, c.co_name), []).append(name)
    kernels = []
    for key, ops in by_code.items():
        if key in raw:
            _cc, nc, tt, ct, _ = raw[key]
            kernels.append({"ops": ops, "function": f"{Path(key[0]).name}:{key[1]}({key[2]})",
                            "calls": nc, "cum_s": ct, "self_s": tt})
    kernels.sort(key=lambda r: -r["cum_s"])
    funcs = sorted(raw.items(), key=lambda kv: -kv[1][2])[:top]
    return {
        "profiled_total_s": total, "unprofiled_step_s": step_s,
        "kernels": kernels[:top],
        "kernels_all_s": sum(k["cum_s"] for k in kernels),
        "functions_by_self_time": [
            {"function": f"{Path(k[0]).name}:{k[1]}({k[2]})", "calls": v[1], "self_s": v[2]}
            for k, v in funcs],
    }


def op_times(tr: Trainer, steps: int = 1) -> list:
    """Wall time per op and step (no profiler): Executor._call timed with perf_counter,
    summed over `steps` steps and divided by them; calls are per step. On a GPU the device
    is synchronised around each op, so the time is the op's own."""
    ex = tr.executor
    orig = ex._call
    acc: dict[str, list] = {}
    sync = ex.backend.synchronize if ex.backend.name == "cupy" else (lambda: None)

    def timed(n, inputs, ctx):
        sync()
        t0 = time.perf_counter()
        out = orig(n, inputs, ctx)
        sync()
        e = acc.setdefault(n.op, [0, 0.0])
        e[0] += 1
        e[1] += time.perf_counter() - t0
        return out

    ex._call = timed
    try:
        for _ in range(steps):
            one_step(tr)
    finally:
        del ex._call
    return sorted(([op, c // steps, s / steps] for op, (c, s) in acc.items()),
                  key=lambda r: -r[2])


def fit_step(a) -> dict:
    """--fit: what `netdsl run FILE --steps N --eval-samples 0` reports as its step time
    (fit's memory meter, its loop and what it holds around it included)."""
    net = netdsl.load(a.file)
    r = Trainer(net.graph, net.train, RunOptions(steps=a.warmup + a.steps, batch=a.batch,
                                                 backend=a.backend, eval_samples=0)).fit()
    return {"framework": f"netdsl fit{f' @{a.label}' if a.label else ''}",
            "median_s": r.step_time_s, "losses": r.losses, "peak_bytes": r.peak_bytes}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", default=str(ROOT / "examples" / "resnet164-cifar.net"))
    ap.add_argument("--batch", type=int, default=None, help="default: the file's")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--op-steps", type=int, default=1,
                    help="with --profile: the per-op times over this many steps (averaged)")
    ap.add_argument("--label", default="", help="shown after `netdsl` in the report")
    ap.add_argument("--src", help="import netdsl from this directory (see _use_source)")
    ap.add_argument("--backend", default="numpy", choices=("numpy", "cupy"))
    ap.add_argument("--fit", action="store_true",
                    help="time the user's path instead: Trainer.fit over warmup + steps "
                         "steps (no evaluation), reporting its own median step_time_s")
    a = ap.parse_args()
    from threadpoolctl import threadpool_limits
    threadpool_limits(a.threads)
    # the fused kernels' Numba threads follow OMP_NUM_THREADS (numpy_fused.thread_count),
    # which bench_step.py sets for every framework; run alone, this script sets it too
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    if a.fit:
        print(json.dumps(fit_step(a)))
        return
    t0 = time.perf_counter()
    net = netdsl.load(a.file)
    extra = 1 + a.op_steps if a.profile else 0
    tr = Trainer(net.graph, net.train, RunOptions(steps=a.warmup + a.steps + extra,
                                                 batch=a.batch, backend=a.backend))
    build_s = time.perf_counter() - t0
    times, cpus, losses = [], [], []
    for k in range(a.warmup + a.steps):
        dt, cpu, loss = one_step(tr)
        if k >= a.warmup:
            times.append(dt)
            cpus.append(cpu)
            losses.append(loss)
    label = f" @{a.label}" if a.label else ""
    res = {"framework": f"netdsl{label} (NumPy {np.__version__})",
           "params": tr.stats.params, "times": times, "cpu_times": cpus,
           "median_s": statistics.median(times),
           "losses": losses, "build_s": build_s, "peak_bytes": tr.executor.peak_bytes,
           "expected_bytes": tr.planned_peak_bytes(), "batch": tr.batch,
           "step_flops": summarize(tr.train_graph).flops_forward,
           "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "threadpools": threads_info()}
    rep = getattr(tr.executor, "replay", None)  # (None in revisions before CUDA graphs)
    if rep is not None:  # NETDSL_CUDA_GRAPH=1: was the step recorded, and if not, why
        from netdsl.runtime.replay import Recorded
        res["replay"] = {"recorded": [f"{'/'.join(k[0])} training={k[1]}" for k, v in
                                      rep.kinds.items() if isinstance(v, Recorded)],
                         "not_recorded": [f"{'/'.join(k[0])} training={k[1]}: {why}"
                                          for k, why in rep.reasons.items()]}
    if a.backend == "cupy":  # the pool's high-water mark: what CuPy took from the device
        be = tr.executor.backend
        cupy = be.xp
        dnn = getattr(be, "cudnn_status", "")  # (revisions before cuDNN have none)
        res["framework"] = f"netdsl (CuPy {cupy.__version__}" + (
            f", {dnn.split(' (')[0]})" if dnn.startswith("cuDNN") else ", no cuDNN)")
        res["cudnn"] = dnn
        res["device_peak_bytes"] = cupy.get_default_memory_pool().total_bytes()
        res["gpu"] = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    if a.profile:
        res["op_times"] = op_times(tr, a.op_steps)
        prof = cProfile.Profile()
        prof.enable()
        one_step(tr)
        prof.disable()
        res["profile"] = kernel_table(prof, res["median_s"], a.top)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
