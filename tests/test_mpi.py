"""Runs over MPI (`mpiexec -n 2 netdsl run FILE --distributed`): the same losses as one
process, checkpoints from rank 0 in the single-device layout, and peers that do not answer
turn into an error naming the rank instead of a hang. Skipped without mpi4py (the `mpi`
extra, which the test extra includes)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _signals import mpi_ranks, signal_after_steps

pytest.importorskip("mpi4py")

ROOT = Path(__file__).resolve().parent.parent
NET = str(ROOT / "examples" / "digits-cnn.net")
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which(
    "mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")


def netdsl(*args, ranks: int | None = None, env=None, timeout=300):
    cmd = [sys.executable, "-m", "netdsl_cli", "run", NET, *args]
    if ranks is not None:
        cmd = [MPIEXEC, "-n", str(ranks), *cmd, "--distributed"]
    e = dict(os.environ, **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e)


def losses(log: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def two_ranks(tmp_path: Path, script: str, *args: str, check: bool = True):
    """Run a Python script on two ranks (args after it); with `check`, it must exit 0."""
    path = tmp_path / "script.py"
    path.write_text(script)
    out = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(path), *args],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0 or not check, out.stderr
    return out


# a pipeline's micro-batches normalise with their own batchnorm statistics, so it is
# compared with the same split run in one process (bit for bit); data parallelism with
# synchronised batchnorm is the single-device step (to f32 rounding)
@pytest.mark.parametrize("split, rtol, same", [("pipeline", 0.0, ["--devices", "2",
                                                                  "--split", "pipeline"]),
                                               ("tensor", 0.0, ["--devices", "2",
                                                                "--split", "tensor"]),
                                               ("spatial", 0.0, ["--devices", "2",
                                                                 "--split", "spatial"]),
                                               ("data", 1e-5, [])])
def test_two_ranks_give_the_losses_of_one_process(tmp_path, split, rtol, same):
    """The same losses, and (bit for bit where the losses are) the same evaluation: rank 0
    evaluates the whole model joined from the ranks' parts (a tensor split's shards too,
    which failed over MPI and in one process: "returned 65536 bytes but the plan holds
    131072")."""
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    a = netdsl("--steps", "3", "--log", str(one), "--json", *same)
    b = netdsl("--steps", "3", "--log", str(two), "--split", split, "--json", ranks=2)
    assert a.returncode == 0, a.stdout + a.stderr
    assert b.returncode == 0, b.stdout + b.stderr
    s, d = json.loads(a.stdout), json.loads(b.stdout)  # rank 0 alone reports
    assert d["split"].startswith(split) and set(d["comm_bytes_per_step"]) == {"0"}
    np.testing.assert_allclose(losses(two), losses(one), rtol=rtol)
    assert d["test_accuracy"] is not None
    np.testing.assert_allclose(d["test_loss"], s["test_loss"], rtol=10 * rtol)
    if rtol == 0.0:
        assert d["test_accuracy"] == s["test_accuracy"]


def test_ranks_accumulating_micro_batches_give_the_plain_losses(tmp_path):
    """Each rank of a data split accumulates its rows in two parts (no batchnorm: the
    whole batch's step), and a --distributed run of one process is a clear error."""
    mlp = str(ROOT / "examples" / "digits-mlp.net")
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    cmd = [sys.executable, "-m", "netdsl_cli", "run", mlp, "--steps", "3",
           "--eval-samples", "0"]
    a = subprocess.run(cmd + ["--log", str(one)], capture_output=True, text=True,
                       timeout=300)
    b = subprocess.run([MPIEXEC, "-n", "2", *cmd, "--distributed", "--split", "data",
                        "--microbatches", "2", "--log", str(two), "--json"],
                       capture_output=True, text=True, timeout=300)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert json.loads(b.stdout)["split"] == "data=2, microbatches=2"
    np.testing.assert_allclose(losses(two), losses(one), rtol=1e-5)
    c = subprocess.run(cmd + ["--distributed"], capture_output=True, text=True, timeout=300)
    assert c.returncode == 1 and "Traceback" not in c.stderr, c.stderr
    assert "this is one process; run without --distributed" in c.stdout + c.stderr
    assert "stopping every rank" not in c.stderr


