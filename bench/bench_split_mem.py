"""Memory planning of split training steps: what `netdsl split --mem` plans per device,
and a measured `netdsl run --devices N --mem` against the same run unplanned.

    python bench/bench_split_mem.py split [--net examples/resnet2504.net] [--devices 4]
        [--batch 16] [--strategy data] [--mem 12GB] [--profile k40-12gb]
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_split_mem.py run \\
        [--net examples/resnet164-cifar.net] [--devices 2] [--strategy data] [--batch 16]
        [--mem 150MB] [--steps 2] [--repeats 2]

`split` runs `netdsl split --json` with `--mem` and prints, per device, the planned peak
and what is recomputed and offloaded, then the predicted step time planned against the
same split unplanned (the ratio is the planning's predicted cost) and how long the
command took. `run` trains the same steps with `--devices N --mem` and without `--mem`,
alternating, and prints per device the executor's counted peak against the plan, the
process's tracemalloc peak against the sum of the plans (and the host pool), the losses
side by side and the median step times with their ratio.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

NETDSL = [sys.executable, "-m", "netdsl_cli"]


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _json(cmd: list[str]) -> tuple[dict, float]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        try:
            why = json.loads(r.stdout)["errors"][0]["message"]
        except (ValueError, KeyError, IndexError):
            why = r.stderr.strip()[-400:]
        raise SystemExit(f"exit {r.returncode}: {' '.join(cmd)}\n{why}")
    return json.loads(r.stdout), dt


def split_mem(net: str, devices: int, batch: int, strategy: str, mem: str,
              profile: str) -> None:
    cmd = [*NETDSL, "split", net, "--devices", str(devices), "--batch", str(batch),
           "--strategy", strategy, "--mem", mem, "--profile", profile, "--json"]
    print("netdsl " + " ".join(cmd[3:]))
    d, dt = _json(cmd)
    plan = d["memory_plan"]
    if plan is None:
        print(f"{d['spec']}: fits {mem} per device unplanned (largest device "
              f"{_gb(max(x['peak_bytes'] for x in d['per_device']))}); nothing to plan")
        return
    print(f"{d['spec']}: unplanned the largest device needs "
          f"{_gb(plan['unplanned_peak_bytes'])}; planned ({plan['strategy']} on "
          f"{plan['profile']}, {plan['plan_s']:.1f} s of planning):")
    print(f"{'device':>6} {'planned peak':>13} {'recomputed':>20} {'offloaded':>20}")
    for x in d["per_device"]:
        print(f"{x['device']:>6} {_gb(x['peak_bytes']):>13} "
              f"{x['recompute']:>8,} ({_gb(x['recompute_bytes']):>9}) "
              f"{x['offload']:>8,} ({_gb(x['offload_bytes']):>9})")
    print(f"predicted step {plan['predicted_step_s']:.3f} s planned against "
          f"{plan['unplanned_step_s']:.3f} s unplanned: x{1 + plan['predicted_overhead']:.3f}"
          f"; speed-up over one device {d['predicted_speedup']:.2f}x; command {dt:.0f} s")


def run_mem(net: str, devices: int, strategy: str, batch: int, mem: str, steps: int,
            repeats: int) -> None:
    common = [*NETDSL, "run", net, "--devices", str(devices), "--split", strategy,
              "--batch", str(batch), "--steps", str(steps), "--eval-samples", "0", "--json"]
    print("netdsl " + " ".join(common[3:]) + f" [--mem {mem}]")
    planned, plain = [], []
    for _ in range(repeats):  # alternating, so both see the same machine
        planned.append(_json([*common, "--mem", mem])[0])
        plain.append(_json(common)[0])
    p, u = planned[-1], plain[-1]
    print(f"{'device':>6} {'counted':>10} {'planned':>10} {'unplanned':>10} {'budget':>10}")
    for dev, counted in p["peak_by_device"].items():
        print(f"{dev:>6} {_gb(counted):>10} {_gb(p['planned_peak_by_device'][dev]):>10} "
              f"{_gb(u['peak_by_device'][dev]):>10} {_gb(p['budget_bytes']):>10}")
    plans = sum(p["planned_peak_by_device"].values())
    print(f"tracemalloc (state + the steps' high-water mark, every device in this process): "
          f"{_gb(p['peak_bytes'])} against the plans' sum {_gb(plans)} + host pool "
          f"{_gb(p['host_peak_bytes'])}; unplanned {_gb(u['peak_bytes'])}")
    diff = abs(p["final_loss"] - u["final_loss"]) / max(abs(u["final_loss"]), 1e-30)
    print(f"final loss planned {p['final_loss']:.6f}, unplanned {u['final_loss']:.6f} "
          f"(relative difference {diff:.2g})")
    tp = statistics.median(r["step_time_s"] for r in planned)
    tu = statistics.median(r["step_time_s"] for r in plain)
    m = p["memory_plan"]
    print(f"median step {tp:.3f} s planned, {tu:.3f} s unplanned: x{tp / tu:.3f} "
          f"(predicted x{1 + m['predicted_overhead']:.3f}); "
          f"{m['decisions']['recompute']:,} recomputed, {m['decisions']['offload']:,} "
          "offloaded")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("split", "run"))
    ap.add_argument("--net")
    ap.add_argument("--devices", type=int)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--strategy", default="data")
    ap.add_argument("--mem")
    ap.add_argument("--profile", default="k40-12gb")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    if a.what == "split":
        split_mem(a.net or "examples/resnet2504.net", a.devices or 4, a.batch, a.strategy,
                  a.mem or "12GB", a.profile)
    else:
        run_mem(a.net or "examples/resnet164-cifar.net", a.devices or 2, a.strategy,
                a.batch, a.mem or "150MB", a.steps, a.repeats)


if __name__ == "__main__":
    main()
