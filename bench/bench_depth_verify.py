"""One resnet2504-family network of 5,000 layers (1,622 blocks in the third stage), planned
into 12 GB at batch 16 on k40-12gb with optimizer state allowed on the host, and the plan
checked against the truth: `plan_and_apply` rewrites the step (`apply_decisions`, which
now streams optimizer state) and packs its storage plan (`make_plan`).

    .venv/bin/python bench/bench_depth_verify.py [--blocks 1622]
"""
import argparse
import time

from bench_depth import TEMPLATE

from netdsl.api import loads
from netdsl.config import TrainConfig
from netdsl.memory.search import plan_and_apply
from netdsl.step.graphs import training_graph

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--blocks", type=int, default=1622)
b = ap.parse_args().blocks
net = loads(TEMPLATE.format(b=b), file="examples/deep.net")
step = training_graph(net.lower(16), net.train or TrainConfig())
t = time.time()
g, res = plan_and_apply(step, "12GB", "k40-12gb", "auto", offload_state=True)
print(f"layers {3 * (6 + 32 + b + 6) + 2} feasible {res.feasible} planned "
      f"{res.planned_peak_bytes} verified {res.verified_peak_bytes} overhead "
      f"{res.predicted_overhead:.3f} state offloaded {res.state_offloaded} of "
      f"{res.state_buffers} time {time.time() - t:.1f} s")