def test_ranks_accumulating_with_synchronised_batchnorm_give_one_devices_losses(tmp_path):
    """Two ranks each accumulating two micro-batches, batchnorm synchronised micro-batch
    by micro-batch: the losses of one process accumulating two micro-batches, in float64
    to rounding."""
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    common = ("--steps", "3", "--dtype", "f64", "--eval-samples", "0", "--microbatches", "2")
    a = netdsl(*common, "--log", str(one))
    b = netdsl(*common, "--split", "data", "--log", str(two), "--json", ranks=2)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert json.loads(b.stdout)["split"] == "data=2, microbatches=2"
    np.testing.assert_allclose(losses(two), losses(one), rtol=1e-12)


def test_clip_grad_norm_over_ranks_gives_the_losses_of_one_process(tmp_path):
    """clip_grad_norm over a pipeline's ranks: each rank's squared-norm part is
    all-reduced (a scalar over MPI) and both scale by one factor, bit for bit the losses
    of the same split in one process."""
    net = tmp_path / "clipped.net"
    net.write_text(Path(NET).read_text().replace("optimizer = adam(lr=3e-3)",
                                                 "optimizer = adam(lr=3e-3, clip_grad_norm=0.5)"))
    assert "clip_grad_norm=0.5" in net.read_text()  # (else both runs are unclipped)
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    cmd = [sys.executable, "-m", "netdsl_cli", "run", str(net), "--steps", "3",
           "--eval-samples", "0", "--split", "pipeline"]
    a = subprocess.run(cmd + ["--devices", "2", "--log", str(one)], capture_output=True,
                       text=True, timeout=300)
    b = subprocess.run([MPIEXEC, "-n", "2", *cmd, "--distributed", "--log", str(two)],
                       capture_output=True, text=True, timeout=300)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert losses(two) == losses(one)


def test_ranks_share_auto_and_choose_what_split_mpi_chooses():
    """`--distributed` with auto shares the candidates out among the ranks (each predicts
    and plans its share; choose.Share): the split they choose, and its plan per device,
    are those `netdsl split --mpi` chooses in one process (at 1.6 MB, each rank's inputs
    and objects counted, no split that computes one device's numbers fits unplanned: the
    data split is planned and chosen; the pipelines of micro-batches, which normalise
    batchnorm per micro-batch, rank after every exact split that fits)."""
    args = ("--mem", "1.6MB", "--json")
    ref = subprocess.run([sys.executable, "-m", "netdsl_cli", "split", NET, "--devices", "2",
                          "--profile", "cpu", "--interconnect", "shm", "--mpi", *args],
                         capture_output=True, text=True, timeout=300)
    out = netdsl("--steps", "1", "--eval-samples", "0", *args, ranks=2)
    assert ref.returncode == 0 and out.returncode == 0, ref.stderr + out.stderr
    split, run = json.loads(ref.stdout), json.loads(out.stdout)
    assert run["split"] == split["spec"] == "data=2"
    planned = {a["spec"] for a in split["alternatives"] if a["planned"]}
    assert planned == {"data=2"} and run["warnings"] == split["warnings"] == []
    assert run["memory_plan"]["per_device"] == split["memory_plan"]["per_device"]


@pytest.mark.parametrize("split", ["pipeline", "tensor"])
def test_checkpoint_from_two_ranks_resumes_in_one_process(tmp_path, split):
    """Rank 0 writes the whole state in the single-device layout, joined from the ranks'
    parts: resumed in one process it continues exactly as the checkpoint of the same split
    run in one process does. (A tensor split's checkpoint held rank 0's shards alone, half
    of each weight, and could not be resumed.)"""
    resumed = []
    for ranks, extra in ((2, []), (None, ["--devices", "2"])):
        ck = tmp_path / f"ck{ranks}"
        b = netdsl("--steps", "2", "--checkpoint", str(ck), "--eval-samples", "0", "--split",
                   split, *extra, ranks=ranks)
        assert b.returncode == 0, b.stderr
        r = netdsl("--steps", "4", "--checkpoint", str(ck), "--resume", "--json",
                   "--eval-samples", "0")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["resumed_from"] == 2
        resumed.append(json.loads(r.stdout)["final_loss"])
    assert resumed[0] == resumed[1]


