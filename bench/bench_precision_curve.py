"""The loss curve of a bf16 and an f16 run against the f32 run of the same network, data
and seed.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_precision_curve.py \
        [--file examples/resnet20-cifar.net] [--batch 32] [--steps 200]

Trains FILE three times on its own (synthetic) data from the same initial state, f32,
bf16 and f16 (`netdsl run --precision P --log ...`), and compares the curves: the loss
averaged over windows of 20 steps (one step's loss is one batch's, noisy), and the
largest difference of a window's mean from f32's, relative to it. Also the f16 run's
skipped steps and final loss scale.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

WINDOW = 20


def curve(args, precision: str, folder: Path) -> tuple[list[float], dict]:
    log = folder / f"{precision}.jsonl"
    cmd = [sys.executable, "-m", "netdsl_cli", "run", args.file, "--batch", str(args.batch),
           "--steps", str(args.steps), "--eval-samples", "0", "--precision", precision,
           "--log", str(log), "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    return losses, json.loads(r.stdout)


def windows(xs: list[float]) -> list[float]:
    return [sum(xs[k:k + WINDOW]) / WINDOW for k in range(0, len(xs) - WINDOW + 1, WINDOW)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", default="examples/resnet20-cifar.net")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {p: curve(args, p, Path(tmp)) for p in ("f32", "bf16", "f16")}
    ref = windows(runs["f32"][0])
    print(f"{args.file}, batch {args.batch}, {args.steps} steps; loss means over windows of "
          f"{WINDOW} steps")
    print("window  " + "  ".join(f"{p:>7}" for p in runs))
    for k in range(len(ref)):
        print(f"{k * WINDOW + 1:>4}-{(k + 1) * WINDOW:<4}" + "  ".join(
            f"{windows(runs[p][0])[k]:>7.4f}" for p in runs))
    for p in ("bf16", "f16"):
        w = windows(runs[p][0])
        worst = max(abs(a - b) / b for a, b in zip(w, ref))
        extra = ""
        if runs[p][1].get("loss_scale"):
            s = runs[p][1]["loss_scale"]
            extra = f"; skipped {s['skipped_steps']} step(s), final scale {s['scale']:g}"
        print(f"{p}: largest window difference from f32 {worst:.1%}; final loss "
              f"{runs[p][1]['final_loss']:.4f} (f32 {runs['f32'][1]['final_loss']:.4f})"
              + extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
