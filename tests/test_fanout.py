"""Worker processes that share auto's candidates with the calling process (`--jobs`,
netdsl.parallel.fanout): the same choice and step as one process alone, a share of the
work in each process, and a clear error when a worker fails or dies."""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from netdsl import api
from netdsl.errors import NetdslError, SplitError
from netdsl.ir.serialize import fingerprint
from netdsl.memory.profiles import get_profile
from netdsl.parallel import choose as choose_mod
from netdsl.parallel import fanout
from netdsl.parallel.predict import get_interconnect
from netdsl_cli.app import app

HERE = Path(__file__).parent
EXAMPLES = HERE.parent / "examples"
runner = CliRunner()


def _figures(chosen) -> list:
    return [(c.spec, c.fits, c.report.predicted_step_s, c.memory is not None,
             None if c.memory is None else c.memory.per_device) for c in chosen.considered]


@pytest.fixture(scope="module")
def digits():
    net = api.load(EXAMPLES / "digits-cnn.net")
    kw = dict(batch=32, strategy="auto", devices=4, optimizer=net.train.optimizer.model_dump(),
              profile=get_profile("cpu"), link=get_interconnect("shm"))
    return net, kw


@pytest.mark.parametrize("planned", [False, True])
def test_workers_choose_what_one_process_chooses(digits, monkeypatch, planned):
    """Two processes (this one and a worker) make the choice, the figures and the step
    (its fingerprint) that this process makes alone, and this one builds only its share
    of the candidates (the worker is another process: its builds are not counted)."""
    net, kw = digits
    if planned:  # a budget none of the candidates fits unplanned: each is planned
        plain = choose_mod.choose(net.graph, jobs=1, **kw)
        every = plain.considered + [  # (and the pipelines it did not build, which hold less)
            choose_mod.choose(net.graph, jobs=1, **dict(
                kw, strategy="pipeline", microbatches=spec.microbatches,
                schedule=spec.schedule)).best
            for spec in plain.skipped]
        kw = dict(kw, plan=True, mem=int(0.95 * min(
            max(d.peak_bytes for d in c.report.per_device) for c in every)))
    built: list = []
    split_step = choose_mod.split_step

    def counted(fwd, batch, spec, *a, **k):
        built.append(spec)
        return split_step(fwd, batch, spec, *a, **k)

    monkeypatch.setattr(choose_mod, "split_step", counted)
    alone = choose_mod.choose(net.graph, jobs=1, **kw)
    built_alone, built[:] = list(built), []
    # the worker sends the step it chose rather than this process building it again
    monkeypatch.setattr(choose_mod, "_rebuild", lambda *a: pytest.fail("built again"))
    shared = choose_mod.choose(net.graph, jobs=2, **kw)
    assert shared.best.spec == alone.best.spec
    assert _figures(shared) == _figures(alone)
    assert fingerprint(shared.best.graph) == fingerprint(alone.best.graph)
    assert shared.skipped == alone.skipped
    if planned:
        assert alone.best.memory is not None
    # this process built the single-device step and its share of the candidates (and
    # of the counts built ahead; with a plan, the ones it planned): not every one, and
    # fewer than alone
    considered = {c.spec for c in alone.considered}
    assert {s for s in built_alone if s.devices > 1} == considered
    assert built[0].devices == 1 and not considered <= set(built[1:])
    assert set(built[1:]) <= considered | set(alone.skipped)
    assert len(built) < len(built_alone)


def test_split_jobs_prints_what_one_process_prints():
    """With more processes than a round's candidates, the idle ones build the next
    micro-batch counts ahead (three here: 16 micro-batches, which one process skips);
    what is printed is still what one process prints."""
    args = ["split", str(EXAMPLES / "digits-cnn.net"), "--devices", "4", "--batch", "32",
            "--profile", "cpu", "--interconnect", "shm", "--json"]
    one = runner.invoke(app, args + ["--jobs", "1"])
    assert one.exit_code == 0, one.output
    a = json.loads(one.output)
    assert len(a["alternatives"]) >= 6 and "pipeline=4, microbatches=16, 1f1b" in a["skipped"]
    for jobs in ("2", "3"):
        more = runner.invoke(app, args + ["--jobs", jobs])
        assert more.exit_code == 0, more.output
        assert json.loads(more.output) == a


def test_default_jobs_start_workers_only_for_big_candidates(monkeypatch):
    from netdsl.backends import host_memory
    monkeypatch.setattr(fanout, "cores", lambda: 16)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: None)
    assert choose_mod._jobs(None, 13, 24) == 1  # digits-cnn: not worth a worker's start
    assert choose_mod._jobs(None, 13, 1372) == choose_mod.MAX_AUTO_JOBS
    assert choose_mod._jobs(None, 3, 1372) == 3  # no more processes than candidates
    assert choose_mod._jobs(4, 13, 24) == 4  # asked for
    monkeypatch.setattr(fanout, "cores", lambda: 1)
    assert choose_mod._jobs(None, 13, 1372) == 1
    with pytest.raises(SplitError, match="--jobs must be at least 1"):
        choose_mod._jobs(0, 13, 24)


