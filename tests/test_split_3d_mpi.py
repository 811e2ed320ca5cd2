"""Splits with tensor ranks over MPI (`mpiexec -n 4 netdsl run --distributed --split
pipeline=2,tensor=2`, and data replicas of tensor ranks sharding their state): each rank
its stage's or replica's tensor rank, the losses of one process bit for bit and of one
device to float64 rounding, and rank 0's checkpoint (joined from every rank's shards and
pieces) resumed in one process as one device's run goes on. Skipped without mpi4py."""
from __future__ import annotations

import json

import numpy as np
import pytest
from test_mpi import MPIEXEC, losses, netdsl

pytest.importorskip("mpi4py")
pytestmark = [pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec"), pytest.mark.slow]


# tensor ranks in pipeline stages; and data replicas of tensor ranks sharding their state
# (stage 3: pieces of the tensor shards' rows, joined from the ranks by rank 0)
@pytest.mark.parametrize("sizes, shard", [("pipeline=2,tensor=2", None),
                                          ("data=2,tensor=2", "3")])
def test_four_ranks_of_a_3d_split_give_the_losses_of_one_process(tmp_path, sizes, shard):
    common = ("--steps", "3", "--dtype", "f64", "--eval-samples", "0", "--batch", "8")
    split = ("--split", sizes, *(("--shard", shard) if shard else ()))
    one, same, four = (tmp_path / f"{x}.jsonl" for x in ("one", "same", "four"))
    a = netdsl(*common, "--log", str(one))
    s = netdsl(*common, *split, "--devices", "4", "--log", str(same))
    b = netdsl(*common, *split, "--log", str(four), "--json", "--checkpoint",
               str(tmp_path / "ck"), ranks=4)
    assert a.returncode == s.returncode == b.returncode == 0, a.stderr + s.stderr + b.stderr
    d = json.loads(b.stdout)
    assert d["split"].startswith(sizes.split(",")[0]) and d["split"].endswith("tensor=2")
    assert losses(four) == losses(same)
    np.testing.assert_allclose(losses(four), losses(one), rtol=1e-12)
    r = netdsl("--steps", "5", "--dtype", "f64", "--eval-samples", "0", "--batch", "8",
               "--resume", "--checkpoint", str(tmp_path / "ck"), "--json")
    alone = netdsl("--steps", "5", "--dtype", "f64", "--eval-samples", "0", "--batch", "8",
                   "--json")
    assert r.returncode == alone.returncode == 0, r.stderr + alone.stderr
    assert json.loads(r.stdout)["resumed_from"] == 3
    assert json.loads(r.stdout)["final_loss"] == pytest.approx(
        json.loads(alone.stdout)["final_loss"], rel=1e-12)
