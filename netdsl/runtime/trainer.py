"""The training loop: data -> training-step graph -> executor, with logs and checkpoints.

The training step is one graph: the forward graph bound to the batch, `autodiff`, then
`add_optimizer`. The trainer feeds it batches and the scheduled learning rate, evaluates
the forward graph (BatchNorm in eval mode) on held-out data on the same state, writes one
JSON line per step, and saves checkpoints that resume exactly: parameters, buffers,
optimizer state, step and loader position are all in the checkpoint, and the dropout RNG
is re-seeded from (seed, step) every step, so N steps + resume + N steps == 2N steps.

Reporting goes through a `callback` object (the CLI draws a progress bar with it); this
layer prints nothing.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from netdsl.backends import get_backend
from netdsl.config import TrainConfig
from netdsl.errors import NetdslError
from netdsl.ir.graph import Graph
from netdsl.ir.stats import summarize
from netdsl.memory.plan import make_plan
from netdsl.passes.pipeline import run_pipeline
from netdsl.runtime import checkpoint
from netdsl.runtime.data import Loader, batches, loss_labels, make_dataset
from netdsl.runtime.executor import Executor
from netdsl.runtime.schedule import lr_at


@dataclass
class RunOptions:
    """Command-line overrides; None keeps the file's `train` section (or its default)."""

    steps: int | None = None
    epochs: int | None = None
    batch: int | None = None
    lr: float | None = None
    seed: int | None = None
    backend: str = "numpy"
    device: int = 0
    dtype: str = "f32"
    log: str | None = None
    checkpoint: str | None = None
    checkpoint_every: int | None = None
    resume: bool = False
    eval_every: int | None = None
    check_numerics: bool = False


@dataclass
class RunResult:
    network: str
    steps: int
    final_loss: float
    images_per_s: float
    peak_bytes: int
    params: int
    backend: str
    device: str
    batch: int
    expected_bytes: int
    step_time_s: float
    test_accuracy: float | None = None
    test_loss: float | None = None
    train_accuracy: float | None = None
    resumed_from: int | None = None
    losses: list[float] = field(default_factory=list)

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d.pop("losses")
        return d


class Callback:
    """Hooks for progress display; every method is optional."""

    def on_start(self, info: dict) -> None: ...
    def on_step(self, record: dict) -> None: ...
    def on_eval(self, record: dict) -> None: ...
    def on_end(self, result: RunResult) -> None: ...


def resolve_config(cfg: TrainConfig | None, opts: RunOptions) -> TrainConfig:
    cfg = cfg or TrainConfig()
    update: dict[str, Any] = {}
    for k in ("batch", "seed", "eval_every"):
        if getattr(opts, k) is not None:
            update[k] = getattr(opts, k)
    if opts.steps is not None:
        update.update(steps=opts.steps, epochs=None)
    elif opts.epochs is not None:
        update.update(epochs=opts.epochs, steps=None)
    if opts.lr is not None:
        update["optimizer"] = cfg.optimizer.model_copy(update={"lr": opts.lr})
    out = cfg.model_copy(update=update)
    # re-validate: model_copy does not run validators
    return TrainConfig.model_validate(out.model_dump())


def training_graph(forward: Graph, cfg: TrainConfig) -> Graph:
    if "loss" not in forward.outputs:
        raise NetdslError(f"network `{forward.name}` declares no `loss`, so it cannot be "
                          "trained; add e.g. `loss softmax_cross_entropy(logits, y)`")
    opt = cfg.optimizer.model_dump()
    kind = opt.pop("kind")
    return run_pipeline(forward, ["autodiff", ("optimizer", {"kind": kind, **opt})])


