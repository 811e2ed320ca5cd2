"""ResNet-164 (CIFAR, pre-activation bottleneck) training step in Chainer, for bench_step.py.

    SETUPTOOLS_USE_DISTUTILS=stdlib bench/.venvs/chainer/bin/python \
        bench/refs/chainer_resnet164.py --batch 16 --steps 5

The same network as examples/resnet164-cifar.net (--blocks 18) or resnet1001-cifar.net
(--blocks 111) and PreactResNet in refs/torch_models.py (see there);
MomentumSGD lr 0.1, momentum 0.9, with a WeightDecay(1e-4) hook. Chainer runs on NumPy
(im2col + tensordot convolutions), so it is the closest peer of netdsl's NumPy backend.
Prints one JSON line: parameter count, per-step seconds (after warm-up), thread info.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
import warnings

warnings.filterwarnings("ignore")
import chainer  # noqa: E402
import chainer.functions as F  # noqa: E402
import chainer.links as L  # noqa: E402
import numpy as np  # noqa: E402


class PreactBottleneck(chainer.Chain):
    def __init__(self, cin: int, width: int, stride: int = 1):
        super().__init__()
        out = 4 * width
        self.has_proj = stride != 1 or cin != out
        with self.init_scope():
            self.bn1 = L.BatchNormalization(cin)
            self.conv1 = L.Convolution2D(cin, width, 1, nobias=True)
            self.bn2 = L.BatchNormalization(width)
            self.conv2 = L.Convolution2D(width, width, 3, stride=stride, pad=1, nobias=True)
            self.bn3 = L.BatchNormalization(width)
            self.conv3 = L.Convolution2D(width, out, 1, nobias=True)
            if self.has_proj:
                self.proj = L.Convolution2D(cin, out, 1, stride=stride, nobias=True)

    def forward(self, x):
        a = F.relu(self.bn1(x))
        h = self.conv1(a)
        h = self.conv2(F.relu(self.bn2(h)))
        h = self.conv3(F.relu(self.bn3(h)))
        return h + (self.proj(a) if self.has_proj else x)


class ResNet164(chainer.Chain):
    def __init__(self, blocks: int = 18, classes: int = 10):
        super().__init__()
        layers, cin = [], 16
        for width, stride in ((16, 1), (32, 2), (64, 2)):
            for b in range(blocks):
                layers.append(PreactBottleneck(cin, width, stride if b == 0 else 1))
                cin = 4 * width
        with self.init_scope():
            self.stem = L.Convolution2D(3, 16, 3, pad=1, nobias=True)
            self.stages = chainer.ChainList(*layers)
            self.bn = L.BatchNormalization(cin)
            self.fc = L.Linear(cin, classes)

    def forward(self, x):
        h = self.stem(x)
        for block in self.stages:
            h = block(h)
        h = F.relu(self.bn(h))
        return self.fc(F.mean(h, axis=(2, 3)))


from threads import threads_info  # noqa: E402  (this folder)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)  # set through OPENBLAS_NUM_THREADS
    ap.add_argument("--blocks", type=int, default=18, help="per stage: 18 ResNet-164, 111 -1001")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    model = ResNet164(a.blocks)
    opt = chainer.optimizers.MomentumSGD(lr=0.1, momentum=0.9)
    opt.setup(model)
    opt.add_hook(chainer.optimizer_hooks.WeightDecay(1e-4))
    x = rng.standard_normal((a.batch, 3, 32, 32)).astype(np.float32)
    y = rng.integers(0, 10, a.batch).astype(np.int32)
    times, cpus, losses = [], [], []
    with chainer.using_config("train", True):
        for k in range(a.warmup + a.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            model.cleargrads()
            loss = F.softmax_cross_entropy(model(x), y)
            loss.backward()
            opt.update()
            lv = float(loss.array)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            if k >= a.warmup:
                times.append(dt)
                cpus.append(cpu)
                losses.append(lv)
    print(json.dumps({
        "framework": f"Chainer {chainer.__version__} (NumPy {np.__version__})",
        "params": int(sum(p.size for p in model.params())),
        "times": times, "cpu_times": cpus, "median_s": statistics.median(times), "losses": losses,
        "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "threadpools": threads_info()}))


if __name__ == "__main__":
    main()
