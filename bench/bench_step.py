"""One ResNet-164 training step: netdsl vs PyTorch vs Chainer, in the same run (issue 3).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE /work/venv/bin/python bench/bench_step.py

The network is examples/resnet164-cifar.net (CIFAR pre-activation bottleneck ResNet-164,
1,703,258 parameters), batch 16 of 32x32x3 inputs, 10 classes, softmax cross-entropy and
SGD with momentum 0.9 (weight decay 1e-4). The same network is written as a small
reference program for each framework under bench/refs/:

  netdsl   refs/netdsl_resnet164.py   this checkout, run with this interpreter
  PyTorch  refs/torch_resnet164.py    nn.Module, torch==2.13.0 (CPU wheel), bench/.venvs/torch
  Chainer  refs/chainer_resnet164.py  chainer.Chain, chainer==7.8.1 on numpy<2,
                                      bench/.venvs/chainer

The references live in their own virtual environments (git-ignored, never project
dependencies); they are created on first use and reused after that (--setup-only makes
them and stops). Each reference runs as a subprocess with the same thread count
(--threads, default 2: OMP/OPENBLAS/MKL_NUM_THREADS and the framework's own setting),
does --warmup steps, then times --steps steps of forward + backward + SGD update; the
frameworks take turns for --rounds rounds, so load from other processes hits all three
alike. The figure compared is the median of each framework's quietest round (the lowest
round median: on a shared machine other processes come and go, and a BLAS thread team
that loses a core slows 3-10x); the min, the median over all timed steps and CPU seconds
per step are shown too. It checks that all three count the same parameters, then runs
`netdsl run FILE --steps 3 --batch 16 --json` (the CLI figures) and a cProfile of one
netdsl step (top kernels), unless --no-cli / --no-profile.

OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE, when set (this machine sets them for old OpenBLAS
builds), pin OpenBLAS to a slower kernel: unset both in the benchmark command only, as
above; the report prints the kernel threadpoolctl sees in each process.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
VENVS = BENCH / ".venvs"
REFS = BENCH / "refs"
NET = ROOT / "examples" / "resnet164-cifar.net"
PARAMS = 1_703_258

# name -> (venv, check that the venv is complete, pip installs in order, extra env)
REFERENCES = {
    "PyTorch": ("torch", "import torch, threadpoolctl; assert torch.__version__.startswith("
                         "'2.13.0'), torch.__version__",
                [["torch==2.13.0", "numpy", "threadpoolctl"]], {}),
    "Chainer": ("chainer", "import chainer, threadpoolctl; assert chainer.__version__ == '7.8.1'",
                # chainer 7.8.1 ships only an sdist; it builds against the venv's own
                # setuptools (<70, so no build isolation) and needs `wheel` for bdist_wheel
                [["numpy<2", "setuptools<70", "wheel", "threadpoolctl"],
                 ["--no-build-isolation", "chainer==7.8.1"]],
                {"SETUPTOOLS_USE_DISTUTILS": "stdlib"}),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def venv_python(name: str) -> Path:
    return VENVS / name / "bin" / "python"


def ensure_venv(framework: str) -> Path:
    """Create the reference's venv unless it is already complete (idempotent)."""
    name, check, installs, extra = REFERENCES[framework]
    py = venv_python(name)
    env = {**os.environ, **extra}
    if py.exists() and subprocess.run([py, "-c", check], env=env, capture_output=True,
                                      cwd=BENCH).returncode == 0:
        return py
    log(f"[setup] creating {py.parent.parent} for {framework}")
    VENVS.mkdir(parents=True, exist_ok=True)
    base = getattr(sys, "_base_executable", None) or sys.executable
    if not py.exists():
        subprocess.run([base, "-m", "venv", VENVS / name], check=True)
    for pkgs in installs:
        subprocess.run([py, "-m", "pip", "install", "-q", *pkgs], check=True, env=env,
                       cwd=BENCH)
    r = subprocess.run([py, "-c", check], env=env, capture_output=True, text=True, cwd=BENCH)
    if r.returncode:
        raise SystemExit(f"{framework} venv is incomplete after install:\n{r.stderr}")
    return py


