"""Front-end speed on the flagship: parse + check + lower of examples/resnet2504.net.

    /work/venv/bin/python bench/bench_frontend.py [--runs 7] [--batch 16] [FILE]

Phases, each timed separately in one process:
  parse  - read the file and its stdlib imports, Lark parse, AST (netdsl.frontend.load_module)
  check  - elaborate blocks/repeats into the IR with shape inference, verify, read the
           train section (what netdsl.load does after parsing)
  lower  - bind the symbolic batch N to --batch (Network.lower)
The first run (cold: it also builds the Lark parser) is reported on its own; the figure
compared with the 1-second target is the median of the warm runs. Importing netdsl is
not counted (it is reported too).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

t_import = time.perf_counter()
from netdsl.api import Network  # noqa: E402
from netdsl.frontend import elaborate, load_module, train_config  # noqa: E402

t_import = time.perf_counter() - t_import

SHOW_TARGET_S = 2.0
TARGET_S = 1.0
ROOT = Path(__file__).resolve().parent.parent


def one_run(path: Path, batch: int) -> dict[str, float]:
    t0 = time.perf_counter()
    env = load_module(path)
    t1 = time.perf_counter()
    net = Network(env, elaborate(env), train_config(env.tree.train))
    t2 = time.perf_counter()
    g = net.lower(batch=batch)
    t3 = time.perf_counter()
    assert len(g.by_op("conv2d")) > 0
    return {"parse": t1 - t0, "check": t2 - t1, "lower": t3 - t2, "total": t3 - t0,
            "nodes": len(g.nodes)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", nargs="?", default=str(ROOT / "examples" / "resnet2504.net"))
    ap.add_argument("--runs", type=int, default=7, help="warm runs (default 7)")
    ap.add_argument("--batch", type=int, default=16)
    a = ap.parse_args(argv)
    path = Path(a.file)

    cold = one_run(path, a.batch)
    warm = [one_run(path, a.batch) for _ in range(a.runs)]
    med = {k: statistics.median(r[k] for r in warm) for k in ("parse", "check", "lower",
                                                              "total")}
    print(f"netdsl front end: {path.name}, {cold['nodes']:,} IR nodes, batch {a.batch}")
    print(f"  import netdsl          {t_import * 1e3:8.1f} ms (not counted)")
    print(f"  cold run (1st)         {cold['total'] * 1e3:8.1f} ms "
          f"(parse {cold['parse'] * 1e3:.1f}, check {cold['check'] * 1e3:.1f}, "
          f"lower {cold['lower'] * 1e3:.1f})")
    print(f"  warm median of {a.runs:<2d}     {med['total'] * 1e3:8.1f} ms "
          f"(parse {med['parse'] * 1e3:.1f}, check {med['check'] * 1e3:.1f}, "
          f"lower {med['lower'] * 1e3:.1f}); min {min(r['total'] for r in warm) * 1e3:.1f}, "
          f"max {max(r['total'] for r in warm) * 1e3:.1f}")
    print(f"  target {TARGET_S:.1f} s: warm median is {med['total'] / TARGET_S:.2f}x the target "
          f"(cold {cold['total'] / TARGET_S:.2f}x)")
    # the whole `netdsl show` command as a user runs it: interpreter start, import, parse,
    # check, lower, summarise, fold and print the table
    shows = []
    for _ in range(max(3, a.runs // 2)):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "netdsl_cli", "show", str(path)], check=True,
                       stdout=subprocess.DEVNULL)
        shows.append(time.perf_counter() - t0)
    show = statistics.median(shows)
    print(f"  `netdsl show` (whole command, median of {len(shows)}) {show * 1e3:8.1f} ms: "
          f"{show / SHOW_TARGET_S:.2f}x the {SHOW_TARGET_S:.0f} s target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
