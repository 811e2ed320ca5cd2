"""Pipeline schedules: the executor's measured bubble against each schedule's formula, on
a pipeline of equal stages (tests/nets/linear-chain.net: 8 identical 256 x 256 products).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_schedules.py \
        [--pipeline 4] [--microbatches 8] [--batch 2048] [--runs 5]

For GPipe, 1F1B, ZB-H1 and interleaved 1F1B (2 virtual stages) it builds the split step,
runs it with every kernel timed (the least of --runs runs) and replays the executed order
per device (`netdsl.runtime.timeline`), then prints the measured bubble, the interval the
measured task times allow around it (`bubble_bounds`), the formula, the predictor's bubble
(`parallel.predict` on the cpu profile over shm), the replayed step against 1F1B's in the
same run, and the largest planned per-device peak against 1F1B's.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from netdsl import api
from netdsl.memory.profiles import get_profile
from netdsl.parallel.predict import get_interconnect, report
from netdsl.parallel.split import SplitSpec
from netdsl.runtime.data import Loader, make_dataset
from netdsl.runtime.executor import Executor
from netdsl.runtime.timeline import bubble_bounds, measure, replay
from netdsl.step.graphs import split_training_step

CHAIN = Path(__file__).resolve().parent.parent / "tests" / "nets" / "linear-chain.net"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pipeline", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    net = api.load(CHAIN)
    data = make_dataset(net.graph, net.train.data, 0)
    feeds = dict(zip(data.input_names, Loader(data.train, a.batch, 0).next(), strict=True))
    p, m = a.pipeline, a.microbatches
    specs = {"gpipe": SplitSpec(pipeline=p, microbatches=m),
             "1f1b": SplitSpec(pipeline=p, microbatches=m, schedule="1f1b"),
             "zb-h1": SplitSpec(pipeline=p, microbatches=m, schedule="zb-h1"),
             "interleaved v=2": SplitSpec(pipeline=p, microbatches=m, schedule="1f1b",
                                          virtual_stages=2)}
    print(f"linear-chain, pipeline={p}, microbatches={m}, batch {a.batch}, f32, "
          f"least of {a.runs} runs")
    print(f"{'schedule':<16} {'measured':>9} {'interval':>17} {'formula':>8} "
          f"{'predicted':>9} {'step vs 1f1b':>12} {'peak vs 1f1b':>12}")
    ref_step = ref_peak = None
    rows = []
    for name, spec in specs.items():
        g = split_training_step(net.graph, a.batch, spec, net.train.optimizer.model_dump())
        order, durations = measure(Executor(g, "numpy", "f32", 0), feeds, a.runs)
        rep = replay(g, order, durations)
        b = bubble_bounds(g, rep)
        predicted, _ = report(g, 1.0, get_profile("cpu"), get_interconnect("shm"))
        peak = max(d.peak_bytes for d in predicted.per_device)
        rows.append((name, b, predicted.bubble, rep.makespan, peak))
        if name == "1f1b":
            ref_step, ref_peak = rep.makespan, peak
    for name, b, pred, step, peak in rows:
        print(f"{name:<16} {b.measured:>9.3f} {f'[{b.low:.3f}, {b.high:.3f}]':>17} "
              f"{b.formula:>8.3f} {pred:>9.3f} {step / ref_step:>12.2f} {peak / ref_peak:>12.2f}")


if __name__ == "__main__":
    main()
