"""ResNet-164 (CIFAR, pre-activation bottleneck) training step in PyTorch, for bench_step.py.

    bench/.venvs/torch/bin/python bench/refs/torch_resnet164.py --batch 16 --steps 5

The same network as examples/resnet164-cifar.net: 3x3 16-channel stem without bias, three
stages of 18 pre-activation bottlenecks (widths 16/32/64, outputs 64/128/256, strides
1/2/2; the projection shortcut reads the pre-activated input), BN-ReLU, global average
pool, linear 256->10; softmax cross-entropy; SGD lr 0.1, momentum 0.9, weight decay 1e-4.
Prints one JSON line: parameter count, per-step seconds (after warm-up), thread info.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
from torch import nn  # noqa: E402


class PreactBottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int = 1):
        super().__init__()
        out = 4 * width
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.proj = (nn.Conv2d(cin, out, 1, stride=stride, bias=False)
                     if stride != 1 or cin != out else None)

    def forward(self, x):
        a = torch.relu(self.bn1(x))
        h = self.conv1(a)
        h = self.conv2(torch.relu(self.bn2(h)))
        h = self.conv3(torch.relu(self.bn3(h)))
        return h + (x if self.proj is None else self.proj(a))


class ResNet164(nn.Module):
    def __init__(self, blocks: int = 18, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        layers, cin = [], 16
        for width, stride in ((16, 1), (32, 2), (64, 2)):
            for b in range(blocks):
                layers.append(PreactBottleneck(cin, width, stride if b == 0 else 1))
                cin = 4 * width
        self.stages = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(cin)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        h = torch.relu(self.bn(self.stages(self.stem(x))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(h, 1), 1))


def threads_info() -> list:
    try:
        from threadpoolctl import threadpool_info
        return [{k: i.get(k) for k in ("internal_api", "architecture", "num_threads",
                                       "version")} for i in threadpool_info()]
    except ImportError:
        return []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = ResNet164().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    loss_fn = nn.CrossEntropyLoss()
    x = torch.randn(a.batch, 3, 32, 32)
    y = torch.randint(0, 10, (a.batch,))
    times, cpus, losses = [], [], []
    for k in range(a.warmup + a.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        lv = float(loss)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        if k >= a.warmup:
            times.append(dt)
            cpus.append(cpu)
            losses.append(lv)
    print(json.dumps({
        "framework": f"PyTorch {torch.__version__}",
        "params": sum(p.numel() for p in model.parameters()),
        "times": times, "cpu_times": cpus, "median_s": statistics.median(times), "losses": losses,
        "threads": torch.get_num_threads(), "mkldnn": torch.backends.mkldnn.is_available(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threadpools": threads_info()}))


if __name__ == "__main__":
    main()
