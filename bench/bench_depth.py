"""How deep can the resnet2504 family go in 12 GB? Per strategy, the deepest network
(more bottleneck blocks in the third stage) that `netdsl plan` fits into the budget at
batch 16 on the k40-12gb profile with at most 30% predicted overhead.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/bench_depth.py \
        [--mem 12GB] [--batch 16] [--profile k40-12gb] [--max-overhead 0.30] [--prefetch N]

With `--timing`, how the compile path's cost grows with depth instead (issue 45): each
command in a fresh process, as a user runs it, timed whole (wall, and the CPU seconds of
its processes, which a loaded machine changes less), with the largest resident set of
its process tree, over a doubling series of depths, and the slope of log(time)
against log(layers) fitted by least squares over the commands that succeed (1: linear
in the depth):
- `resnet`: `netdsl plan` of the resnet2504 family at batch 16 on `--profile`, into a
  budget that grows with the depth (`--mem` per 2,504 layers, the example's), up to
  10,001 layers (3,289 stage-3 blocks);
- `decoder`: `netdsl split` of a GPT-style decoder (width 256, context 128) as a pipeline
  of 8 devices with 32 micro-batches at batch 32, up to 96 blocks.
`--plot FILE` draws both series on log-log axes.

A network with b blocks in stage 3 has 3 x (6 + 32 + b + 6) + 2 layers (the count the
example's header uses: convolutions of the blocks, stem and classifier). The search
doubles b from 64 until a plan fails, then bisects; each probe generates the .net text,
builds the training step and plans it (the reference for the overhead is the
unconstrained step of the same network, predicted in the same run). Goal for auto: 5,000
layers or more. `--offload-state` lets auto keep optimizer state in the host pool as a
last resort (`netdsl run --mem --offload-state` executes such plans).
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import tempfile
import time
from pathlib import Path

from netdsl.api import loads
from netdsl.config import TrainConfig
from netdsl.memory.search import STRATEGIES, plan_memory
from netdsl.step.graphs import training_graph

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = """import resnet

network resnet_deep {{
    input x: f32[N, 3, 224, 224]
    input y: i64[N]

    h = resnet.stem(x, 64)
    h = resnet.stage(h, width=64,  blocks=6)
    h = resnet.stage(h, width=128, blocks=32,  stride=2)
    h = resnet.stage(h, width=256, blocks={b}, stride=2)
    h = resnet.stage(h, width=512, blocks=6,   stride=2)
    logits = resnet.head(h, 1000)

    output logits
    loss softmax_cross_entropy(logits, y)
}}

train {{
    optimizer = sgd(lr=0.1, momentum=0.9, weight_decay=1e-4)
    batch     = 16
}}
"""


DECODER = """import transformer

network decoder_deep {{
    input tokens: i64[N, 128]
    input y: i64[N, 128]

    h = embedding(tokens, 1000, 256) + parameter((128, 256))
    h = transformer.decoder(h, layers={b}, heads=8)
    logits = linear(h, 1000)

    output logits
    loss softmax_cross_entropy(logits, y, axis=-1)
}}

train {{
    optimizer = adamw(lr=3e-4, weight_decay=0.01)
    batch     = 32
}}
"""
RESNET_BLOCKS = (64, 160, 400, 1000, 3289)  # 326 ... 10,001 layers
DECODER_BLOCKS = (12, 24, 48, 96)


def layers(b: int) -> int:
    return 3 * (6 + 32 + b + 6) + 2


def timing_commands(a, tmp: Path) -> list[tuple[str, int, list[str]]]:
    """(series, depth, command) of each timed run (module docstring)."""
    from netdsl.sizes import parse_size
    py, out = sys.executable, []
    per_layer = parse_size(a.mem, "--mem") / layers(790)
    for b in RESNET_BLOCKS:
        f = tmp / f"resnet_{b}.net"
        f.write_text(TEMPLATE.format(b=b))
        out.append(("resnet", layers(b),
                    [py, "-m", "netdsl_cli", "plan", str(f), "--batch", str(a.batch),
                     "--mem", str(int(per_layer * layers(b))), "--profile", a.profile,
                     "--json"]))
    for b in DECODER_BLOCKS:
        f = tmp / f"decoder_{b}.net"
        f.write_text(DECODER.format(b=b))
        out.append(("decoder", b,
                    [py, "-m", "netdsl_cli", "split", str(f), "--devices", "8", "--split",
                     "pipeline", "--microbatches", "32", "--batch", "32", "--profile",
                     a.profile, "--json"]))
    return out


def slope(points: list[tuple[int, float]]) -> float:
    """The least-squares slope of log(seconds) against log(depth)."""
    xs = [math.log(d) for d, _ in points]
    ys = [math.log(t) for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs)


def cpu_seconds() -> float:
    """User and system seconds of the children waited for so far (their workers too)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timing(a) -> None:
    """The timed series (module docstring): wall seconds, and the CPU seconds of the
    command's processes, which other processes on the machine change less."""
    from bench_compile import ROOT as CHECKOUT
    from bench_compile import timed
    series: dict[str, list[tuple[int, float]]] = {}
    cpu: dict[str, list[tuple[int, float]]] = {}
    print(f"{'series':8} {'depth':>7} {'seconds':>8} {'CPU s':>7} {'RSS MB':>7}  result")
    with tempfile.TemporaryDirectory() as tmp:
        for name, depth, cmd in timing_commands(a, Path(tmp)):
            if name not in a.series.split(","):
                continue
            c0 = cpu_seconds()
            dt, peak, rc, out, err = timed(cmd, CHECKOUT, CHECKOUT)
            dc = cpu_seconds() - c0
            what = "ok" if rc == 0 else f"exit {rc}: {(err or out).strip()[-160:]}"
            if rc == 0:
                d = json.loads(out)
                what = (d.get("spec") or f"plan {d.get('strategy')}, "
                        f"{'fits' if d.get('feasible') else 'does not fit'}")
            print(f"{name:8} {depth:7d} {dt:8.1f} {dc:7.1f} {peak / 1e6:7.0f}  {what}",
                  flush=True)
            if rc == 0:  # (a plan that fails searches more micro-batches: other work)
                series.setdefault(name, []).append((depth, dt))
                cpu.setdefault(name, []).append((depth, dc))
    unit = {"resnet": "layers", "decoder": "blocks"}
    for name, pts in series.items():
        if len(pts) > 1:
            print(f"{name}: wall time grows as {unit[name]}^{slope(pts):.2f}, CPU time as "
                  f"{unit[name]}^{slope(cpu[name]):.2f} ({pts[0][0]} to {pts[-1][0]} "
                  f"{unit[name]})")
    if a.plot:
        plot(series, cpu, unit, a.plot)


