"""Sharded data parallelism over MPI (`mpiexec -n 2 netdsl run --distributed --shard S`):
the losses of one process, a checkpoint resumed in one process, and each rank's state and
peak as tracemalloc measures them against its plan. Skipped without mpi4py."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from test_mpi import MPIEXEC, NET, ROOT, losses, netdsl, two_ranks

pytest.importorskip("mpi4py")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")


@pytest.mark.parametrize("shard", [1, 2, 3])
def test_two_sharded_ranks_give_the_losses_of_one_process(tmp_path, shard):
    """float64: the losses of one device to rounding, and bit for bit those of the same
    sharded split in one process; rank 0's checkpoint (whole entries) resumed in one
    process goes on as one device's run does."""
    common = ("--steps", "3", "--dtype", "f64", "--eval-samples", "0")
    one, same, two = (tmp_path / f"{x}.jsonl" for x in ("one", "same", "two"))
    a = netdsl(*common, "--log", str(one))
    s = netdsl(*common, "--devices", "2", "--shard", str(shard), "--log", str(same))
    b = netdsl(*common, "--shard", str(shard), "--log", str(two), "--json",
               "--checkpoint", str(tmp_path / "ck"), ranks=2)
    assert a.returncode == s.returncode == b.returncode == 0, a.stderr + s.stderr + b.stderr
    assert json.loads(b.stdout)["split"] == f"data=2, shard={shard}"
    np.testing.assert_allclose(losses(two), losses(one), rtol=1e-12)
    assert losses(two) == losses(same)
    r = netdsl("--steps", "5", "--dtype", "f64", "--eval-samples", "0", "--resume",
               "--checkpoint", str(tmp_path / "ck"), "--json")
    alone = netdsl("--steps", "5", "--dtype", "f64", "--eval-samples", "0", "--json")
    assert r.returncode == alone.returncode == 0, r.stderr + alone.stderr
    assert json.loads(r.stdout)["resumed_from"] == 3
    assert json.loads(r.stdout)["final_loss"] == pytest.approx(
        json.loads(alone.stdout)["final_loss"], rel=1e-12)


STATE = """
import gc, json, sys, tracemalloc
from pathlib import Path
import netdsl
from netdsl.memory.plan import process_reserves
from netdsl.runtime.executor import Executor
from netdsl.runtime.mpi import world
from netdsl.runtime.options import RunOptions
from netdsl.runtime.trainer import Trainer
net = netdsl.load(sys.argv[1])
t = Trainer(net.graph, net.train, RunOptions(steps=2, eval_samples=0, distributed=True,
                                             split="data", shard=int(sys.argv[2]),
                                             batch=8))
g = t.executor.graph
tracemalloc.start()
held = Executor(g, "numpy", "f32", seed=0)  # what this rank's state takes, measured
state = tracemalloc.get_traced_memory()[0]
tracemalloc.stop()
del held
gc.collect()  # (the executor holds cycles)
r = t.fit()
rank = world()[0]
opt = sum(n.type.nbytes() for n in g.nodes if n.attrs.get("role") == "optimizer_state")
(Path(sys.argv[3]) / f"rank{rank}.json").write_text(json.dumps(
    {"planned": t.planned_peak_bytes(), "measured": r.peak_bytes,
     "reserve": process_reserves(t.full_graph)[rank], "state_measured": state,
     "state_planned": sum(n.type.nbytes() for n in g.nodes if n.op in ("param", "buffer")),
     "optimizer_state": opt}))
"""


def test_each_sharded_rank_holds_its_share_and_stays_within_its_plan(tmp_path):
    """Per rank, tracemalloc's count of the state an executor of its step allocates is
    the state its plan holds (with the executor's tables); the optimizer state that
    stage 1 removed from each rank, measured so, is half of it (two ranks), and stage 3
    half of the parameters too; and each rank's peak over a step is within its plan and
    its process's reserve."""
    got = {}
    for shard in (0, 1, 3):
        out = tmp_path / str(shard)
        out.mkdir()
        two_ranks(tmp_path, STATE, str(ROOT / "examples" / "resnet20-cifar.net"), str(shard),
                  str(out))
        got[shard] = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for shard, ranks in got.items():
        for d in ranks:
            # (and the executor's own tables: about 70 kB here)
            assert 0 <= d["state_measured"] - d["state_planned"] <= 150_000, d
            assert d["measured"] <= d["planned"] + d["reserve"], (shard, d)
    for plain, sharded, full in zip(got[0], got[1], got[3], strict=True):
        saved = plain["state_measured"] - sharded["state_measured"]
        # (the executors' own tables differ a little too: the sharded step has fewer nodes)
        assert saved == pytest.approx(plain["optimizer_state"] / 2, rel=0.05)
        assert sharded["optimizer_state"] == pytest.approx(plain["optimizer_state"] / 2,
                                                           abs=16)
        # stage 3: the parameters too (the batchnorms' running statistics stay whole)
        params = plain["state_planned"] - plain["optimizer_state"]
        saved = plain["state_measured"] - full["state_measured"]
        assert saved == pytest.approx((plain["optimizer_state"] + params) / 2, rel=0.05)


def test_a_sharded_run_is_refused_where_the_split_cannot_shard():
    """--shard with a pipeline over two ranks: one clear paragraph from rank 0."""
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "netdsl_cli", "run", NET, "--steps",
           "1", "--distributed", "--split", "pipeline", "--shard", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "Traceback" not in out.stderr + out.stdout
    assert "does not combine with --split pipeline" in " ".join((out.stdout +
                                                                 out.stderr).split())
