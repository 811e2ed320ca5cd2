"""One network's training step in PyTorch, for bench_step.py.

    bench/.venvs/torch/bin/python bench/refs/torch_step.py --net resnet164 --batch 16 --steps 5

The networks are in torch_models.py (each the same as its examples/*.net file, with the
file's optimizer). Prints one JSON line: parameter count, per-step seconds (after warm-up),
CPU seconds, losses, the process's peak RSS, thread info.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from threads import threads_info  # noqa: E402  (this folder)
from torch_models import NETWORKS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--net", default="resnet164", choices=sorted(NETWORKS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (bench_step --backend cupy)")
    ap.add_argument("--tf32", action="store_true",
                    help="on cuda, PyTorch's default: cuDNN's float32 convolutions on TF32 "
                         "tensor cores (inputs rounded to 10 bits). Without it they stay "
                         "float32, as netdsl's (and as matmuls are by default)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    torch.backends.cudnn.allow_tf32 = a.tf32
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    make_model, make_opt, make_batch = NETWORKS[a.net]
    model = make_model().train().to(dev)
    opt = make_opt(model.parameters())
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = (t.to(dev) for t in make_batch(a.batch))
    times, cpus, losses = [], [], []
    for k in range(a.warmup + a.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        lv = float(loss)  # waits for the step on a GPU too
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        if k >= a.warmup:
            times.append(dt)
            cpus.append(cpu)
            losses.append(lv)
    gpu = {}
    if dev.type == "cuda":  # what the caching allocator took from the device, at most
        gpu = {"device_peak_bytes": torch.cuda.max_memory_reserved(),
               "device_allocated_peak_bytes": torch.cuda.max_memory_allocated(),
               "gpu": torch.cuda.get_device_name(), "cudnn": torch.backends.cudnn.version(),
               "cudnn_tf32": torch.backends.cudnn.allow_tf32,
               "matmul_tf32": torch.backends.cuda.matmul.allow_tf32}
    print(json.dumps({
        **gpu,
        "framework": f"PyTorch {torch.__version__}" + (" CUDA" if gpu else ""),
        "params": sum(p.numel() for p in model.parameters()),
        "times": times, "cpu_times": cpus, "median_s": statistics.median(times), "losses": losses,
        "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "threads": torch.get_num_threads(), "mkldnn": torch.backends.mkldnn.is_available(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threadpools": threads_info()}))


if __name__ == "__main__":
    main()
