"""The toolchain's own speed (issue 45): each command of the compile path on resnet2504,
as a user runs it (a fresh process), against its target, with a fingerprint of what it
decided so that "the same decisions" is checked rather than read.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/bench_compile.py \
        [--only check,plan,split,run,errors] [--runs 3] [--ref DIR] [--record FILE]

- `check`: `netdsl check examples/resnet2504.net`, whole process (target 1.5 s).
- `plan`: `netdsl plan examples/resnet2504.net --mem 12GB --batch 16 --json`, whole
  process, on `--profile cpu` and `--profile k40-12gb` (target 5 s each).
- `split`: `netdsl split examples/resnet2504.net --devices 4 --batch 16 --mem 12GB
  --json` on both profiles (target 30 s, and at most 1 GB resident: the largest sum of
  the resident sets of the command and its worker processes, sampled every 50 ms).
- `run`: `netdsl run examples/resnet2504.net --mem 12GB --steps 1`, from the start of the
  process to the first step's first kernel (target 10 s): the command runs in a process
  whose Executor.run exits the process when the first step calls it.
- `errors`: `netdsl check` of `repeat 1_000_000 { h = relu(h) }` followed by a misspelt
  name (target 2 s; the error must name the misspelt name).

Each line is the median of `--runs` runs (split and run: one) and its ratio to the
target, with the CPU seconds of the command's processes beside it (which other processes
on a shared machine change less than the wall time). The fingerprint of a plan is a
digest of its decisions (every value's), peaks and predicted times; of a split, of its
choice (the split, its per-device table and plan). They are compared with those recorded
in bench/refs/compile_fingerprints.json (made by `--record` at the reference commit),
and with `--ref DIR` (a checkout of another commit: `git archive COMMIT | tar -x -C
DIR`) the same commands run there too, timed in turn with this checkout's, so both are
measured on the same machine at the same time.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NET = "examples/resnet2504.net"
FINGERPRINTS = ROOT / "bench" / "refs" / "compile_fingerprints.json"
PROFILES = ("cpu", "k40-12gb")
MILLION = """network million {
    input x: f32[N, 16]
    input y: i64[N]

    h = x
    repeat 1_000_000 {
        h = relu(h)
    }
    logits = linear(hh, 10)
    output logits
    loss softmax_cross_entropy(logits, y)
}
"""
# the run target's child: the command as `netdsl` runs it, stopped at its first kernel
FIRST_KERNEL = """
import os, sys
from netdsl.runtime import executor
def first(*args, **kwargs):
    sys.stderr.write("first kernel\\n"); sys.stderr.flush(); os._exit(0)
executor.Executor.run = first
from netdsl_cli.app import main
sys.argv = ["netdsl", *sys.argv[1:]]
main()
"""


def env_for(checkout: Path) -> dict:
    """The environment that runs `checkout`'s netdsl with this interpreter."""
    env = dict(os.environ)
    if checkout != ROOT:
        for data in ("grammar", "stdlib"):  # (where an installed netdsl has them)
            link = checkout / "netdsl" / data
            if not link.exists():
                link.symlink_to(Path("..") / data)
        env["PYTHONPATH"] = f"{checkout}{os.pathsep}{checkout / 'cli'}"
    return env


def tree_rss(pid: int) -> int:
    """The resident bytes of process `pid` and its descendants."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for t in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (t / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


def timed(cmd: list[str], checkout: Path, cwd: Path) -> tuple[float, int, int, str, str]:
    """(wall seconds, peak resident bytes of the process tree, exit code, stdout,
    stderr) of `cmd` run in `cwd` with `checkout`'s netdsl."""
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env_for(checkout), stdout=out, stderr=err,
                            text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc.pid))
        time.sleep(0.05)
    dt = time.perf_counter() - t0
    out.seek(0)
    err.seek(0)
    return dt, peak, proc.returncode, out.read(), err.read()


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def plan_fingerprint(d: dict) -> str:
    """What a plan decided and predicted: everything but its own timings."""
    return digest({k: v for k, v in d.items() if k not in ("plan_s", "verify_s")})


def split_fingerprint(d: dict) -> str:
    """A split's choice: the split, its per-device table, traffic, times and its plan."""
    plan = dict(d.get("memory_plan") or {})
    plan.pop("plan_s", None)
    keys = ("spec", "per_device", "comm_bytes_total", "predicted_step_s", "bubble",
            "single_device_step_s")
    return digest({**{k: d[k] for k in keys}, "memory_plan": plan})


