"""How deep can the resnet2504 family go in 12 GB? Per strategy, the deepest network
(more bottleneck blocks in the third stage) that `netdsl plan` fits into the budget at
batch 16 on the k40-12gb profile with at most 30% predicted overhead.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/bench_depth.py \
        [--mem 12GB] [--batch 16] [--profile k40-12gb] [--max-overhead 0.30] [--prefetch N]

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


def layers(b: int) -> int:
    return 3 * (6 + 32 + b + 6) + 2


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
    ap.add_argument("--profile", default="k40-12gb")
    ap.add_argument("--max-overhead", type=float, default=0.30)
    ap.add_argument("--prefetch", type=int, default=None)
    ap.add_argument("--offload-state", action="store_true",
                    help="let auto keep optimizer state in the host pool")
    ap.add_argument("--strategies", default=",".join(STRATEGIES[1:] + STRATEGIES[:1]))
    a = ap.parse_args()
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