def test_two_ranks_resume_a_tensor_split_as_one_process_does(tmp_path):
    """Each rank reads its shards of each entry from the checkpoint (read entry by entry)
    and continues as the same split resumed in one process does."""
    ck = tmp_path / "ck"
    b = netdsl("--steps", "2", "--checkpoint", str(ck), "--eval-samples", "0", "--split",
               "tensor", ranks=2)
    assert b.returncode == 0, b.stderr
    shutil.copytree(ck, tmp_path / "ck1")
    finals = []
    for ranks, where, extra in ((2, ck, []), (None, tmp_path / "ck1", ["--devices", "2"])):
        r = netdsl("--steps", "4", "--checkpoint", str(where), "--resume", "--json",
                   "--eval-samples", "0", "--split", "tensor", *extra, ranks=ranks)
        assert r.returncode == 0, r.stderr
        d = json.loads(r.stdout)
        assert d["resumed_from"] == 2
        finals.append(d["final_loss"])
    assert finals[0] == finals[1]


def test_a_peer_that_never_answers_is_an_error_naming_it():
    """One process (a singleton MPI world): a receive nobody sends times out."""
    from netdsl.backends import get_backend
    from netdsl.errors import CommError
    from netdsl.ir.graph import Node
    from netdsl.ir.types import TensorType
    from netdsl.runtime.mpi import MPIComm
    comm = MPIComm(get_backend("numpy"), timeout=0.3)
    n = Node("x.recv", "recv", (), TensorType((4,), "f32"), {"peer": 0, "tag": 7}, device=0)
    with pytest.raises(CommError, match="no answer from rank 0 in 0.3 s"):
        comm.recv(n, None, "float32")


def test_a_killed_rank_stops_the_others(tmp_path):
    """Rank 1 killed mid-run: mpiexec stops within 60 s with a non-zero exit, no hang."""
    import signal
    import time
    log = tmp_path / "marker-run.jsonl"
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "netdsl_cli", "run", NET, "--steps",
           "100000", "--eval-samples", "0", "--log", str(log), "--split", "data",
           "--distributed"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and log.read_text().count("\n") >= 2):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        ranks = subprocess.run(["pgrep", "-f", str(log)], capture_output=True,
                               text=True).stdout.split()
        ranks = [int(p) for p in ranks if int(p) != proc.pid]
        assert ranks, "no rank processes found"
        os.kill(max(ranks), signal.SIGKILL)
        start = time.monotonic()
        code = proc.wait(timeout=60)
        assert code != 0 and time.monotonic() - start < 60
    finally:
        if proc.poll() is None:
            proc.kill()


def test_rank_0_evaluates_on_the_gathered_state():
    """A pipeline holds half the parameters on each rank: rank 0 gathers them to evaluate,
    and gets the held-out accuracy of the same split in one process (bit for bit), and
    with one micro-batch the unsplit step's loss to float32 rounding (an unsplit CPU step
    runs batchnorm and its relu as one fused kernel, a split one as two, whose float32
    sums may round apart: they did on an AVX2-only machine)."""
    one = netdsl("--steps", "5", "--json")
    same = netdsl("--steps", "5", "--json", "--devices", "2", "--split", "pipeline",
                  "--microbatches", "1")
    two = netdsl("--steps", "5", "--json", "--split", "pipeline", "--microbatches", "1",
                 ranks=2)
    for r in (one, same, two):
        assert r.returncode == 0, r.stderr
    a, s, b = (json.loads(r.stdout) for r in (one, same, two))
    assert b["test_accuracy"] is not None
    assert (b["final_loss"], b["test_accuracy"]) == (s["final_loss"], s["test_accuracy"])
    np.testing.assert_allclose(b["final_loss"], a["final_loss"], rtol=1e-5)