def plot(series: dict, cpu: dict, unit: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in series.items():
        line, = ax.loglog([d for d, _ in cpu[name]], [t for _, t in cpu[name]], "o-",
                          label=f"{name} ({unit[name]}), CPU; slope {slope(cpu[name]):.2f}")
        ax.loglog([d for d, _ in pts], [t for _, t in pts], "x--", color=line.get_color(),
                  label=f"{name}, wall; slope {slope(pts):.2f}")
    ax.set_xlabel("depth (layers, or decoder blocks)")
    ax.set_ylabel("seconds, whole process")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def probe(b: int, a, strategy: str):
    net = loads(TEMPLATE.format(b=b), file=str(ROOT / "examples" / "resnet_deep.net"))
    g = training_graph(net.lower(a.batch), net.train or TrainConfig())
    r = plan_memory(g, a.mem, a.profile, strategy, prefetch=a.prefetch,
                    offload_state=a.offload_state)
    return r.feasible and r.predicted_overhead <= a.max_overhead, r


def deepest(a, strategy: str):
    ok_b, ok_r, b = 0, None, 64
    while True:  # double until it fails
        ok, r = probe(b, a, strategy)
        if not ok:
            break
        ok_b, ok_r, b = b, r, b * 2
    lo, hi = ok_b, b
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ok, r = probe(mid, a, strategy)
        if ok:
            lo, ok_r = mid, r
        else:
            hi = mid
    return lo, ok_r, probe(hi, a, strategy)[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mem", default="12GB")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--profile", default=None, help="k40-12gb (with --timing: cpu)")
    ap.add_argument("--max-overhead", type=float, default=0.30)
    ap.add_argument("--prefetch", type=int, default=None)
    ap.add_argument("--offload-state", action="store_true",
                    help="let auto keep optimizer state in the host pool")
    ap.add_argument("--strategies", default=",".join(STRATEGIES[1:] + STRATEGIES[:1]))
    ap.add_argument("--timing", action="store_true",
                    help="time the compile path against depth instead (module docstring)")
    ap.add_argument("--series", default="resnet,decoder")
    ap.add_argument("--plot", type=Path, help="with --timing: draw the series into FILE")
    a = ap.parse_args()
    a.profile = a.profile or ("cpu" if a.timing else "k40-12gb")
    if a.timing:
        timing(a)
        return
    print(f"deepest resnet2504-family network planned into {a.mem} at batch {a.batch} on "
          f"{a.profile} with at most {100 * a.max_overhead:.0f}% predicted overhead")
    print(f"{'strategy':16} {'stage-3 blocks':>14} {'layers':>7} {'peak GB':>8} "
          f"{'overhead':>9} {'state GB':>9}  first failure")
    for s in a.strategies.split(","):
        t0 = time.perf_counter()
        b, r, fail = deepest(a, s)
        why = ("over budget (smallest " f"{fail.min_feasible_bytes / 1e9:.2f} GB)"
               if not fail.feasible else
               f"overhead {100 * fail.predicted_overhead:.1f}%")
        if r is None:
            print(f"{s:16} {'none':>14}  ({why}; {time.perf_counter() - t0:.0f} s)")
            continue
        print(f"{s:16} {b:14d} {layers(b):7d} {r.planned_peak_bytes / 1e9:8.2f} "
              f"{100 * r.predicted_overhead:8.1f}% {r.state_bytes / 1e9:9.2f}  at {b + 1}: "
              f"{why} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
