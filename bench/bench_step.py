"""One training step per network: netdsl vs PyTorch (and Chainer) in the same run (issue 8).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/bench_step.py \
        --nets resnet164,digits-cnn,transformer-tiny        # or --nets all

Networks (--nets, comma-separated, or `all`): the example files below at the batch given,
each with its file's optimizer, one full step (forward, backward, optimizer update):

  resnet164         examples/resnet164-cifar.net   batch 16, 32x32        (Chainer too)
  resnet50          examples/resnet50.net          batch 16, 224x224
  resnet1001        examples/resnet1001-cifar.net  batch 16, 32x32        (Chainer too)
  digits-cnn        examples/digits-cnn.net        batch 32, 8x8
  transformer-tiny  examples/transformer-tiny.net  batch 32, 32 tokens
  vgg16             examples/vgg16.net             batch 8, 224x224
  mobilenet_v2      examples/mobilenet_v2.net      batch 8, 224x224       (depthwise convs)

Each framework has a small reference program under bench/refs/ and its own process:

  netdsl   refs/netdsl_step.py      this checkout, run with this interpreter
  PyTorch  refs/torch_step.py       refs/torch_models.py; torch==2.13.0 (CPU), bench/.venvs/torch
  Chainer  refs/chainer_resnet164.py  chainer==7.8.1 on numpy<2, bench/.venvs/chainer
                                    (the pre-activation ResNets only)

The references live in their own virtual environments (git-ignored, never project
dependencies); they are created on first use and reused after that (--setup-only makes
them and stops). Each reference runs as a subprocess with the same thread count
(--threads, default 2: OMP/OPENBLAS/MKL_NUM_THREADS and the framework's own setting),
does --warmup steps, then times --steps steps; the frameworks take turns for --rounds
rounds, so load from other processes hits them alike. The figure compared is the median
of each framework's quietest round (the lowest round median: on a shared machine other
processes come and go). Every process reports its peak RSS (ru_maxrss, so each
framework's high-water mark is its own); netdsl also reports its executor's own peak.
CPU s/step (the process's CPU time per step, the best round's median) is shown too: with
--threads 1 it is steadier than wall time when other processes share the cores.
GFLOP/s are the step's FLOPs (netdsl's registry counts over the training graph, the same
network for every framework) over the step time; the float32 GEMM rate (a 2048^3 product
in NumPy and in torch, the best of both) is measured in the same run, before the first
network and again after the last (the higher of the two counts), and each GFLOP/s
figure is also given as a share of it. The parameter counts of
all frameworks are checked to agree. With --baseline REV, netdsl as of git revision REV
(its netdsl/, stdlib/ and grammar/ exported to bench/.baseline/REV, git-ignored) runs as one more
framework in the same rotation, so a change is measured against its base under the same
load; the last column is then against it too. With --profile, a cProfile and per-op times of one
netdsl step of the first network follow the table.

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

# name -> (example file, batch, Chainer's --blocks or None when it has no reference)
NETWORKS = {
    "resnet164": ("resnet164-cifar.net", 16, 18),
    "resnet50": ("resnet50.net", 16, None),
    "resnet1001": ("resnet1001-cifar.net", 16, 111),
    "digits-cnn": ("digits-cnn.net", 32, None),
    "transformer-tiny": ("transformer-tiny.net", 32, None),
    "vgg16": ("vgg16.net", 8, None),
    "mobilenet_v2": ("mobilenet_v2.net", 8, None),
}

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


def gemm_rate(cmds: dict, threads: int, gpu: bool = False) -> dict:
    """The float32 GEMM rate of NumPy's BLAS (this interpreter) and of torch, if run; with
    `gpu`, of CuPy's cuBLAS and torch on CUDA (8192^3: 2048^3 is too short on a GPU)."""
    rates = {}
    for fw, py in (("netdsl", sys.executable), ("PyTorch", cmds.get("PyTorch", [None])[0])):
        if py is None:
            continue
        cmd = [py, REFS / "gemm_rate.py", "--threads", threads] + (["--torch"] if
                                                                  fw == "PyTorch" else [])
        cmd += ["--gpu", "--n", 8192, "--repeats", 10] if gpu else []
        rates[fw] = run_json(cmd, child_env(threads), timeout=300)
    return rates