FULL_DISK = """
import json, sys
from pathlib import Path
import netdsl
from netdsl.errors import NetdslError
from netdsl.runtime import checkpoint
from netdsl.runtime.mpi import world
from netdsl.runtime.options import RunOptions
from netdsl.runtime.trainer import Trainer

real, seen = checkpoint._write, {"headers": 0, "entries": 0}


def write(zf, name, value):  # rank 0's disk fills up in its second save
    if name == checkpoint.HEADER:
        seen["headers"] += 1
    elif seen["headers"] == 1:
        seen["entries"] += 1
        if seen["entries"] == 3:
            raise OSError(28, "No space left on device")
    real(zf, name, value)


checkpoint._write = write
net = netdsl.load(sys.argv[1])
out = Path(sys.argv[2])
try:
    Trainer(net.graph, net.train, RunOptions(
        steps=3, eval_samples=0, distributed=True, split="tensor",
        checkpoint=str(out / "ck"), checkpoint_every=1)).fit()
except NetdslError as e:  # (exit 0: a rank's non-zero exit would stop the other)
    (out / f"rank{world()[0]}.txt").write_text(e.message)
"""


def test_a_save_that_fails_on_rank_0_stops_every_rank_and_keeps_the_last(tmp_path):
    """Rank 0's disk fills up while it writes the second checkpoint: every rank stops with
    its reason (none waits for a gather that will not come), and the first checkpoint is
    there as it was, with no temporary file beside it."""
    two_ranks(tmp_path, FULL_DISK, NET, str(tmp_path))
    for r in (0, 1):
        said = (tmp_path / f"rank{r}.txt").read_text()
        assert "could not write the checkpoint" in said and "No space left" in said, said
        assert "before this save (if any) is unchanged" in said
    from netdsl.runtime import checkpoint
    arrays, header = checkpoint.load(tmp_path / "ck")
    assert header["step"] == 1 and len(arrays) == len(header["arrays"]) > 0
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["checkpoint.npz"]


REFUSE = """
import sys
from pathlib import Path

import netdsl
from netdsl.errors import NetdslError
from netdsl.runtime.mpi import MPIComm, world
from netdsl.runtime.options import RunOptions
from netdsl.runtime.trainer import Trainer

real = MPIComm.memory_totals
room = float(sys.argv[2])  # free memory: this many times one rank's step less its state


def totals(self, color, need, state, read_free):
    return real(self, color, need, state, lambda: int(room * (need - state)))


MPIComm.memory_totals = totals
net = netdsl.load(sys.argv[1])
said = Path(sys.argv[3]) / f"rank{world()[0]}.txt"  # (the ranks' prints would interleave)
try:
    # (a data split: both ranks need the same, so the room is the same multiple of each)
    Trainer(net.graph, net.train, RunOptions(steps=1, eval_samples=0, distributed=True,
                                             split="data"))
except NetdslError as e:  # (exit 0: a rank's non-zero exit would stop the other)
    said.write_text(e.message)
else:
    said.write_text("fits")
"""


@pytest.mark.parametrize("room, fits", [(1.5, False), (2.5, True)])
def test_ranks_on_one_machine_are_counted_together(tmp_path, room, fits):
    """Two ranks on this machine: room for one rank's step and a half is refused on both
    (each alone would fit), room for two and a half is not. The free memory is a
    stand-in; the split into the ranks that share it, the sums and the barrier are MPI's."""
    two_ranks(tmp_path, REFUSE, NET, str(room), str(tmp_path))
    lines = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    if fits:
        assert lines == ["fits", "fits"]
    else:
        assert all(line.startswith(
            "out of memory before the first step: the 2 ranks sharing this machine need "
            "about") for line in lines), lines


PEAKS = """
import json, sys
from pathlib import Path
import netdsl
from netdsl.memory.plan import process_reserves
from netdsl.runtime.mpi import world
from netdsl.runtime.options import RunOptions
from netdsl.runtime.trainer import Trainer
net = netdsl.load(sys.argv[1])
t = Trainer(net.graph, net.train, RunOptions(steps=3, eval_samples=0, distributed=True,
                                             split=sys.argv[2], batch=int(sys.argv[4])))
r = t.fit()
rank = world()[0]
(Path(sys.argv[3]) / f"rank{rank}.json").write_text(json.dumps(
    {"planned": t.planned_peak_bytes(), "measured": r.peak_bytes,
     "counted": t.executor.peak_bytes, "reserve": process_reserves(t.full_graph)[rank]}))
"""