def targets(only: set[str], tmp: Path) -> list[tuple]:
    """(key, label, command, target seconds, target bytes, fingerprint) of each target."""
    py = sys.executable
    out = []
    if "check" in only:
        out.append(("check", "check resnet2504", [py, "-m", "netdsl_cli", "check", NET],
                    1.5, None, None))
    for prof in PROFILES if "plan" in only else ():
        out.append((f"plan-{prof}", f"plan --profile {prof}",
                    [py, "-m", "netdsl_cli", "plan", NET, "--mem", "12GB", "--batch", "16",
                     "--profile", prof, "--json"], 5.0, None, plan_fingerprint))
    for prof in PROFILES if "split" in only else ():
        out.append((f"split-{prof}", f"split --profile {prof}",
                    [py, "-m", "netdsl_cli", "split", NET, "--devices", "4", "--batch",
                     "16", "--mem", "12GB", "--profile", prof, "--json"], 30.0, 1e9,
                    split_fingerprint))
    if "run" in only:
        out.append(("run", "run --steps 1, to its first kernel",
                    [py, "-c", FIRST_KERNEL, "run", NET, "--mem", "12GB", "--steps", "1"],
                    10.0, None, None))
    if "errors" in only:
        (tmp / "million.net").write_text(MILLION)
        out.append(("errors", "errors first (a million relus)",
                    [py, "-m", "netdsl_cli", "check", str(tmp / "million.net")], 2.0, None,
                    None))
    return out


def cpu_seconds() -> float:
    """User and system seconds of the children waited for so far (their workers too)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def measure(key: str, cmd: list[str], checkout: Path, runs: int, fingerprint):
    """(median seconds, median CPU seconds of the command's processes, peak bytes,
    fingerprint or a note) of `runs` runs of `cmd`."""
    times, cpus, peaks, fp = [], [], [], "-"
    for _ in range(runs):
        c0 = cpu_seconds()
        dt, peak, rc, out, err = timed(cmd, checkout, checkout)
        cpus.append(cpu_seconds() - c0)
        if key == "errors":
            ok = rc != 0 and "`hh`" in out + err
            fp = "names `hh`" if ok else f"exit {rc}, no error named `hh`"
        elif key == "run":
            fp = "reached" if "first kernel" in err else f"exit {rc}: {err.strip()[-200:]}"
        elif rc != 0:
            fp = f"exit {rc}: {(err or out).strip()[-200:]}"
        elif fingerprint is not None:
            fp = fingerprint(json.loads(out))
        times.append(dt)
        peaks.append(peak)
    return statistics.median(times), statistics.median(cpus), max(peaks), fp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="check,plan,split,run,errors")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ref", type=Path, help="a checkout of the reference commit")
    ap.add_argument("--record", type=Path,
                    help="write this checkout's fingerprints to FILE (the reference's)")
    a = ap.parse_args()
    if os.environ.get("OPENBLAS_CORETYPE") or os.environ.get("OPENBLAS_L2_SIZE"):
        print("warning: OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE are set (docs/benchmarks.md)")
    recorded = json.loads(FINGERPRINTS.read_text()) if FINGERPRINTS.exists() else {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    print(f"netdsl compile path, commit {commit}, load average "
          f"{os.getloadavg()[0]:.1f}, {os.cpu_count()} cores")
    print(f"{'target':<36} {'seconds':>8} {'CPU s':>7} {'target':>7} {'ratio':>7} "
          f"{'RSS MB':>7}  fingerprint")
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for key, label, cmd, t_s, t_bytes, fpf in targets(set(a.only.split(",")), Path(tmp)):
            runs = 1 if key.startswith(("split", "run")) else a.runs
            checkouts = [("", ROOT)] + ([("ref ", a.ref.resolve())] if a.ref else [])
            for tag, checkout in checkouts:
                dt, cpu, peak, fp = measure(key, cmd, checkout, runs, fpf)
                if not tag:
                    found[key] = fp
                same = recorded.get(key)
                note = fp if same is None or fpf is None else (
                    f"{fp} {'=' if fp == same else '!='} recorded {same}")
                rss = f"{peak / 1e6:7.0f}" + (
                    f" ({peak / t_bytes:.2f}x of {t_bytes / 1e9:.0f} GB)" if t_bytes else "")
                print(f"{tag + label:<36} {dt:8.2f} {cpu:7.2f} {t_s:7.1f} {dt / t_s:6.2f}x "
                      f"{rss}  {note}")
    if a.record:
        a.record.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
