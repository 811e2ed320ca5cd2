"""Checking cost against file size: a generated `.net` file of SIZE MB and one a tenth of it.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_big_file.py [--mb 10]

Each file is one network of about SIZE * 16,000 statements (`h = relu(h + linear(h, 16,
bias=false) * 0.5)`, with a comment), checked as `netdsl check` does (parse, elaborate,
verify). It prints both times and their ratio: a linear front end gives about 10 (the
target for the 10 MB file is under 20 s on an unloaded core).
"""
from __future__ import annotations

import argparse
import time

import netdsl


def generate(size_bytes: int) -> str:
    lines = ["network big {", "    input x: f32[N, 16]", "    h = x"]
    total, i = 0, 0
    while total < size_bytes:
        line = f"    h = relu(h + linear(h, 16, bias=false) * 0.5)  # step {i}"
        lines.append(line)
        total += len(line) + 1
        i += 1
    return "\n".join(lines + ["    output h", "}"]) + "\n"


def check_seconds(text: str) -> tuple[float, int]:
    t = time.perf_counter()
    net = netdsl.loads(text, file="big.net")
    return time.perf_counter() - t, len(net.graph.nodes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=10.0)
    a = ap.parse_args(argv)
    big = generate(int(a.mb * 1_000_000))
    small = generate(int(a.mb * 100_000))
    ts, ns = check_seconds(small)
    tb, nb = check_seconds(big)
    print(f"{len(small) / 1e6:6.2f} MB, {ns:>9,} nodes: {ts:7.2f} s")
    print(f"{len(big) / 1e6:6.2f} MB, {nb:>9,} nodes: {tb:7.2f} s")
    print(f"ratio {tb / ts:.1f} for {len(big) / len(small):.1f}x the size "
          f"(linear: equal); target for 10 MB: under 20 s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
