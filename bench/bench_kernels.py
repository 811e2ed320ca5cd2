"""Single kernels against PyTorch's in the same run (issue 8): pooling, linear and, with
--conv, conv2d's forward, input gradient and weight gradient.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OPENBLAS_NUM_THREADS=1 \
        .venv/bin/python bench/bench_kernels.py [--src DIR] [--conv [--conv-only TEXT]]

(with `--threads 2`, leave out OPENBLAS_NUM_THREADS=1). Each case runs netdsl's kernel
(called as the executor calls it, float32, inside the backend's `running()` block as in a
step) and the same operation in torch (CPU, --threads threads; the backward through
autograd), the best of --repeats
timings each, and prints milliseconds and the ratio netdsl / torch. `--src DIR` imports
netdsl from another checkout (e.g. `git worktree add /tmp/base 804ade2`), which is how a
before/after of a kernel change is measured with the same script. Needs torch.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

# With more than one thread, each measurement starts after a pause: the other framework's
# idle threads spin for a while after its last call and would take the cores.
SETTLE_S = [0.0]


def best_ms(f, repeats: int) -> float:
    time.sleep(SETTLE_S[0])
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
    ap.add_argument("--conv", action="store_true",
                    help="also conv2d's three kernels on ResNet/VGG/digits shapes")
    ap.add_argument("--conv-only", metavar="TEXT", action="append",
                    help="with --conv, only the shapes whose names contain TEXT (repeatable)")
    ap.add_argument("--gemm", action="store_true",
                    help="with --threads 2 or more: the pooled GEMMs against NumPy's matmul "
                         "on one thread, below and above their size threshold")
    ap.add_argument("--threads", type=int, default=1,
                    help="threads for torch and netdsl's fused kernels (default 1)")
    a = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # netdsl's loops follow it
    SETTLE_S[0] = 0.5 if a.threads > 1 else 0.0
    if a.src:
        sys.path.insert(0, a.src)
    import numpy as np
    import torch
    import torch.nn.functional as F

    from netdsl.ir import registry
    torch.set_num_threads(a.threads)
    ops = registry.load_all()
    rng = np.random.default_rng(0)

    from netdsl.backends.numpy import NumpyBackend
    from netdsl.runtime.executor import KernelContext

    # as the executor calls kernels: with the backend's fused kernels where they load
    Ctx = KernelContext(True, NumpyBackend(), "float32")  # noqa: N806
    fused = Ctx.backend.fused
    # Numba's OpenMP pool can start with NUMBA_NUM_THREADS (the cores) and leave libgomp's
    # default there, which torch then follows (a probe that imported torch first read 2
    # after the backend loaded, and its convolutions ran on two threads): set torch's
    # count again, and print what it is
    torch.set_num_threads(a.threads)
    print(f"netdsl from {registry.__file__}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), {fused}, float32, best of {a.repeats}")
    with Ctx.backend.running():  # as in a step: one pool of threads (numpy_fused_gemm)
        _cases(a, np, torch, F, ops, Ctx, rng)


def _cases(a, np, torch, F, ops, Ctx, rng) -> None:  # noqa: N803

    pool = {"stride": None, "padding": 0, "ceil_mode": False, "count_include_pad": True}
    cases = [  # name, op, input shape, attrs
        ("ResNet-50 stem maxpool 3x3/2 pad 1", "maxpool", (16, 64, 112, 112),
         {**pool, "kernel": 3, "stride": 2, "padding": 1}),
        ("avgpool 3x3/2 pad 1", "avgpool", (16, 64, 112, 112),
         {**pool, "kernel": 3, "stride": 2, "padding": 1}),
        ("digits-cnn maxpool 2x2", "maxpool", (32, 32, 8, 8), {**pool, "kernel": 2}),
        ("VGG-16 first maxpool 2x2", "maxpool", (8, 64, 224, 224), {**pool, "kernel": 2}),
    ]
    print(f"{'case':<44} {'pass':<9} {'netdsl ms':>10} {'torch ms':>9} {'ratio':>6}")
    for name, op, shape, attrs in cases:
        # four inputs taken in turn (relu outputs: many ties at zero): a max-pool kernel's
        # argmax is data-dependent, and on one repeated input the branch predictor learns
        # it, which flattered two rewrites 2x (docs/benchmarks.md)
        xs = [np.maximum(rng.standard_normal(shape), 0).astype(np.float32) for _ in range(4)]
        y = ops[op].kernel(np, [xs[0]], attrs, Ctx)
        dys = [rng.standard_normal(y.shape).astype(np.float32) for _ in range(4)]
        fwd = F.max_pool2d if op == "maxpool" else F.avg_pool2d
        targs = (attrs["kernel"], attrs["stride"] or attrs["kernel"], attrs["padding"])
        txs = [torch.from_numpy(x).requires_grad_() for x in xs]
        tdys = [torch.from_numpy(dy) for dy in dys]
        turn = itertools.count()
        ours = {"forward": lambda: ops[op].kernel(np, [xs[next(turn) % 4]], attrs, Ctx)}
        theirs = {"forward": lambda: fwd(txs[next(turn) % 4].detach(), *targs)}
        if op == "maxpool":
            def ours_bwd(k=turn):
                i = next(k) % 4
                return ops[op + "_grad"].kernel(np, [dys[i], xs[i]], attrs, Ctx)

            def theirs_bwd(k=turn):
                i = next(k) % 4
                return torch.autograd.grad(fwd(txs[i], *targs), txs[i], tdys[i])
            ours["backward"], theirs["backward"] = ours_bwd, theirs_bwd
        for p in ours:
            m, t = best_ms(ours[p], a.repeats), best_ms(theirs[p], a.repeats)
            print(f"{name:<44} {p:<9} {m:>10.3f} {t:>9.3f} {m / t:>6.2f}")
    x = rng.standard_normal((32, 32, 64)).astype(np.float32)
    w = rng.standard_normal((256, 64)).astype(np.float32)
    b = rng.standard_normal(256).astype(np.float32)
    m = best_ms(lambda: ops["linear"].kernel(np, [x, w, b], {}, Ctx), 10 * a.repeats)
    t = best_ms(lambda: F.linear(*(torch.from_numpy(v) for v in (x, w, b))), 10 * a.repeats)
    print(f"{'linear [32, 32, 64] x [64, 256] + bias':<44} {'forward':<9} {m:>10.3f} "
          f"{t:>9.3f} {m / t:>6.2f}")
    x = rng.standard_normal((32, 32, 256)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    tx = torch.from_numpy(x).requires_grad_()
    g = {"approximate": "none"}
    for part, ours, theirs in (
            ("forward", lambda: ops["gelu"].kernel(np, [x], g, Ctx),
             lambda: F.gelu(tx.detach())),
            ("backward", lambda: ops["gelu_grad"].kernel(np, [dy, x], g, Ctx),
             lambda: torch.autograd.grad(F.gelu(tx), tx, torch.from_numpy(dy)))):
        m, t = best_ms(ours, 10 * a.repeats), best_ms(theirs, 10 * a.repeats)
        print(f"{'gelu [32, 32, 256] (torch: fwd + bwd)':<44} {part:<9} {m:>10.3f} "
              f"{t:>9.3f} {m / t:>6.2f}")
    x = (rng.standard_normal((32, 4, 32, 32)) * 3).astype(np.float32)  # attention scores
    m = best_ms(lambda: ops["softmax"].kernel(np, [x], {"axis": -1}, Ctx), 10 * a.repeats)
    t = best_ms(lambda: torch.softmax(torch.from_numpy(x), -1), 10 * a.repeats)
    print(f"{'softmax [32, 4, 32, 32] over the last axis':<44} {'forward':<9} {m:>10.3f} "
          f"{t:>9.3f} {m / t:>6.2f}")
    attention_cases(np, torch, ops, Ctx, rng, 10 * a.repeats)
    layernorm_cases(np, torch, ops, Ctx, rng, 10 * a.repeats)
    if a.conv:
        conv_cases(np, torch, ops, Ctx, rng, a.repeats, a.conv_only)
    if a.gemm:
        gemm_cases(np, Ctx, rng, a.repeats)


def attention_cases(np, torch, ops, ctx, rng, repeats) -> None:
    """Attention: transformer-tiny's (batch 32, 4 heads of 16, 32 tokens) and a larger one
    (batch 8, 8 heads of 64, 128 tokens). The matmul kernel on the views a step written
    out hands it (heads permuted out of the fused q/k/v projection, transposes as views),
    torch.matmul on the same views; then the fuse pass's attention_qkv_probs +
    attention_qkv (forward) and attention_qkv_grad with the kept probabilities (backward)
    against torch's scaled_dot_product_attention on the same packed projection (its
    backward through autograd, so with its forward)."""
    import torch.nn.functional as F  # noqa: N812
    for n, t, h, d in ((32, 32, 4, 16), (8, 128, 8, 64)):
        qkv = rng.standard_normal((n, t, 3 * h * d)).astype(np.float32)
        q, k, v = (x.reshape(n, t, h, d).transpose(0, 2, 1, 3) for x in np.split(qkv, 3, 2))
        p = rng.standard_normal((n, h, t, t)).astype(np.float32)
        for name, x, y in (("q @ k^T", q, k.swapaxes(-1, -2)), ("probs @ v", p, v),
                           ("dy @ v^T", q, v.swapaxes(-1, -2)),
                           ("probs^T @ dy", p.swapaxes(-1, -2), q)):
            m = best_ms(lambda: ops["matmul"].kernel(np, [x, y], {}, ctx), repeats)
            tx, ty = torch.from_numpy(x), torch.from_numpy(y)
            t_ = best_ms(lambda: torch.matmul(tx, ty), repeats)
            label = f"attention {name}, {'x'.join(map(str, x.shape))}"
            print(f"{label:<44} {'forward':<9} {m:>10.3f} {t_:>9.3f} {m / t_:>6.2f}",
                  flush=True)
        if "attention_qkv" not in ops:  # (a --src checkout from before it)
            continue
        a = {"heads": h, "causal": False, "scale": None}
        dy = rng.standard_normal((n, t, h * d)).astype(np.float32)
        kept = ops["attention_qkv_probs"].kernel(np, [qkv], a, ctx)
        tqkv, tdy = torch.from_numpy(qkv).requires_grad_(), torch.from_numpy(dy)

        def torch_attention(x):
            tq, tk, tv = x.view(n, t, 3, h, d).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(tq, tk, tv).transpose(1, 2).reshape(n, t, -1)
        for part, ours, theirs in (
                ("forward", lambda: ops["attention_qkv"].kernel(
                    np, [qkv, ops["attention_qkv_probs"].kernel(np, [qkv], a, ctx)], a, ctx),
                 lambda: torch_attention(tqkv.detach())),
                ("backward", lambda: ops["attention_qkv_grad"].kernel(np, [dy, qkv, kept], a,
                                                                      ctx),
                 lambda: torch.autograd.grad(torch_attention(tqkv), tqkv, tdy))):
            m, t_ = best_ms(ours, repeats), best_ms(theirs, repeats)
            label = f"attention_qkv [{n}, {t}, {3 * h * d}], {h} heads"
            print(f"{label:<44} {part:<9} {m:>10.3f} {t_:>9.3f} {m / t_:>6.2f}", flush=True)


def layernorm_cases(np, torch, ops, ctx, rng, repeats) -> None:
    """transformer-tiny's layernorm, [32, 32, 64]: the forward kernel, and the backward's
    three nodes (layernorm_grad_input, layernorm_grad_weight, the bias gradient's
    sum_except) against torch's layer_norm (its backward through autograd, with its
    forward)."""
    import torch.nn.functional as F  # noqa: N812
    x = rng.standard_normal((32, 32, 64)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    w, b = rng.standard_normal(64).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    a = {"eps": 1e-5, "affine": True, "axis": -1}
    g = {"eps": 1e-5, "axis": -1}

    def ours_bwd():
        return (ops["layernorm_grad_input"].kernel(np, [dy, x, w], g, ctx),
                ops["layernorm_grad_weight"].kernel(np, [dy, x], g, ctx),
                ops["sum_except"].kernel(np, [dy], {"axis": -1}, ctx))
    tx, tw, tb = (torch.from_numpy(v).requires_grad_() for v in (x, w, b))
    for part, ours, theirs in (
            ("forward", lambda: ops["layernorm"].kernel(np, [x, w, b], a, ctx),
             lambda: F.layer_norm(tx.detach(), (64,), tw.detach(), tb.detach())),
            ("backward", ours_bwd,
             lambda: torch.autograd.grad(F.layer_norm(tx, (64,), tw, tb), (tx, tw, tb),
                                         torch.from_numpy(dy)))):
        m, t_ = best_ms(ours, repeats), best_ms(theirs, repeats)
        print(f"{'layernorm [32, 32, 64] (torch bwd: + fwd)':<44} {part:<9} {m:>10.3f} "
              f"{t_:>9.3f} {m / t_:>6.2f}", flush=True)


GEMMS = [(2, 32, 32, 64), (16, 16, 16, 64), (2, 64, 64, 64), (4, 64, 64, 64),
         (2, 64, 64, 128), (1, 128, 128, 128), (2, 64, 64, 256), (1, 1024, 64, 256)]


def gemm_cases(np, ctx, rng, repeats) -> None:
    """[B, M, K] @ [B, K, N] on the loops' threads (numpy_fused_gemm.PooledGemm, its size
    threshold lifted here) against NumPy's matmul (one BLAS thread, as in a step): where
    the threshold _MIN_MACS comes from."""
    from netdsl.backends import numpy_fused_gemm
    gemm = getattr(ctx.backend.fused, "gemm", None)
    if gemm is None:
        print("no pooled GEMMs here (one thread, or NumPy links another BLAS)")
        return
    threshold, numpy_fused_gemm._MIN_MACS = numpy_fused_gemm._MIN_MACS, 0
    try:
        for b, m, k, n in GEMMS:
            x = rng.standard_normal((b, m, k)).astype(np.float32)
            y = rng.standard_normal((b, k, n)).astype(np.float32)
            p = best_ms(lambda: gemm(x, y), 40 * repeats)
            q = best_ms(lambda: np.matmul(x, y), 40 * repeats)
            name = f"gemm [{b}, {m}, {k}] @ [{b}, {k}, {n}] ({b * m * k * n:,} MAC)"
            print(f"{name:<44} {'pooled':<9} {p:>10.4f} {q:>9.4f} {p / q:>6.2f}  (vs numpy)")
    finally:
        numpy_fused_gemm._MIN_MACS = threshold


CONVS = [  # name, x shape, out channels, kernel, stride, padding[, groups]
    ("ResNet-50 3x3, 64 ch, 56x56", (16, 64, 56, 56), 64, 3, 1, 1),
    ("ResNet-50 3x3, 128 ch, 28x28", (16, 128, 28, 28), 128, 3, 1, 1),
    ("ResNet-50 3x3, 256 ch, 14x14", (16, 256, 14, 14), 256, 3, 1, 1),
    ("ResNet-50 3x3, 512 ch, 7x7", (16, 512, 7, 7), 512, 3, 1, 1),
    ("ResNet-50 3x3/2, 256 ch, 28x28", (16, 256, 28, 28), 256, 3, 2, 1),
    ("ResNet-50 7x7/2 stem, 3 -> 64 ch, 224x224", (16, 3, 224, 224), 64, 7, 2, 3),
    ("ResNet-50 1x1, 2048 <- 512, 7x7", (16, 512, 7, 7), 2048, 1, 1, 0),
    ("VGG-16 3x3, 64 ch, 224x224", (8, 64, 224, 224), 64, 3, 1, 1),
    ("VGG-16 3x3, 256 ch, 56x56", (8, 256, 56, 56), 256, 3, 1, 1),
    ("VGG-16 3x3, 512 ch, 14x14", (8, 512, 14, 14), 512, 3, 1, 1),
    ("ResNet-164 3x3, 16 ch, 32x32", (16, 16, 32, 32), 16, 3, 1, 1),
    ("ResNet-164 1x1, 16 <- 64, 32x32", (16, 64, 32, 32), 16, 1, 1, 0),
    ("ResNet-164 1x1, 64 <- 16, 32x32", (16, 16, 32, 32), 64, 1, 1, 0),
    ("ResNet-164 3x3, 32 ch, 16x16", (16, 32, 16, 16), 32, 3, 1, 1),
    ("ResNet-164 3x3, 64 ch, 8x8", (16, 64, 8, 8), 64, 3, 1, 1),
    ("digits-cnn 3x3, 1 -> 16 ch, 8x8", (32, 1, 8, 8), 16, 3, 1, 1),
    ("digits-cnn 3x3, 16 -> 32 ch, 8x8", (32, 16, 8, 8), 32, 3, 1, 1),
    ("MobileNetV2 3x3/2 stem, 3 -> 32 ch, 224x224", (8, 3, 224, 224), 32, 3, 2, 1),
    ("MobileNetV2 1x1, 96 <- 16, 112x112", (8, 16, 112, 112), 96, 1, 1, 0),
    ("MobileNetV2 1x1, 144 <- 24, 56x56", (8, 24, 56, 56), 144, 1, 1, 0),
    # MobileNetV2's depthwise 3x3s (groups = channels), batch 8 as bench_step.py's
    ("MobileNetV2 depthwise 3x3, 32 ch, 112x112", (8, 32, 112, 112), 32, 3, 1, 1, 32),
    ("MobileNetV2 depthwise 3x3/2, 96 ch, 112x112", (8, 96, 112, 112), 96, 3, 2, 1, 96),
    ("MobileNetV2 depthwise 3x3, 144 ch, 56x56", (8, 144, 56, 56), 144, 3, 1, 1, 144),
    ("MobileNetV2 depthwise 3x3, 192 ch, 28x28", (8, 192, 28, 28), 192, 3, 1, 1, 192),
    ("MobileNetV2 depthwise 3x3, 384 ch, 14x14", (8, 384, 14, 14), 384, 3, 1, 1, 384),
    ("MobileNetV2 depthwise 3x3, 960 ch, 7x7", (8, 960, 7, 7), 960, 3, 1, 1, 960),
    ("MobileNetV2 depthwise 3x3/2, 192 ch, 28x28", (8, 192, 28, 28), 192, 3, 2, 1, 192),
    ("MobileNetV2 depthwise 3x3/2, 576 ch, 14x14", (8, 576, 14, 14), 576, 3, 2, 1, 576),
]


def conv_cases(np, torch, ops, ctx, rng, repeats, only=None) -> None:
    """conv2d forward, input gradient and weight gradient (the executor's three kernels)
    against torch's convolution and convolution_backward, float32."""
    for name, shape, o, k, s, p, *grouped in CONVS:
        if only and not any(t in name for t in only):
            continue
        g = grouped[0] if grouped else 1
        x = rng.standard_normal(shape).astype(np.float32)
        w = (rng.standard_normal((o, shape[1] // g, k, k)) / 10).astype(np.float32)
        geom = {"kernel": k, "stride": s, "padding": p, "dilation": 1, "groups": g}
        y = ops["conv2d"].kernel(np, [x, w], geom, ctx)
        dy = rng.standard_normal(y.shape).astype(np.float32)
        tx, tw, tdy = (torch.from_numpy(v) for v in (x, w, dy))
        bwd = torch.ops.aten.convolution_backward
        ours = {
            "forward": lambda: ops["conv2d"].kernel(np, [x, w], geom, ctx),
            "dx": lambda: ops["conv2d_grad_input"].kernel(
                np, [dy, w], {**geom, "shape": x.shape}, ctx),
            "dw": lambda: ops["conv2d_grad_weight"].kernel(
                np, [dy, x], {**geom, "shape": w.shape}, ctx)}
        args = ([s, s], [p, p], [1, 1], False, [0, 0], g)
        theirs = {
            "forward": lambda: torch.nn.functional.conv2d(tx, tw, stride=s, padding=p,
                                                          groups=g),
            "dx": lambda: bwd(tdy, tx, tw, None, *args, [True, False, False]),
            "dw": lambda: bwd(tdy, tx, tw, None, *args, [False, True, False])}
        for part in ours:
            m, t = best_ms(ours[part], repeats), best_ms(theirs[part], repeats)
            print(f"{name:<44} {part:<9} {m:>10.3f} {t:>9.3f} {m / t:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