class Trainer:
    ROLES = ("loss", "output", "updates")  # what a training step computes
    def __init__(self, forward: Graph, cfg: TrainConfig | None, opts: RunOptions,
                 callback: Callback | None = None):
        self.opts = opts
        self.cfg = resolve_config(cfg, opts)
        self.cb = callback or Callback()
        self.forward = forward
        self.data = make_dataset(forward, self.cfg.data, self.cfg.seed)
        self.batch = self.cfg.batch
        self.loader = Loader(self.data.train, self.batch, self.cfg.seed)
        if self.cfg.steps is not None:
            self.total = self.cfg.steps
        elif self.cfg.epochs is not None:
            self.total = self.cfg.epochs * self.loader.batches_per_epoch
        else:
            self.total = self.loader.batches_per_epoch  # one epoch
        bound = forward.bind(self.batch)
        self.train_graph = training_graph(bound, self.cfg).verify()
        self.executor = Executor(self.train_graph, get_backend(opts.backend, opts.device),
                                 opts.dtype, self.cfg.seed, opts.check_numerics)
        self._eval_execs = {self.batch: self.executor.with_graph(bound)}
        self.stats = summarize(bound)
        self.acc = loss_labels(forward)
        self.step = 0
        self.resumed_from = None

    # -- state ---------------------------------------------------------------------------
    def _state_spec(self) -> dict[str, tuple]:
        sd = self.executor.state
        return {k: (tuple(v.shape), str(v.dtype)) for k, v in sd.items()}

    def save(self) -> Path:
        header = {"network": self.forward.name, "step": self.step,
                  "loader": self.loader.state(), "seed": self.cfg.seed,
                  "config": json.loads(self.cfg.model_dump_json())}
        return checkpoint.save(self.opts.checkpoint, self.executor.state_dict(), header)

    def restore(self) -> None:
        arrays, header = checkpoint.load(self.opts.checkpoint)
        where = str(checkpoint.path_in(self.opts.checkpoint))
        if header.get("kind") == "weights":
            # initial weights (`netdsl import`): parameters and buffers only; training
            # starts at step 0 with fresh optimizer state, at this run's dtype
            spec = {k: (s, header["arrays"].get(k, [None, d])[1])
                    for k, (s, d) in self._state_spec().items() if k in self.forward}
            checkpoint.check_compatible(where, header, self.forward.name, spec)
            self.executor.load_state_dict(arrays, strict=False)
            return
        checkpoint.check_compatible(where, header, self.forward.name, self._state_spec())
        self.executor.load_state_dict(arrays)
        self.step = int(header["step"])
        self.loader.restore(header["loader"])
        self.resumed_from = self.step

    # -- loop ----------------------------------------------------------------------------
    def feeds(self, arrays) -> dict:
        return dict(zip(self.data.input_names, arrays))

    def evaluate(self) -> dict:
        if self.data.test is None or len(self.data.test) == 0:
            return {}
        losses, correct, seen = [], 0, 0
        roles = tuple(r for r in ("output", "loss") if r in self.forward.outputs)
        be = self.executor.backend
        for arrays in batches(self.data.test, self.batch):
            n = len(arrays[0])
            if n not in self._eval_execs:  # the last, partial batch gets its own binding
                self._eval_execs[n] = self.executor.with_graph(self.forward.bind(n))
            out = self._eval_execs[n].run(self.feeds(arrays), training=False, roles=roles)
            if "loss" in out:
                losses.append((float(be.to_host(out["loss"][0])), n))
            if self.acc:
                logits = be.to_host(self._logits(out))
                labels = arrays[self.data.input_names.index(self.acc[1])]
                correct += int((logits.argmax(-1) == labels).sum())
                seen += labels.size
        rec = {"step": self.step}
        if losses:
            rec["test_loss"] = sum(v * n for v, n in losses) / sum(n for _, n in losses)
        if seen:
            rec["test_accuracy"] = correct / seen
        return rec

    def _logits(self, out):
        names = self.forward.outputs.get("output", [])
        if self.acc and self.acc[0] in names:
            return out["output"][names.index(self.acc[0])]
        return out["output"][0]

    def fit(self) -> RunResult:
        if self.opts.resume:
            if not self.opts.checkpoint:
                raise NetdslError("--resume needs --checkpoint DIR")
            self.restore()
        be = self.executor.backend
        info = {"network": self.forward.name, "params": self.stats.params,
                "backend": be.name, "device": _device_name(be), "batch": self.batch,
                "total_steps": self.total, "start_step": self.step,
                "expected_bytes": self.expected_bytes(), "dataset": self.data.name,
                "train_samples": len(self.data.train)}
        self.cb.on_start(info)
        log = open(self.opts.log, "a" if self.opts.resume else "w") if self.opts.log else None
        times, losses = [], []
        last_eval: dict = {}
        train_acc = None
        lr_base = self.cfg.optimizer.lr
        labels_at = self.data.input_names.index(self.acc[1]) if self.acc else None
        try:
            while self.step < self.total:
                arrays = self.loader.next()
                lr = lr_at(self.cfg.schedule, lr_base, self.step, self.total)
                feeds = self.feeds(arrays)
                feeds["lr"] = np.float32(lr)
                t0 = time.perf_counter()
                out = self.executor.run(feeds, training=True, roles=self.ROLES, step=self.step)
                loss = float(be.to_host(out["loss"][0]))
                be.synchronize()
                dt = time.perf_counter() - t0
                self.step += 1
                times.append(dt)
                losses.append(loss)
                rec = {"step": self.step, "loss": loss, "lr": lr,
                       "images_per_s": self.batch / dt, "step_time_s": dt,
                       "epoch": self.loader.epoch}
                if labels_at is not None:
                    logits = be.to_host(self._logits(out))
                    train_acc = float((logits.argmax(-1) == arrays[labels_at]).mean())
                    rec["accuracy"] = train_acc
                if not np.isfinite(loss):
                    raise NetdslError(f"the loss became {loss} at step {self.step} (lr {lr:g});"
                                      " lower the learning rate or run with --check-numerics "
                                      "to find the first node that overflows")
                if self.cfg.eval_every and self.step % self.cfg.eval_every == 0:
                    last_eval = self.evaluate()
                    rec.update(last_eval)
                    self.cb.on_eval(last_eval)
                if log:
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                self.cb.on_step({**rec, "total_steps": self.total})
                if (self.opts.checkpoint and self.opts.checkpoint_every
                        and self.step % self.opts.checkpoint_every == 0):
                    self.save()
        finally:
            if log:
                log.close()
        every = self.opts.checkpoint_every
        just_saved = bool(losses) and bool(every) and self.step % every == 0
        if self.opts.checkpoint and not just_saved:  # the final state, once
            self.save()
        final_eval = self.evaluate() if self.data.test is not None else {}
        steady = times[1:] or times
        ips = self.batch / statistics.median(steady) if steady else 0.0
        result = RunResult(
            network=self.forward.name, steps=self.step,
            final_loss=losses[-1] if losses else float("nan"), images_per_s=ips,
            peak_bytes=self.executor.peak_bytes, params=self.stats.params, backend=be.name,
            device=_device_name(be), batch=self.batch, expected_bytes=self.expected_bytes(),
            step_time_s=statistics.median(steady) if steady else 0.0,
            test_accuracy=final_eval.get("test_accuracy"),
            test_loss=final_eval.get("test_loss"), train_accuracy=train_acc,
            resumed_from=self.resumed_from, losses=losses)
        self.cb.on_end(result)
        return result

    def expected_bytes(self) -> int:
        """The step's peak predicted by static liveness analysis before running (the
        executor's measured peak equals it: both follow one schedule and one rule)."""
        return make_plan(self.train_graph, self.ROLES, self.opts.dtype, pack_arena=False).peak_bytes


def _device_name(be) -> str:
    if be.name == "numpy":
        return "cpu"
    return f"cuda:{be.device}"
