"""Device profiles: what the cost model needs to know about a machine.

A profile gives the device's memory capacity, its sustained arithmetic rate (FLOP/s at
the training dtype), its memory bandwidth, the host link's bandwidth (the PCIe or NVLink
path that offloaded tensors travel) and a fixed cost per kernel launch. The numbers of the
built-in profiles are datasheet peaks derated to what dense kernels sustain in practice
(GEMM-heavy convolutions reach about 75% of peak FP32, streaming kernels about 80% of peak
bandwidth, pinned-memory copies about 80% of the link's theoretical rate); each one names
its source below and in docs/memory.md.

`calibrate()` measures this machine (a float32 GEMM, a large array copy, a tiny kernel)
into a profile that `netdsl plan --profile FILE` reads back from JSON.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from netdsl.errors import NetdslError

GEMM_EFF, BW_EFF, LINK_EFF = 0.75, 0.80, 0.80


@dataclass(frozen=True)
class Profile:
    name: str
    capacity_bytes: int  # device memory
    flops_per_s: float  # sustained FP32 arithmetic rate
    mem_bw: float  # device memory bandwidth, bytes/s
    link_bw: float  # host <-> device copy bandwidth, bytes/s (each direction)
    op_overhead_s: float  # launch + framework cost of one node
    unified: bool = False  # host and device are the same memory: offload saves nothing
    source: str = ""

    def to_json(self) -> dict:
        return asdict(self)


PROFILES: dict[str, Profile] = {
    # NVIDIA Tesla K40 board specification (BD-06902-001_v05, 2013): 12 GB GDDR5,
    # 288 GB/s, 4.29 TFLOP/s FP32 at base clock (745 MHz, 2880 cores x 2 FLOP), PCIe 3.0
    # x16 (15.75 GB/s per direction). The card SuperNeurons (PPoPP'18) and Layup
    # (TACO 2019) measured on.
    "k40-12gb": Profile("k40-12gb", 12 * 10**9, 4.29e12 * GEMM_EFF, 288e9 * BW_EFF,
                        15.75e9 * LINK_EFF, 8e-6, False,
                        "NVIDIA Tesla K40 board specification BD-06902-001: 12 GB, "
                        "288 GB/s, 4.29 TFLOP/s FP32, PCIe 3.0 x16"),
    # NVIDIA Tesla V100 PCIe datasheet (2017): 16 GB HBM2, 900 GB/s, 14 TFLOP/s FP32,
    # PCIe 3.0 x16.
    "v100-16gb": Profile("v100-16gb", 16 * 10**9, 14.0e12 * GEMM_EFF, 900e9 * BW_EFF,
                         15.75e9 * LINK_EFF, 6e-6, False,
                         "NVIDIA V100 PCIe datasheet: 16 GB HBM2, 900 GB/s, 14 TFLOP/s "
                         "FP32, PCIe 3.0 x16"),
    # NVIDIA A100 Tensor Core GPU datasheet (2020), 40 GB SXM4: 1,555 GB/s, 19.5 TFLOP/s
    # FP32 (no TF32: netdsl computes in plain FP32), PCIe 4.0 x16 (31.5 GB/s).
    "a100-40gb": Profile("a100-40gb", 40 * 10**9, 19.5e12 * GEMM_EFF, 1555e9 * BW_EFF,
                         31.5e9 * LINK_EFF, 5e-6, False,
                         "NVIDIA A100 datasheet (40 GB SXM4): 1,555 GB/s, 19.5 TFLOP/s "
                         "FP32, PCIe 4.0 x16"),
    # NVIDIA H100 Tensor Core GPU datasheet (2023), SXM5: 80 GB HBM3, 3.35 TB/s,
    # 67 TFLOP/s FP32, PCIe 5.0 x16 (63 GB/s).
    "h100-80gb": Profile("h100-80gb", 80 * 10**9, 67e12 * GEMM_EFF, 3.35e12 * BW_EFF,
                         63e9 * LINK_EFF, 5e-6, False,
                         "NVIDIA H100 datasheet (SXM5): 80 GB HBM3, 3.35 TB/s, 67 TFLOP/s "
                         "FP32, PCIe 5.0 x16"),
    # NVIDIA H200 Tensor Core GPU product brief (2024), SXM: 141 GB HBM3e, 4.8 TB/s,
    # 67 TFLOP/s FP32, PCIe 5.0 x16 (63 GB/s).
    "h200": Profile("h200", 141 * 10**9, 67e12 * GEMM_EFF, 4.8e12 * BW_EFF,
                    63e9 * LINK_EFF, 5e-6, False,
                    "NVIDIA H200 product brief (SXM): 141 GB HBM3e, 4.8 TB/s, 67 TFLOP/s "
                    "FP32, PCIe 5.0 x16"),
    # The NumPy backend: "device" memory is host memory, so an offloaded copy costs as
    # much memory as the original. Rates are those of a small 2-core x86 server (measure
    # yours with `netdsl calibrate`); capacity is this project's 24 GB CI machine.
    "cpu": Profile("cpu", 24 * 10**9, 60e9, 10e9, 10e9, 15e-6, True,
                   "2-core x86 server with NumPy/OpenBLAS, 24 GB (netdsl calibrate "
                   "measures your own)"),
}


class ProfileError(NetdslError):
    pass


_FIELDS = ("name", "capacity_bytes", "flops_per_s", "mem_bw", "link_bw", "op_overhead_s")


def get_profile(spec: str | Profile) -> Profile:
    """A built-in profile by name, or one read from a JSON file (`netdsl calibrate -o`)."""
    if isinstance(spec, Profile):
        return spec
    if spec in PROFILES:
        return PROFILES[spec]
    path = Path(spec)
    if not path.exists():
        raise ProfileError(f"unknown device profile {spec!r}: use one of "
                           f"{', '.join(PROFILES)} or a JSON file written by "
                           "`netdsl calibrate -o FILE`")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProfileError(f"{path}: cannot read a device profile: {e}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: a device profile is a JSON object with the fields "
                           f"{', '.join(_FIELDS)}")
    missing = [f for f in _FIELDS if f not in data]
    if missing:
        raise ProfileError(f"{path}: the device profile lacks {', '.join(missing)}")
    unknown = sorted(set(data) - set(_FIELDS) - {"unified", "source"})
    if unknown:
        raise ProfileError(f"{path}: unknown profile field(s) {', '.join(unknown)}; "
                           f"expected {', '.join(_FIELDS)}, unified, source")
    for f in _FIELDS[1:]:
        v = data[f]
        bad = isinstance(v, bool) or not isinstance(v, int | float) or v < 0 or \
            (v == 0 and f != "op_overhead_s")
        if bad:
            raise ProfileError(f"{path}: profile field {f} must be a positive number, "
                               f"got {v!r}")
    if not isinstance(data["name"], str) or not isinstance(data.get("unified", False), bool):
        raise ProfileError(f"{path}: profile `name` must be a string and `unified` a "
                           "boolean")
    return Profile(data["name"], int(data["capacity_bytes"]), float(data["flops_per_s"]),
                   float(data["mem_bw"]), float(data["link_bw"]),
                   float(data["op_overhead_s"]), data.get("unified", False),
                   str(data.get("source", path.name)))


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def calibrate(name: str = "calibrated", size: int = 1024, copy_mib: int = 64,
              repeats: int = 5) -> Profile:
    """Measure this machine with NumPy: a `size`^3 float32 GEMM, a `copy_mib` MiB copy
    (device memory and host link are the same memory here) and an empty-ish kernel."""
    import os

    import numpy as np
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    c = np.empty_like(a)
    np.matmul(a, b, out=c)  # warm up the BLAS threads
    gemm = 2.0 * size**3 / _best(lambda: np.matmul(a, b, out=c), repeats)
    src = np.ones(copy_mib * 2**20 // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    copy_bw = 2.0 * src.nbytes / _best(lambda: np.copyto(dst, src), repeats)  # read + write
    tiny = np.ones(16, dtype=np.float32)
    overhead = _best(lambda: [np.add(tiny, tiny) for _ in range(1000)], repeats) / 1000
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Profile(name, int(mem), gemm, copy_bw, copy_bw / 2, overhead, True,
                   f"netdsl calibrate: {size}^3 float32 GEMM, {copy_mib} MiB copy, NumPy "
                   f"{np.__version__}")


def save_profile(p: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(p.to_json(), indent=2) + "\n", encoding="utf-8")