@pytest.mark.parametrize("split", ["tensor", "spatial", "data", "pipeline"])
def test_each_rank_stays_within_its_planned_peak(tmp_path, split):
    """Each rank's peak as tracemalloc measures it (not the executor's count) is within its
    storage plan's and what its process is reserved besides (`plan.process_reserves`: its
    inputs and interpreter objects; measured 0.15-0.25 MB above the plans of a pipeline's
    ranks here, with 0.34-0.42 MB reserved; 0.18-0.51 MB while a message was held twice,
    varying from run to run), and the executor's count is the plan's. The
    collectives' results used to be held to the end of the step, as outputs, and by the
    trainer into the next: the ranks measured 1.11x (data), 1.19x (spatial) and 1.55x
    (tensor) their plans here."""
    two_ranks(tmp_path, PEAKS, str(ROOT / "examples" / "resnet20-cifar.net"), split,
              str(tmp_path), "8")
    for r in (0, 1):
        d = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert d["measured"] <= d["planned"] + d["reserve"], (r, d)
        # the executor's count is its plan's (rank 1 counted its inputs as another device's
        # and summed the two devices' peaks: 196,608 B over its plan with spatial=2)
        assert d["counted"] == d["planned"], (r, d)


EVAL_ROOM = """
import json, sys
from pathlib import Path
import netdsl
import netdsl.step.room as room
from netdsl.runtime.mpi import world
from netdsl.runtime.options import RunOptions
from netdsl.runtime.trainer import Trainer
net = netdsl.load(sys.argv[1])
t = Trainer(net.graph, net.train, RunOptions(steps=2, distributed=True))
room.available_bytes = lambda backend: 1000  # (after the step's own check)
r = t.fit()
(Path(sys.argv[2]) / f"rank{world()[0]}.json").write_text(json.dumps(
    {"warnings": r.warnings, "test_accuracy": r.test_accuracy, "steps": r.steps}))
"""


def test_no_room_for_the_gathered_evaluation_skips_it_with_a_warning(tmp_path):
    """Rank 0 evaluates the whole model, gathered from every rank; where that cannot fit
    in what is free, the run skips the evaluation and says why instead of being killed
    after its training (resnet2504 on two ranks here). The free memory is a stand-in."""
    two_ranks(tmp_path, EVAL_ROOM, NET, str(tmp_path))
    d = json.loads((tmp_path / "rank0.json").read_text())
    assert d["steps"] == 2 and d["test_accuracy"] is None
    assert any(w.startswith("evaluation skipped: it runs the whole model, joined from "
                            "every rank") for w in d["warnings"]), d["warnings"]


GPUS = """
import json, sys
from pathlib import Path
from netdsl.runtime.mpi import world
from netdsl.runtime.options import RunOptions, gpu_of
picks = [gpu_of(RunOptions(distributed=True, backend="cupy")),
         gpu_of(RunOptions(distributed=True, backend="cupy", device=1)),
         gpu_of(RunOptions(distributed=True)), gpu_of(RunOptions(backend="cupy"))]
(Path(sys.argv[1]) / f"rank{world()[0]}.json").write_text(json.dumps(picks))
"""


def test_each_rank_on_a_machine_takes_its_own_gpu(tmp_path):
    """Two ranks on one machine: GPU 0 and GPU 1 (both took GPU 0), unless --device puts
    them on one; the NumPy backend and a single process keep device 0."""
    two_ranks(tmp_path, GPUS, str(tmp_path))
    picks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert picks == [[0, 1, 0, 0], [1, 1, 0, 0]]


