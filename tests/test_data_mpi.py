"""Image data over MPI (`mpiexec -n 2 ... --distributed`): each rank of a data split reads
only its rows of every global batch, so no sample is read twice, and the losses are one
process's (netdsl/runtime/data/feed.py, `rows_read`)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from test_data_sources import load, write_folder
from test_mpi import MPIEXEC, ROOT

pytest.importorskip("PIL.Image")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")

SCRIPT = """
import json, sys
import netdsl
from netdsl.runtime.data import sources
from netdsl.runtime.options import RunOptions
from netdsl.runtime.trainer import Trainer

read = []
inner = sources.ImageFolder.read
sources.ImageFolder.read = lambda self, i: read.append(int(i)) or inner(self, i)
net = netdsl.load(sys.argv[1])
distributed = sys.argv[3] == "2"
tr = Trainer(net.graph, net.train, RunOptions(steps=4, workers=0, eval_samples=0,
                                              distributed=distributed,
                                              split="data" if distributed else None))
read.clear()  # (the shape check at load reads a sample on every rank)
r = tr.fit()
with open(f"{sys.argv[2]}/rank{tr.rank}-of-{sys.argv[3]}.json", "w") as f:
    json.dump({"read": read, "losses": r.losses}, f)
"""

NET = """
network ranks {
    input x: f32[N, 3, 16, 16]
    input y: i64[N]
    h = relu(batchnorm(conv2d(x, 8, kernel=3, padding=1, bias=false)))
    logits = linear(flatten(global_avgpool(h)), 3)
    output logits
    loss softmax_cross_entropy(logits, y)
}
train { data = images("pics"); batch = 8; seed = 2
  train_transforms = [random_crop(16, padding=2), flip()] }
"""


@pytest.mark.slow
def test_two_ranks_read_disjoint_rows_and_give_one_processs_losses(tmp_path):
    write_folder(tmp_path / "pics", per=8, size=(16, 16))
    load(tmp_path, 'images("pics")')  # (the folder checked as a data set)
    (tmp_path / "ranks.net").write_text(NET)
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    net = str(tmp_path / "ranks.net")
    one = subprocess.run([sys.executable, str(script), net, str(tmp_path), "1"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(script), net, str(tmp_path),
                          "2"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert two.returncode == 0, two.stderr
    single = json.loads((tmp_path / "rank0-of-1.json").read_text())
    r0, r1 = (json.loads((tmp_path / f"rank{k}-of-2.json").read_text()) for k in (0, 1))
    assert len(single["read"]) == 4 * 8
    assert len(r0["read"]) == len(r1["read"]) == 4 * 4  # each its half of every batch
    epoch = 3 * 4  # (24 samples: an epoch is 3 batches, each rank's 4 rows of each)
    assert len(set(r0["read"][:epoch] + r1["read"][:epoch])) == 24  # no sample twice
    assert sorted(r0["read"] + r1["read"]) == sorted(single["read"])
    np.testing.assert_allclose(r0["losses"], single["losses"], rtol=1e-5)
