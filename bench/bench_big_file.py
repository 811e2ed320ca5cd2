"""Checking cost against file size: `netdsl check` on generated `.net` files of 1 to 10 MB.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_big_file.py \
        [--mb 1 2 5 10] [--baseline DIR]

Each file is one network of about 16,000 statements per MB (`h = relu(h + linear(h, 16,
bias=false) * 0.5)`, with a comment). Each size is checked by running `netdsl check FILE`
in a fresh process, as a user does (start-up, parse, elaborate, verify, bind the batch,
statistics); the wall time and the CPU time of that process are reported, and the time
per MB against the smallest file's, measured in the same run (linear: a ratio of 1).
The CPU time is the steadier figure on a shared machine. Target: 10 MB in under 20 s.

`--baseline DIR` also runs the same files through the netdsl sources in DIR (a checkout
of an older commit, e.g. `git archive COMMIT | tar -x -C DIR`), for a before/after ratio
measured under the same load.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 20.0


def generate(size_bytes: int) -> str:
    lines = ["network big {", "    input x: f32[N, 16]", "    h = x"]
    total, i = 0, 0
    while total < size_bytes:
        line = f"    h = relu(h + linear(h, 16, bias=false) * 0.5)  # step {i}"
        lines.append(line)
        total += len(line) + 1
        i += 1
    return "\n".join(lines + ["    output h", "}"]) + "\n"


def check_seconds(path: Path, src: str | None) -> tuple[float, float, str]:
    """Wall and CPU seconds of `netdsl check path` in a new process, and its output."""
    env = dict(os.environ)
    if src is not None:  # the sources of another checkout first on the path
        env["PYTHONPATH"] = os.pathsep.join([src, str(Path(src) / "cli")])
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "netdsl_cli", "check", str(path)], env=env,
                         cwd=path.parent,  # not this folder: `-m` would import its netdsl
                         capture_output=True, text=True, check=True).stdout
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, out.strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, nargs="+", default=[1.0, 2.0, 5.0, 10.0])
    ap.add_argument("--baseline", help="a checkout of older netdsl sources to compare with")
    a = ap.parse_args(argv)
    runs = [("this tree", None)] + ([("baseline", a.baseline)] if a.baseline else [])
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for mb in sorted(a.mb):
            p = Path(tmp) / f"big{mb:g}mb.net"
            p.write_text(generate(int(mb * 1_000_000)))
            files.append((p.stat().st_size / 1e6, p))
        totals = {}
        for label, src in runs:
            print(f"{label}:" + (f" {src}" if src else ""))
            ref = None
            for size, p in files:
                wall, cpu, out = check_seconds(p, src)
                ref = ref or (wall / size, cpu / size)
                nodes = out.rsplit(", ", 1)[-1].strip()
                print(f"  {size:6.2f} MB, {nodes:>16}: {wall:7.2f} s wall, {cpu:7.2f} s CPU; "
                      f"per MB {wall / size:5.2f} s wall ({wall / size / ref[0]:.2f}x the "
                      f"smallest), {cpu / size:5.2f} s CPU ({cpu / size / ref[1]:.2f}x)")
            totals[label] = (wall, cpu, size)
    wall, cpu, size = totals["this tree"]
    print(f"largest file ({size:.1f} MB): {wall:.1f} s wall, {cpu:.1f} s CPU; target for 10 MB: "
          f"under {TARGET_S:.0f} s")
    if a.baseline:
        bw, bc, _ = totals["baseline"]
        print(f"baseline / this tree on the largest file: {bw / wall:.1f}x wall, "
              f"{bc / cpu:.1f}x CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