@pytest.mark.parametrize("to", ["mpiexec", "one rank"])
def test_ctrl_c_stops_every_rank_after_the_same_step_and_saves(tmp_path, to):
    """mpiexec passes Ctrl-C to every rank; they agree after each step on whether any rank
    was told to stop (rank 0 alone reading it would leave the other waiting in the next
    step's collective; told alone, one rank stops them all), save the checkpoint of that
    step and exit 130. The agreement wrote its result over the rank's own flag, which lost
    a signal that came while a rank waited in it: the ranks trained on, and this test
    timed out 1 run in about 25 (1 in 10 beside a busy core; 0 in 60 now)."""
    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "netdsl_cli", "run", NET,
           "--distributed", "--split", "data", "--steps", "1000000", "--checkpoint",
           str(ck), "--log", str(log), "--json"]
    rc, out, err = signal_after_steps(
        cmd, log, signal.SIGINT, to=None if to == "mpiexec" else lambda pid: mpi_ranks(pid)[:1])
    assert rc == 130, (out, err)
    d = json.loads(out[out.index("{"):])  # (after mpiexec's own words about the Ctrl-C)
    assert d["interrupted"] == "SIGINT" and "failed" not in err
    assert json.loads(log.read_text().splitlines()[-1])["step"] == d["steps"]
    from netdsl.runtime import checkpoint
    assert checkpoint.load(ck)[1]["step"] == d["steps"]


LATE_SIGNAL = """
import json, os, signal, sys
from pathlib import Path
import netdsl
from netdsl.runtime.mpi import world
from netdsl.runtime.options import RunOptions
from netdsl.runtime.trainer import Callback, Trainer

rank = world()[0]


class SignalAt(Callback):
    def on_step(self, record):
        if record["step"] == 3:
            os.kill(os.getpid(), signal.SIGINT)


real_save = Trainer.save


def late_save(self):  # mpiexec's Ctrl-C reaching this rank after the ranks agreed to stop
    os.kill(os.getpid(), signal.SIGINT)
    real_save(self)


if rank == 1:
    Trainer.save = late_save
net = netdsl.load(sys.argv[1])
r = Trainer(net.graph, net.train, RunOptions(steps=100, eval_samples=0, distributed=True,
                                             split="data", checkpoint=sys.argv[2]),
            SignalAt() if rank == 0 else None).fit()
Path(sys.argv[3], f"rank{rank}.json").write_text(json.dumps([r.steps, r.interrupted]))
"""


def test_a_signal_that_reaches_a_rank_after_the_ranks_agreed_to_stop(tmp_path):
    """mpiexec passes Ctrl-C to the ranks one after another: a rank can get it after the
    ranks agreed (on another rank's signal) to stop, while it saves. It is the first signal
    this rank got, so it lets the save finish, as a first signal lets a step finish; it
    stopped the rank at once, mid-save, and the other waited for it without end."""
    path = tmp_path / "script.py"
    path.write_text(LATE_SIGNAL)
    out = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(path), NET,
                          str(tmp_path / "ck"), str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    for r in (0, 1):
        assert json.loads((tmp_path / f"rank{r}.json").read_text()) == [3, "SIGINT"]
    from netdsl.runtime import checkpoint
    assert checkpoint.load(tmp_path / "ck")[1]["step"] == 3


RANK_1_FAILS = """
import sys
import netdsl.runtime.trainer as trainer
from netdsl.errors import NetdslError
from netdsl.runtime.mpi import world
from netdsl_cli.app import main

real = trainer.Trainer.__init__


def init(self, *a, **k):
    if world()[0] == 1:
        raise NetdslError("rank 1 cannot go on: its own reason")
    real(self, *a, **k)


trainer.Trainer.__init__ = init
main(["run", sys.argv[1], "--distributed", "--steps", "1"])
"""


def test_a_failing_rank_other_than_0_says_why(tmp_path):
    """Ranks other than 0 keep quiet; when one fails, its reason reaches the user (only
    "rank 1 failed" did), and every rank stops."""
    out = two_ranks(tmp_path, RANK_1_FAILS, NET, check=False)
    assert out.returncode != 0
    assert "netdsl: rank 1: rank 1 cannot go on: its own reason" in out.stderr, out.stderr
    assert "netdsl: rank 1 failed; stopping every rank" in out.stderr


