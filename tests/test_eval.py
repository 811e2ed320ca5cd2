"""`netdsl eval`: a checkpoint's loss and accuracy on held-out data, in evaluation mode,
equal to what the run that wrote it reported; the weights `netdsl import` writes; the
checkpoint read at another dtype; bad inputs as one-paragraph errors."""
from __future__ import annotations

import json

import numpy as np
import pytest
from _examples import ROOT
from typer.testing import CliRunner

from netdsl_cli.app import app

runner = CliRunner()
CNN = str(ROOT / "examples" / "digits-cnn.net")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """digits-cnn trained 30 steps in float64, its checkpoint and the run's summary."""
    d = tmp_path_factory.mktemp("eval")
    r = runner.invoke(app, ["run", CNN, "--steps", "30", "--dtype", "f64", "--checkpoint",
                            str(d / "ck"), "--json"])
    assert r.exit_code == 0, r.output
    return d / "ck", json.loads(r.stdout)


def evaluate(*args):
    r = runner.invoke(app, ["eval", *args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_eval_gives_what_the_run_reported(trained):
    ck, run = trained
    out = evaluate(CNN, "--checkpoint", str(ck), "--dtype", "f64")
    assert out["step"] == 30 and out["split"] == "test" and out["samples"] == 359
    assert out["loss"] == run["test_loss"] and out["accuracy"] == run["test_accuracy"]
    # another batch size: the same samples, the mean over them
    other = evaluate(CNN, "--checkpoint", str(ck), "--dtype", "f64", "--batch", "50")
    assert other["loss"] == pytest.approx(run["test_loss"], rel=1e-12)
    assert other["accuracy"] == run["test_accuracy"]
    # float64 state read at float32
    f32 = evaluate(CNN, "--checkpoint", str(ck / "checkpoint.npz"))
    assert f32["dtype"] == "f32" and f32["loss"] == pytest.approx(run["test_loss"], rel=1e-5)
    train = evaluate(CNN, "--checkpoint", str(ck), "--data", "train", "--samples", "100")
    assert train["split"] == "train" and train["samples"] == 100
    assert 0.0 <= train["accuracy"] <= 1.0 and np.isfinite(train["loss"])


def test_human_output(trained):
    ck, _ = trained
    r = runner.invoke(app, ["eval", CNN, "--checkpoint", str(ck), "--samples", "64"])
    assert r.exit_code == 0, r.output
    assert "digits_cnn at step 30" in r.stdout and "test loss" in r.stdout
    assert "over 64 samples" in r.stdout


@pytest.mark.parametrize("args,phrase", [
    (["--checkpoint", "no-such-dir"], "no checkpoint at no-such-dir: it does not exist"),
    (["--data", "val"], "--data must be test or train, not 'val'"),
    (["--dtype", "f16"], "--dtype must be f32 or f64"),
])
def test_bad_inputs_exit_1_in_words(trained, args, phrase):
    ck, _ = trained
    r = runner.invoke(app, ["eval", CNN, "--checkpoint", str(ck), *args])
    assert r.exit_code == 1, r.output
    assert phrase in r.output and "Traceback" not in r.output


def test_a_checkpoint_of_another_network_or_corrupt(trained, tmp_path):
    ck, _ = trained
    r = runner.invoke(app, ["eval", str(ROOT / "examples" / "digits-mlp.net"),
                            "--checkpoint", str(ck)])
    assert r.exit_code == 1 and "belongs to network `digits_cnn`, not `digits_mlp`" in r.output
    bad = tmp_path / "checkpoint.npz"
    bad.write_bytes((ck / "checkpoint.npz").read_bytes()[:1000])
    r = runner.invoke(app, ["eval", CNN, "--checkpoint", str(tmp_path)])
    assert r.exit_code == 1 and "corrupt or truncated" in r.output, r.output
