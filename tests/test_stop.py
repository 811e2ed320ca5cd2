"""Stopping a run with a signal (runtime/stop.py): the first SIGINT or SIGTERM stops the
run after the step it is in, saves the checkpoint and reports (exit 130 from the command
line); a second stops at once, the last checkpoint kept. Over MPI every rank stops after
the same step (tests/test_mpi.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _signals import signal_after_steps

import netdsl
from netdsl.runtime import checkpoint
from netdsl.runtime.options import RunOptions
from netdsl.runtime.trainer import Callback, Trainer

ROOT = Path(__file__).resolve().parents[1]

NET = ROOT / "examples" / "digits-mlp.net"


def _net():
    return netdsl.load(NET)


class SignalAt(Callback):
    """Sends this process `times` signals during step `step`'s report."""

    def __init__(self, step: int, sig: int, times: int = 1):
        self.step, self.sig, self.times = step, sig, times

    def on_step(self, record):
        if record["step"] == self.step:
            for _ in range(self.times):
                os.kill(os.getpid(), self.sig)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_after_the_step_and_saves(tmp_path, sig):
    before = signal.getsignal(sig)
    net = _net()
    ck = tmp_path / "ck"
    r = Trainer(net.graph, net.train, RunOptions(steps=10, checkpoint=str(ck),
                                                 checkpoint_every=2), SignalAt(3, sig)).fit()
    assert r.interrupted == sig.name and r.steps == 3 and len(r.losses) == 3
    assert r.test_accuracy is None  # no evaluation on the way out
    assert f"stopped by {sig.name} after step 3 of 10" in r.note and str(ck) in r.note
    assert checkpoint.load(ck)[1]["step"] == 3
    assert signal.getsignal(sig) is before  # the handlers are put back


def test_the_same_run_without_a_signal_is_untouched():
    net = _net()
    r = Trainer(net.graph, net.train, RunOptions(steps=10, eval_samples=0)).fit()
    assert r.interrupted is None and r.note is None and r.steps == 10


def test_a_second_signal_stops_at_once_and_keeps_the_last_checkpoint(tmp_path):
    net, before = _net(), signal.getsignal(signal.SIGINT)
    ck = tmp_path / "ck"
    with pytest.raises(KeyboardInterrupt):
        Trainer(net.graph, net.train, RunOptions(steps=10, checkpoint=str(ck),
                                                 checkpoint_every=2),
                SignalAt(3, signal.SIGINT, times=2)).fit()
    assert checkpoint.load(ck)[1]["step"] == 2
    assert signal.getsignal(signal.SIGINT) is before


def test_the_command_stops_saves_reports_and_exits_130(tmp_path):
    """SIGTERM (a scheduler pre-empting the job) to `netdsl run`: exit 130, the JSON says
    so, the checkpoint and the log end at the same step, and --resume goes on from it."""
    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    cmd = [sys.executable, "-m", "netdsl_cli", "run", str(NET), "--steps", "1000000",
           "--checkpoint", str(ck), "--log", str(log), "--json"]
    rc, out, err = signal_after_steps(cmd, log, signal.SIGTERM)
    assert rc == 130, err
    d = json.loads(out)
    steps = d["steps"]
    assert d["interrupted"] == "SIGTERM" and "Traceback" not in err
    assert json.loads(log.read_text().splitlines()[-1])["step"] == steps
    assert checkpoint.load(ck)[1]["step"] == steps
    r = subprocess.run([*cmd[:5], "--steps", str(steps + 2), "--checkpoint", str(ck),
                        "--resume", "--json", "--eval-samples", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["resumed_from"] == steps
