"""Winograd's forward and weight gradient (netdsl/ir/ops/conv_winograd.py) at several chunk
sizes, alternating within one process, medians of --rounds (issue 8).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python \
        bench/bench_winograd_chunks.py [--threads 2] [--rounds 15] \
        16,32,32,16:5,16 16,64,64,8:7,16 ...

Each case is N,C,O,H:PER,PER,... (batch, input and output channels, square image side;
images per chunk). A chunk size is set through `_ENOUGH_TILES` (PER images' tiles), so the
kernels run as the executor runs them, on the backend's fused kernels inside its
`running()` block. The variants take turns with no pause between them: on this project's
VMs a pause before a measurement made small kernels several times slower at random
(docs/benchmarks.md, "Winograd's chunks").
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="+", metavar="N,C,O,H:PER,...")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # the fused kernels' threads follow it
    import numpy as np

    from netdsl.backends.numpy import NumpyBackend
    from netdsl.ir.ops import conv_winograd as W

    be = NumpyBackend()
    fast = be.fused
    rng = np.random.default_rng(0)
    print(f"{fast}, float32, medians of {a.rounds} alternating rounds (ms)")
    for case in a.cases:
        shape, pers = case.split(":")
        n, c, o, h = map(int, shape.split(","))
        x = rng.standard_normal((n, c, h, h)).astype(np.float32)
        w = rng.standard_normal((o, c, 3, 3)).astype(np.float32)
        dy = rng.standard_normal((n, o, h, h)).astype(np.float32)
        th, tw = W.tiles(h, h)
        runs = {}
        for per in map(int, pers.split(",")):
            runs[("forward", per)] = lambda: W.conv(fast, x, w, 1, 1)
            runs[("weight gradient", per)] = lambda: W.grad_weight(fast, dy, x, 1, 1)
        times = {key: [] for key in runs}
        enough = W._ENOUGH_TILES
        try:
            with be.running():
                for _ in range(a.rounds + 1):  # the first round warms up
                    for (kind, per), f in runs.items():
                        W._ENOUGH_TILES = per * th * tw
                        t = time.perf_counter()
                        f()
                        times[(kind, per)].append(time.perf_counter() - t)
        finally:
            W._ENOUGH_TILES = enough
        for (kind, per), ts in sorted(times.items()):
            print(f"{case.split(':')[0]:>16} {kind:<16} {per:>3} images a chunk "
                  f"{1e3 * statistics.median(ts[1:]):8.3f}")


if __name__ == "__main__":
    main()