def child_env(threads: int, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[k] = str(threads)
    env.update(extra or {})
    return env


def run_json(cmd: list, env: dict, timeout: float) -> dict:
    """Run one reference program; its last stdout line is a JSON object."""
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    r = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n"
                         f"{r.stderr[-4000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["wall_s"], out["load"] = wall, (load0, os.getloadavg()[0])
    return out


def kernel_of(res: dict) -> str:
    pools = res.get("threadpools") or []
    return ", ".join(f"{p['internal_api']} {p.get('version') or ''} {p.get('architecture') or ''}"
                     f" x{p['num_threads']}".replace("  ", " ") for p in pools)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run (default 5)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2,
                    help="times each framework runs, taking turns (default 2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=("netdsl", "PyTorch", "Chainer"), action="append",
                    help="run only these (repeatable)")
    ap.add_argument("--no-cli", action="store_true", help="skip the `netdsl run` figures")
    ap.add_argument("--no-profile", action="store_true", help="skip the cProfile of netdsl")
    ap.add_argument("--setup-only", action="store_true", help="make the venvs and stop")
    ap.add_argument("--json-out", help="also write every figure to this JSON file")
    a = ap.parse_args(argv)
    frameworks = a.only or ["netdsl", "PyTorch", "Chainer"]

    pinned = {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
              if k in os.environ}
    if pinned:
        log(f"WARNING: {pinned} is set: OpenBLAS is pinned to that kernel; unset both with "
            "`env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE` for the benchmark command")

    cmds: dict[str, tuple[list, dict]] = {}
    args = ["--batch", a.batch, "--steps", a.steps, "--warmup", a.warmup,
            "--threads", a.threads]
    for fw in frameworks:
        if fw == "netdsl":
            cmds[fw] = ([sys.executable, REFS / "netdsl_resnet164.py", "--file", NET, *args],
                        child_env(a.threads))
        else:
            py = ensure_venv(fw)
            name = REFERENCES[fw][0]
            cmds[fw] = ([py, REFS / f"{name}_resnet164.py", *args],
                        child_env(a.threads, REFERENCES[fw][3]))
    if a.setup_only:
        return 0

    t_start = time.perf_counter()
    runs: dict[str, list[dict]] = {fw: [] for fw in frameworks}
    for r in range(a.rounds):
        for fw in frameworks:
            cmd, env = cmds[fw]
            res = run_json(cmd, env, timeout=900)
            runs[fw].append(res)
            log(f"[round {r + 1}/{a.rounds}] {fw:8s} median {res['median_s']:.3f} s/step "
                f"(steps {', '.join(f'{t:.2f}' for t in res['times'])}; "
                f"load {res['load'][0]:.1f}->{res['load'][1]:.1f})")

    summary = {}
    for fw, rs in runs.items():
        times = [t for res in rs for t in res["times"]]
        cpus = [t for res in rs for t in res.get("cpu_times", [])]
        # other processes come and go on a shared machine: each round's median, and the
        # figure compared is the quietest round's (all steps' median and min shown too)
        best = min(rs, key=lambda res: res["median_s"])
        summary[fw] = {"framework": rs[0]["framework"], "params": rs[0]["params"],
                       "median_s": best["median_s"], "all_median_s": statistics.median(times),
                       "min_s": min(times), "round_medians": [res["median_s"] for res in rs],
                       "best_load": best["load"],
                       "cpu_median_s": statistics.median(best["cpu_times"]) if cpus else None,
                       "steps": len(times), "kernel": kernel_of(rs[0]),
                       "losses": rs[0]["losses"]}
        for k in ("peak_bytes", "expected_bytes", "cpu_capability", "mkldnn"):
            if k in rs[0]:
                summary[fw][k] = rs[0][k]

    bad = {fw: s["params"] for fw, s in summary.items() if s["params"] != PARAMS}
    if bad:
        raise SystemExit(f"parameter counts disagree: expected {PARAMS:,}, got {bad}")

    cli = None
    if not a.no_cli and "netdsl" in frameworks:
        netdsl_bin = Path(sys.executable).with_name("netdsl")
        cmd = [netdsl_bin, "run", NET.relative_to(ROOT), "--steps", "3", "--batch",
               str(a.batch), "--json"]
        t0 = time.perf_counter()
        r = subprocess.run([str(c) for c in cmd], env=child_env(a.threads), cwd=ROOT,
                           capture_output=True, text=True, timeout=900)
        if r.returncode:
            raise SystemExit(f"`netdsl run` failed ({r.returncode}):\n{r.stderr[-4000:]}")
        cli = json.loads(r.stdout)
        cli["wall_s"] = time.perf_counter() - t0
        log(f"[cli] netdsl run: step_time_s {cli['step_time_s']:.3f}, images_per_s "
            f"{cli['images_per_s']:.2f}, peak_bytes {cli['peak_bytes']:,}")

    prof = None
    if not a.no_profile and "netdsl" in frameworks:
        cmd = [sys.executable, REFS / "netdsl_resnet164.py", "--file", NET, "--batch",
               a.batch, "--steps", 1, "--warmup", 1, "--threads", a.threads, "--profile",
               "--top", 5]
        prof = run_json(cmd, child_env(a.threads), timeout=900)
    elapsed = time.perf_counter() - t_start

    # -- report ------------------------------------------------------------------------------
    print(f"ResNet-164 (CIFAR pre-activation bottleneck) training step, batch {a.batch}, "
          f"32x32x3, 10 classes, SGD momentum; {a.threads} threads each")
    print(f"{a.rounds} rounds x ({a.warmup} warm-up + {a.steps} timed steps) per framework; "
          f"compared: the median of the quietest round; whole run {elapsed:.0f} s")
    print(f"OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE in the environment: {pinned or 'unset'}")
    counts = ", ".join(f"{fw} {s['params']:,}" for fw, s in summary.items())
    print(f"parameters: {counts} (expected {PARAMS:,}: agree)")
    print()
    nd = summary.get("netdsl")
    print("| framework | s/step (best round median) | min | all steps median | "
          "CPU s/step | netdsl / this |")
    print("|---|---:|---:|---:|---:|---:|")
    for s in summary.values():
        ratio = f"{nd['median_s'] / s['median_s']:.2f}x" if nd else "-"
        cpu = f"{s['cpu_median_s']:.3f}" if s["cpu_median_s"] is not None else "-"
        print(f"| {s['framework']} | {s['median_s']:.3f} | {s['min_s']:.3f} | "
              f"{s['all_median_s']:.3f} | {cpu} | {ratio} |")
    print()
    for fw, s in summary.items():
        print(f"round medians {fw}: {', '.join(f'{m:.3f}' for m in s['round_medians'])} s"
              f" (load average in the best round {s['best_load'][0]:.1f}->"
              f"{s['best_load'][1]:.1f})")
    print()
    for fw, s in summary.items():
        print(f"BLAS/threads {fw}: {s['kernel']}"
              + (f"; torch cpu capability {s['cpu_capability']}, mkldnn {s['mkldnn']}"
                 if "cpu_capability" in s else ""))
    if nd:
        print(f"netdsl step peak_bytes {nd['peak_bytes']:,} (predicted {nd['expected_bytes']:,})")
    if cli:
        print(f"\nnetdsl run {NET.relative_to(ROOT)} --steps 3 --batch {a.batch} --json:")
        print("  " + ", ".join(f"{k} {cli[k]}" for k in
                                ("steps", "step_time_s", "images_per_s", "peak_bytes",
                                 "expected_bytes", "params", "final_loss")))
    if prof:
        p = prof["profile"]
        print(f"\ncProfile of one netdsl step: {p['profiled_total_s']:.2f} s profiled "
              f"(step {prof['times'][0]:.2f} s unprofiled just before); kernels by "
              "cumulative time:")
        for k in p["kernels"]:
            print(f"  {k['cum_s']:7.3f} s {100 * k['cum_s'] / p['profiled_total_s']:5.1f}%  "
                  f"{'/'.join(k['ops']):24s} {k['function']} x{k['calls']}")
        print("functions by own time:")
        for f in p["functions_by_self_time"]:
            print(f"  {f['self_s']:7.3f} s {100 * f['self_s'] / p['profiled_total_s']:5.1f}%  "
                  f"{f['function']} x{f['calls']}")
        print("wall time per op, one step, no profiler (top 8):")
        tot = sum(r[2] for r in prof["op_times"])
        for op, calls, s in prof["op_times"][:8]:
            print(f"  {s:7.3f} s {100 * s / tot:5.1f}%  {op} x{calls}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(
            {"summary": summary, "runs": runs, "cli": cli, "profile": prof,
             "pinned_env": pinned, "elapsed_s": elapsed}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
