"""Single kernels against PyTorch's in the same run (issue 8): pooling and linear.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OPENBLAS_NUM_THREADS=1 \
        .venv/bin/python bench/bench_kernels.py [--src DIR]

Each case runs netdsl's kernel (called as the executor calls it, float32) and the same
operation in torch (CPU, 1 thread; the backward through autograd), the best of --repeats
timings each, and prints milliseconds and the ratio netdsl / torch. `--src DIR` imports
netdsl from another checkout (e.g. `git worktree add /tmp/base 804ade2`), which is how a
before/after of a kernel change is measured with the same script. Needs torch.
"""
from __future__ import annotations

import argparse
import sys
import time


def best_ms(f, repeats: int) -> float:
    f()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return 1e3 * min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", help="import netdsl from this directory")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    if a.src:
        sys.path.insert(0, a.src)
    import numpy as np
    import torch
    import torch.nn.functional as F

    from netdsl.ir import registry
    torch.set_num_threads(1)
    ops = registry.load_all()
    rng = np.random.default_rng(0)

    from netdsl.backends.numpy import NumpyBackend

    class Ctx:  # as the executor calls kernels: with the backend's fused kernels if loaded
        out = None
        backend = NumpyBackend()

    pool = {"stride": None, "padding": 0, "ceil_mode": False, "count_include_pad": True}
    cases = [  # name, op, input shape, attrs
        ("ResNet-50 stem maxpool 3x3/2 pad 1", "maxpool", (16, 64, 112, 112),
         {**pool, "kernel": 3, "stride": 2, "padding": 1}),
        ("avgpool 3x3/2 pad 1", "avgpool", (16, 64, 112, 112),
         {**pool, "kernel": 3, "stride": 2, "padding": 1}),
        ("digits-cnn maxpool 2x2", "maxpool", (32, 32, 8, 8), {**pool, "kernel": 2}),
    ]
    print(f"netdsl from {registry.__file__}; torch {torch.__version__}, 1 thread, float32, "
          f"best of {a.repeats}")
    print(f"{'case':<44} {'pass':<9} {'netdsl ms':>10} {'torch ms':>9} {'ratio':>6}")
    for name, op, shape, attrs in cases:
        x = rng.standard_normal(shape).astype(np.float32)
        y = ops[op].kernel(np, [x], attrs, Ctx)
        dy = rng.standard_normal(y.shape).astype(np.float32)
        fwd = F.max_pool2d if op == "maxpool" else F.avg_pool2d
        targs = (attrs["kernel"], attrs["stride"] or attrs["kernel"], attrs["padding"])
        tx = torch.from_numpy(x).requires_grad_()
        tdy = torch.from_numpy(dy)
        ours = {"forward": lambda: ops[op].kernel(np, [x], attrs, Ctx)}
        theirs = {"forward": lambda: fwd(tx.detach(), *targs)}
        if op == "maxpool":
            ours["backward"] = lambda: ops[op + "_grad"].kernel(np, [dy, x], attrs, Ctx)
            theirs["backward"] = lambda: torch.autograd.grad(fwd(tx, *targs), tx, tdy)
        for p in ours:
            m, t = best_ms(ours[p], a.repeats), best_ms(theirs[p], a.repeats)
            print(f"{name:<44} {p:<9} {m:>10.3f} {t:>9.3f} {m / t:>6.2f}")
    x = rng.standard_normal((32, 32, 64)).astype(np.float32)
    w = rng.standard_normal((256, 64)).astype(np.float32)
    m = best_ms(lambda: ops["linear"].kernel(np, [x, w], {}, Ctx), 10 * a.repeats)
    t = best_ms(lambda: F.linear(torch.from_numpy(x), torch.from_numpy(w)), 10 * a.repeats)
    print(f"{'linear [32, 32, 64] x [64, 256]':<44} {'forward':<9} {m:>10.3f} {t:>9.3f} "
          f"{m / t:>6.2f}")


if __name__ == "__main__":
    main()
