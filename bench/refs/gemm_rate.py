"""This machine's float32 GEMM rate, for bench_step.py: the best of --repeats square
products (n x n times n x n, 2 n^3 FLOPs) through NumPy's BLAS, or torch.mm with --torch
(with --gpu: CuPy's matmul, or torch.mm on CUDA).
Threads come from the environment (OMP/OPENBLAS/MKL_NUM_THREADS) and --threads.
Prints one JSON line: {"library", "n", "gflops", "times"}."""
from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--torch", action="store_true")
    ap.add_argument("--gpu", action="store_true", help="on the GPU: torch.mm on CUDA with "
                    "--torch, else CuPy's matmul (cuBLAS)")
    a = ap.parse_args()
    sync = (lambda: None)
    if a.gpu and a.torch:
        import torch
        torch.backends.cuda.matmul.allow_tf32 = False  # plain float32, as CuPy's default
        x, y = (torch.randn(a.n, a.n, device="cuda") for _ in range(2))
        out = torch.empty(a.n, a.n, device="cuda")
        mm, lib, sync = ((lambda: torch.mm(x, y, out=out)), f"torch {torch.__version__} CUDA",
                         torch.cuda.synchronize)
    elif a.gpu:
        import cupy
        x, y = (cupy.random.standard_normal((a.n, a.n), dtype=cupy.float32) for _ in range(2))
        out = cupy.empty((a.n, a.n), cupy.float32)
        mm, lib = (lambda: cupy.matmul(x, y, out=out)), f"CuPy {cupy.__version__}"
        sync = cupy.cuda.Device().synchronize
    elif a.torch:
        import torch
        torch.set_num_threads(a.threads)
        x, y = torch.randn(a.n, a.n), torch.randn(a.n, a.n)
        out = torch.empty(a.n, a.n)
        mm, lib = (lambda: torch.mm(x, y, out=out)), f"torch {torch.__version__}"
    else:
        import numpy as np
        from threadpoolctl import threadpool_limits
        threadpool_limits(a.threads)
        rng = np.random.default_rng(0)
        x, y = (rng.standard_normal((a.n, a.n), dtype=np.float32) for _ in range(2))
        out = np.empty((a.n, a.n), np.float32)
        mm, lib = (lambda: np.matmul(x, y, out=out)), f"NumPy {np.__version__}"
    mm()
    sync()
    times = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        mm()
        sync()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"library": lib, "n": a.n, "gflops": 2 * a.n ** 3 / min(times) / 1e9,
                      "times": times}))


if __name__ == "__main__":
    main()