def test_ranks_plan_the_split_into_mem_and_stay_within_it(tmp_path):
    """`--distributed --mem`: every rank plans the chosen split per device with its sends
    held as MPI holds them (to a receive that proves the peer has them) and room for what
    its process holds besides its plan (its inputs, its interpreter objects): the loss of
    the in-process run (planned into less, as one process needs: recomputing changes no
    figure); each rank's count is its plan's; rank 0's peak as tracemalloc measures it
    within the budget (before the room was reserved, 600 kB planned over MPI measured
    519-586 kB quiet and 651 kB beside a CI run)."""
    args = ("--steps", "2", "--split", "pipeline", "--eval-samples", "0", "--json")
    a = netdsl(*args, "--mem", "600KB", "--devices", "2")
    b = netdsl(*args, "--mem", "820KB", ranks=2)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    one, two = json.loads(a.stdout), json.loads(b.stdout)
    assert two["final_loss"] == one["final_loss"]
    per = two["memory_plan"]["per_device"]
    assert all(d["recompute"] > 0 and d["outside_plan_bytes"] > 0 for d in per.values())
    assert all(d["peak_bytes"] + d["outside_plan_bytes"] <= 820_000 for d in per.values())
    assert two["counted_peak_bytes"] == two["planned_peak_bytes"] == per["0"]["peak_bytes"]
    assert two["peak_bytes"] <= two["budget_bytes"] == 820_000


DIFFERENT_STEPS = """
import sys
from pathlib import Path
import netdsl
from netdsl.errors import NetdslError
from netdsl.runtime.mpi import world
from netdsl.runtime.options import RunOptions
from netdsl.runtime.trainer import Trainer
rank = world()[0]
net = netdsl.load(sys.argv[1])
said = []
for options, text in (({"microbatches": 2 + 2 * rank}, None),  # another split
                      # auto over other candidates (rank 1: pipelines of 2 micro-batches
                      # only, rank 0's choice among all): each chooses alone, the same split
                      ({"split": "auto", "microbatches": 2 if rank else None}, None),
                      # one candidate on rank 0, auto's on rank 1: every rank still takes
                      # part in the exchange that decides whether they share
                      ({"split": "pipeline" if rank == 0 else "auto"}, None),
                      ({}, rank == 1)):  # another network on rank 1
    if text:
        src = Path(sys.argv[1]).read_text().replace("conv2d(x, 16", "conv2d(x, 8")
        net = netdsl.loads(src, file=sys.argv[1])
    try:
        Trainer(net.graph, net.train, RunOptions(steps=1, distributed=True,
                                                 **{"split": "pipeline", **options}))
        said.append("built")
    except NetdslError as e:
        said.append(e.message)
(Path(sys.argv[2]) / f"rank{rank}.txt").write_text("\\n".join(said))
"""


def test_ranks_that_built_different_steps_stop_with_the_reason(tmp_path):
    """Each rank builds the step from its own files and options; ranks that disagree would
    hang or mix values, so they compare digests first and all stop, rank 0 saying which
    built what."""
    assert "conv2d(x, 16" in Path(NET).read_text()
    two_ranks(tmp_path, DIFFERENT_STEPS, NET, str(tmp_path))
    split, auto, one, network = (tmp_path / "rank0.txt").read_text().split("\n")
    assert auto == "built"  # (ranks that would share different candidates choose alone)
    assert one.startswith("the ranks built different training steps (rank 0 chose "
                          "pipeline=2"), one
    assert split.startswith("the ranks built different training steps (rank 0 chose "
                            "pipeline=2, microbatches=2; rank 1 chose pipeline=2, "
                            "microbatches=4), which cannot run together"), split
    assert "rank 0 built step" in network and "rank 1 built step" in network
    assert network.endswith("(--split and --microbatches fix the split)")
    differ = "the ranks built different training steps (rank 0 says which)"
    assert (tmp_path / "rank1.txt").read_text() == "\n".join([differ, "built", differ,
                                                                differ])


def test_a_failure_of_every_rank_is_reported_by_rank_0(tmp_path):
    """A budget no split meets fails on every rank: rank 0 reports it as one process does
    (--json: the error on stdout), the others wait for it instead of racing it to stop
    the run (rank 1 often won, and --json printed nothing)."""
    out = netdsl("--split", "tensor", "--mem", "600KB", "--steps", "1", "--json", ranks=2)
    assert out.returncode == 3, out.stderr
    msg = json.loads(out.stdout)["errors"][0]["message"]
    assert msg.startswith("no split onto 2 device(s) fits 600.00 kB per device"), msg
    assert "rank 1" not in out.stderr, out.stderr