def test_default_jobs_are_no_more_than_the_free_memory_holds(monkeypatch):
    """Each process building candidates holds up to about 5 kB a forward node for each
    copy of the network in the largest (resnet2504's 20,895 nodes, 16 micro-batches:
    1.8 GB); the default starts no more than the free host memory holds, the caller
    included; --jobs is taken as asked."""
    from netdsl.backends import host_memory
    monkeypatch.setattr(fanout, "cores", lambda: 16)
    each = choose_mod._process_bytes(20895, 16)
    assert 1.7e9 < each < 1.9e9
    for free, jobs in ((100 * each, choose_mod.MAX_AUTO_JOBS), (3.5 * each, 3), (each, 1),
                       (each // 2, 1)):
        monkeypatch.setattr(host_memory, "available_bytes", lambda f=free: int(f))
        assert choose_mod._jobs(None, 10, 20895, 16) == jobs, free
    assert choose_mod._jobs(4, 10, 20895, 16) == 4
    specs = choose_mod.candidates(None, 4, 16, None, {}, "sync", None, True)
    assert max(map(choose_mod._copies, specs)) == 16  # pipeline=4, 16 micro-batches


def test_a_graph_travels_to_a_worker_whole():
    g = api.load(EXAMPLES / "resnet20-cifar.net").graph
    h = pickle.loads(pickle.dumps(g))
    assert h.to_text() == g.to_text() and h.outputs == g.outputs and h.meta == g.meta
    n = h.nodes[3]
    assert h[n.name] is n
    h.nodes = h.nodes[:3]  # the unpickled list still tracks its graph: the index follows
    assert n.name not in h


# -- workers that fail (targets importable by the worker: this directory on its path) ----

def _echo(ex, value):
    got = ex.allgather((ex.rank, value))
    ex.allgather(len(got))
    ex.gather(ex.rank * 10)


def _raise_netdsl(ex):
    raise SplitError("the worker's own message")


def _raise_bug(ex):
    raise ZeroDivisionError("a bug in a worker")


def _sleep(ex, pidfile):
    Path(pidfile).write_text(str(os.getpid()))
    while True:
        time.sleep(0.1)


def _die(ex):
    print("about to die")
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture
def on_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(HERE))


def test_ranks_exchange_in_rank_order(on_path):
    with fanout.workers(3, "test_fanout:_echo", {"value": "v"}) as ex:
        assert (ex.rank, ex.size) == (0, 3)
        assert ex.allgather((0, "v")) == [(0, "v"), (1, "v"), (2, "v")]
        assert ex.allgather(3) == [3, 3, 3]
        assert ex.gather(0) == [0, 10, 20]


def test_a_workers_error_is_raised_in_the_caller(on_path):
    with pytest.raises(SplitError, match="the worker's own message") as e:
        with fanout.workers(2, "test_fanout:_raise_netdsl", {}) as ex:
            ex.allgather(None)
    assert e.value.exit_code == 3
    with pytest.raises(RuntimeError, match="(?s)worker process 1 failed.*ZeroDivisionError"):
        with fanout.workers(2, "test_fanout:_raise_bug", {}) as ex:
            ex.allgather(None)


def test_a_worker_that_dies_is_named_with_how(on_path):
    with pytest.raises(NetdslError) as e:
        with fanout.workers(2, "test_fanout:_die", {}) as ex:
            ex.allgather(None)
    msg = str(e.value)
    assert "worker process 1" in msg and "killed by signal 9" in msg
    assert "--jobs 1" in msg and "about to die" in msg


CALLER = """
import sys, time
from netdsl.parallel import fanout
with fanout.workers(2, "test_fanout:_sleep", {"pidfile": sys.argv[1]}):
    time.sleep(60)
"""


def test_workers_exit_when_the_caller_is_killed(on_path, tmp_path):
    """A caller killed outright runs no `finally`: its workers notice and exit (before,
    one went on building its candidate until its next exchange)."""
    pidfile = tmp_path / "worker.pid"
    caller = subprocess.Popen([sys.executable, "-c", CALLER, str(pidfile)])
    try:
        for _ in range(300):
            if pidfile.exists() and pidfile.read_text():
                break
            time.sleep(0.1)
        pid = int(pidfile.read_text())
    finally:
        caller.kill()
        caller.wait()
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    pytest.fail("the worker outlived its caller by 5 s")