def export_revision(rev: str) -> Path:
    """netdsl/, stdlib/ and grammar/ as of git revision `rev`, under bench/.baseline/ (reused).
    `rev` may also name such an export (a machine without the git history: the GPU's)."""
    if (Path(rev) / "netdsl" / "__init__.py").exists():
        return Path(rev).resolve()
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    dest = BENCH / ".baseline" / sha
    if not (dest / "netdsl" / "__init__.py").exists():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", sha, "netdsl", "stdlib", "grammar"], cwd=ROOT,
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    return dest


def commands(net: str, fw: str, a, pythons: dict) -> tuple[list, dict] | None:
    file, batch, blocks = NETWORKS[net]
    batch = a.batch or batch
    common = ["--batch", batch, "--steps", a.steps, "--warmup", a.warmup,
              "--threads", a.threads]
    if fw == "netdsl":
        return ([sys.executable, REFS / "netdsl_step.py", "--file", ROOT / "examples" / file,
                 "--backend", a.backend, *common], child_env(a.threads))
    if fw.startswith("netdsl+"):  # a --variant: this checkout with its environment
        label = fw.split("+", 1)[1]
        return ([sys.executable, REFS / "netdsl_step.py", "--file", ROOT / "examples" / file,
                 "--label", label, "--backend", a.backend, *common],
                child_env(a.threads, a.variants[label]))
    if fw.startswith("netdsl@"):
        return ([sys.executable, REFS / "netdsl_step.py", "--file", ROOT / "examples" / file,
                 "--src", pythons[fw], "--label", fw.split("@", 1)[1], "--backend",
                 a.backend, *common],
                child_env(a.threads))
    if fw == "PyTorch":
        return ([pythons[fw], REFS / "torch_step.py", "--net", net, "--device",
                 "cuda" if a.backend == "cupy" else "cpu", *common,
                 *(["--tf32"] if a.torch_tf32 else [])],
                child_env(a.threads))
    if blocks is None:
        return None
    return ([pythons[fw], REFS / "chainer_resnet164.py", "--blocks", blocks, *common],
            child_env(a.threads, REFERENCES[fw][3]))


def summarise(rs: list[dict]) -> dict:
    times = [t for res in rs for t in res["times"]]
    # other processes come and go on a shared machine: each round's median, and the
    # figure compared is the quietest round's (all steps' median and min shown too)
    best = min(rs, key=lambda res: res["median_s"])
    out = {"framework": rs[0]["framework"], "params": rs[0]["params"],
           "median_s": best["median_s"], "all_median_s": statistics.median(times),
           "min_s": min(times), "round_medians": [res["median_s"] for res in rs],
           "best_load": best["load"], "cpu_median_s": statistics.median(best["cpu_times"]),
           "rss_peak_bytes": max(res["rss_peak_bytes"] for res in rs),
           "steps": len(times), "kernel": kernel_of(rs[0]), "losses": rs[0]["losses"]}
    for k in ("peak_bytes", "expected_bytes", "cpu_capability", "mkldnn", "step_flops",
              "batch", "device_peak_bytes", "gpu", "cudnn", "cudnn_tf32"):
        if k in rs[0]:
            out[k] = rs[0][k]
    return out


def mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def machine() -> str:
    """The CPU the figures were measured on (model, cores this process may use, widest
    vector extension), for the report: the tables of different sessions come from
    different machines, and only ratios within one run compare."""
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    isa = next((f for f in ("avx512f", "avx2", "sse4_2") if f in flags), "?")
    return f"{model}, {len(os.sched_getaffinity(0))} cores, {isa.upper()}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", default="resnet164",
                    help=f"comma-separated, or `all`: {', '.join(NETWORKS)} (default resnet164)")
    ap.add_argument("--batch", type=int, default=None, help="override every network's batch")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run (default 5)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2,
                    help="times each framework runs, taking turns (default 2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=("netdsl", "PyTorch", "Chainer"), action="append",
                    help="run only these (repeatable)")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile and per-op times of one netdsl step of the first network")
    ap.add_argument("--baseline", metavar="REV",
                    help="also run netdsl as of this git revision (or from such an export: "
                    "a directory with netdsl/, stdlib/, grammar/), in the same rotation")
    ap.add_argument("--setup-only", action="store_true", help="make the venvs and stop")
    ap.add_argument("--json-out", help="also write every figure to this JSON file")
    ap.add_argument("--backend", default="numpy", choices=("numpy", "cupy"),
                    help="cupy: netdsl on the GPU against PyTorch on CUDA (no Chainer)")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:VAR=VALUE",
                    help="also run this checkout with these environment variables (comma-"
                    "separated), e.g. graphs:NETDSL_CUDA_GRAPH=1; repeatable")
    ap.add_argument("--torch-tf32", action="store_true",
                    help="--backend cupy: PyTorch's convolutions on TF32 tensor cores, its "
                         "default (without: float32 arithmetic, as netdsl's)")
    ap.add_argument("--torch-python", metavar="PYTHON",
                    help="run PyTorch with this interpreter instead of bench/.venvs/torch "
                    "(a GPU machine's own torch with CUDA)")
    a = ap.parse_args(argv)
    frameworks = a.only or ["netdsl", "PyTorch", "Chainer"]
    if a.backend == "cupy" and "Chainer" in frameworks:
        frameworks.remove("Chainer")
    a.variants = {}
    for v in a.variant:
        label, _, assigns = v.partition(":")
        a.variants[label] = dict(kv.split("=", 1) for kv in assigns.split(",") if kv)
        frameworks.insert(1, f"netdsl+{label}")
    nets = list(NETWORKS) if a.nets == "all" else [n.strip() for n in a.nets.split(",")]
    unknown = [n for n in nets if n not in NETWORKS]
    if unknown:
        ap.error(f"unknown network(s) {unknown}: choose from {', '.join(NETWORKS)} or all")
    if "Chainer" in frameworks and all(NETWORKS[n][2] is None for n in nets):
        frameworks.remove("Chainer")

    pinned = {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
              if k in os.environ}
    if pinned:
        log(f"WARNING: {pinned} is set: OpenBLAS is pinned to that kernel; unset both with "
            "`env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE` for the benchmark command")
    pythons = {fw: Path(a.torch_python) if fw == "PyTorch" and a.torch_python
               else ensure_venv(fw) for fw in frameworks
               if fw in ("PyTorch", "Chainer")}
    if a.baseline:
        src = export_revision(a.baseline)
        frameworks.insert(1, f"netdsl@{src.name}")
        pythons[frameworks[1]] = src
    if a.setup_only:
        return 0

    t_start = time.perf_counter()
    gpu = a.backend == "cupy"
    rates = gemm_rate({fw: [py] for fw, py in pythons.items() if fw == "PyTorch"}, a.threads,
                      gpu)
    gemm = max(r["gflops"] for r in rates.values())
    log("[gemm] " + ", ".join(f"{r['library']} {r['gflops']:.0f} GFLOP/s"
                              for r in rates.values()))
    table: dict[str, dict] = {}
    for net in nets:
        cmds = {fw: c for fw in frameworks if (c := commands(net, fw, a, pythons))}
        runs: dict[str, list[dict]] = {fw: [] for fw in cmds}
        for r in range(a.rounds):
            for fw, (cmd, env) in cmds.items():
                try:
                    res = run_json(cmd, env, timeout=1800)
                except SystemExit as e:  # one framework's failure costs only its column
                    log(f"[{net} round {r + 1}/{a.rounds}] {fw} FAILED: {e}")
                    continue
                runs[fw].append(res)
                for line in (res.get("replay") or {}).get("not_recorded", []):
                    log(f"[{net}] {fw}: not replayed as a CUDA graph: {line}")
                log(f"[{net} round {r + 1}/{a.rounds}] {fw:8s} median {res['median_s']:.3f} "
                    f"s/step (steps {', '.join(f'{t:.2f}' for t in res['times'])}; load "
                    f"{res['load'][0]:.1f}->{res['load'][1]:.1f}; RSS "
                    f"{mb(res['rss_peak_bytes'])} MB)")
        summary = {fw: summarise(rs) for fw, rs in runs.items() if rs}
        counts = {fw: s["params"] for fw, s in summary.items()}
        if len(set(counts.values())) > 1:
            raise SystemExit(f"{net}: parameter counts disagree: {counts}")
        table[net] = {"summary": summary, "runs": runs}

    # once more after the networks: on a shared machine the quieter of the two is the rate
    for fw, r in gemm_rate({fw: [py] for fw, py in pythons.items() if fw == "PyTorch"},
                           a.threads, gpu).items():
        if r["gflops"] > rates[fw]["gflops"]:
            rates[fw] = r
    gemm = max(r["gflops"] for r in rates.values())

    prof = None
    if a.profile and "netdsl" in frameworks:
        file, batch, _ = NETWORKS[nets[0]]
        cmd = [sys.executable, REFS / "netdsl_step.py", "--file", ROOT / "examples" / file,
               "--batch", a.batch or batch, "--steps", 1, "--warmup", 1, "--threads",
               a.threads, "--profile", "--top", 8]
        prof = run_json(cmd, child_env(a.threads), timeout=1800)
    elapsed = time.perf_counter() - t_start

    # -- report ------------------------------------------------------------------------------
    print(f"One training step (forward, backward, the file's optimizer update); {a.threads} "
          f"threads each; {a.rounds} rounds x ({a.warmup} warm-up + {a.steps} timed steps) "
          f"per framework, taking turns; compared: the median of the quietest round; whole "
          f"run {elapsed:.0f} s")
    print(f"Machine: {machine()}; OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE in the environment: "
          f"{pinned or 'unset'}")
    if gpu:
        gpus = {s.get("gpu") for t in table.values() for s in t["summary"].values()}
        print(f"GPU: {', '.join(sorted(g for g in gpus if g))}; netdsl --backend cupy, PyTorch "
              "on CUDA (its defaults: cuDNN, TF32 in convolutions); peak MB is each "
              "framework's device memory pool high-water mark")
    print(f"float32 GEMM rate ({8192 if gpu else 2048}^3, best of {10 if gpu else 5}, before "
          "and after the networks): " + ", ".join(
        f"{r['library']} {r['gflops']:.0f} GFLOP/s" for r in rates.values())
        + f"; % GEMM below is of {gemm:.0f}")
    print()
    print("| network | batch | framework | ms/step | images/s | GFLOP/s | % GEMM | "
          f"peak {'GPU pool' if gpu else 'RSS'} MB | netdsl peak MB | CPU s/step | "
          "netdsl / this |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for net, t in table.items():
        summ = t["summary"]
        nd = summ.get("netdsl")
        flops = nd["step_flops"] if nd else None
        for s in summ.values():
            batch = a.batch or NETWORKS[net][1]
            gf = flops / s["median_s"] / 1e9 if flops else None
            ratio = f"{nd['median_s'] / s['median_s']:.2f}" if nd else "-"
            print(f"| {net} | {batch} | {s['framework']} | {1000 * s['median_s']:.1f} | "
                  f"{batch / s['median_s']:.1f} | {f'{gf:.1f}' if gf else '-'} | "
                  f"{f'{100 * gf / gemm:.1f}' if gf else '-'} | "
                  f"{mb(s.get('device_peak_bytes') if gpu else s['rss_peak_bytes'])} | "
                  f"{mb(s.get('peak_bytes'))} | {s['cpu_median_s']:.3f} | {ratio} |")
    print()
    for net, t in table.items():
        for fw, s in t["summary"].items():
            print(f"{net} {fw}: round medians {', '.join(f'{m:.3f}' for m in s['round_medians'])}"
                  f" s, min {s['min_s']:.3f}, CPU {s['cpu_median_s']:.3f} s/step, load "
                  f"{s['best_load'][0]:.1f}->{s['best_load'][1]:.1f}; params {s['params']:,}"
                  + (f"; step {s['step_flops'] / 1e9:.2f} GFLOP" if "step_flops" in s else ""))
    print()
    kernels = {fw: s["kernel"] for t in table.values() for fw, s in t["summary"].items()}
    for fw, k in kernels.items():
        print(f"BLAS/threads {fw}: {k}")
    if prof:
        p = prof["profile"]
        print(f"\ncProfile of one netdsl step of {nets[0]}: {p['profiled_total_s']:.2f} s "
              f"profiled (step {prof['times'][0]:.2f} s unprofiled just before); kernels by "
              "cumulative time:")
        for k in p["kernels"]:
            print(f"  {k['cum_s']:7.3f} s {100 * k['cum_s'] / p['profiled_total_s']:5.1f}%  "
                  f"{'/'.join(k['ops']):24s} {k['function']} x{k['calls']}")
        print("functions by own time:")
        for f in p["functions_by_self_time"]:
            print(f"  {f['self_s']:7.3f} s {100 * f['self_s'] / p['profiled_total_s']:5.1f}%  "
                  f"{f['function']} x{f['calls']}")
        print("wall time per op, one step, no profiler (top 12):")
        tot = sum(r[2] for r in prof["op_times"])
        for op, calls, sec in prof["op_times"][:12]:
            print(f"  {sec:7.3f} s {100 * sec / tot:5.1f}%  {op} x{calls}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(
            {"table": table, "gemm": rates, "profile": prof, "pinned_env": pinned,
             "elapsed_s": elapsed}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
