"""The training loop: a step built by netdsl.step, run by the executor on batches, with
evaluation, logs and checkpoints.

The trainer feeds the step batches and the scheduled learning rate, evaluates the
forward graph (BatchNorm in eval mode) on held-out data on the same state, writes one
JSON line per step, and saves checkpoints that resume exactly: parameters, buffers,
optimizer state, step and loader position are all in the checkpoint, and the dropout RNG
is re-seeded from (seed, step) every step, so N steps + resume + N steps == 2N steps.

Reporting goes through a `callback` object (the CLI draws a progress bar with it); this
layer prints nothing.
"""
from __future__ import annotations

import json
import time
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np

from netdsl.config import TrainConfig
from netdsl.ir.graph import Graph
from netdsl.ir.stats import summarize
from netdsl.ir.types import NUMPY_DTYPE
from netdsl.runtime.data import accuracy, load_dataset
from netdsl.runtime.data.feed import open_loader, rows_read, write_classes
from netdsl.runtime.data.samples import DataError
from netdsl.runtime.evaluate import RunEvaluator
from netdsl.runtime.executor import Executor, NonFinite
from netdsl.runtime.loss_scale import StepScale
from netdsl.runtime.options import RunOptions, backend_for, check_options, preflight
from netdsl.runtime.result import Callback, RunResult, device_name
from netdsl.runtime.run_log import open_log
from netdsl.runtime.run_memory import non_finite_error, refuse_what_cannot_fit
from netdsl.runtime.run_report import METERED_STEPS, Progress, finished, nothing_to_do
from netdsl.runtime.run_state import RunState
from netdsl.runtime.schedule import lr_at
from netdsl.runtime.stop import StopRequest
from netdsl.step import room
from netdsl.step.build import build_step
from netdsl.step.fit import held_besides_plan
from netdsl.step.graphs import TRAINING_ROLES
from netdsl.step.request import request_for, resolve_config

__all__ = ["Callback", "RunResult", "Trainer"]



class Trainer:
    ROLES = TRAINING_ROLES  # what a training step computes (a split adds its own)

    def __init__(self, forward: Graph, cfg: TrainConfig | None, opts: RunOptions,
                 callback: Callback | None = None):
        self.warnings = check_options(opts)
        preflight(opts)  # what would fail at the end fails now, before any work
        self.opts, self.cb, self.forward = opts, callback or Callback(), forward
        self.cfg = resolve_config(cfg, opts)
        self.data = load_dataset(forward, self.cfg, opts.bad_images)
        self.batch = self.cfg.batch
        self.loader = open_loader(self.data.train, self.batch, self.cfg.seed, opts.workers,
                                  cpu_step=opts.backend == "numpy")
        self.total = (self.cfg.steps if self.cfg.steps is not None else
                      (self.cfg.epochs or 1) * self.loader.batches_per_epoch)
        backend = backend_for(opts)
        self.rank, world, comm = 0, None, None
        if opts.distributed:
            from netdsl.runtime.ranks import join
            world, comm, note = join(opts.devices, backend)
            self.warnings += [note] if note else []
            self.rank, self.opts = world.rank, replace(opts, devices=world.size)
        request = request_for(self.opts, self.cfg, backend, runs=True,
                              free_bytes=room.available_bytes(backend))
        self.built = build_step(forward, self.cfg, request, world=world, phase=self._phase)
        self.warnings += self.built.warnings
        if not self.built.fits:
            raise self.built.refusal(self._phase)
        self.train_graph, self.full_graph = self.built.graph, self.built.full_graph
        self.scale = StepScale(self.train_graph)  # f16's loss scale (else it does nothing)
        self.split, self.ROLES, self.acc = self.built.split, self.built.roles, self.built.labels
        self.budget = self.built.budget_bytes
        self.executor = self._executor(backend, comm)
        if comm is not None:  # (NCCL's communicators for the step's groups: runtime.nccl)
            comm.prepare(self.train_graph)
        self._refuse_what_cannot_fit(backend, comm)
        self._fed = self._fed_inputs()
        self.loader.only(self._fed, rows_read(self.train_graph, self.data.input_names[0],
                                              self.batch))
        status = getattr(backend, "cudnn_status", "")
        if status.startswith("not used"):  # (loaded by the executor: a GPU convolution)
            self.warnings.append(f"the convolutions run as columns and GEMMs; cuDNN {status}")
        self.state = RunState(self.executor, forward, opts.checkpoint, opts.distributed)
        self.evaluator = RunEvaluator(self.executor, forward, self.data, self.batch, self.acc,
                                      opts.eval_samples, self.state, self.rank,
                                      opts.distributed, self.cfg.seed, self.cfg.precision)
        if self.rank != 0:
            self.cb = Callback()  # rank 0 reports
        self.stats = summarize(self.built.bound)
        self.executor.stop_if_nonfinite = set(forward.outputs.get("loss", [])) | (
            {self.acc[0]} if self.acc else set())
        self.step = 0
        self.resumed_from = None

    @property
    def mem(self) -> str | None:
        """The budget as --mem takes it: the option, or the one chosen within free memory."""
        return self.opts.mem if self.opts.mem is not None else self.built.budget_text

    def _phase(self, text: str) -> None:
        on_phase = getattr(self.cb, "on_phase", None)  # (every hook is optional)
        if on_phase is not None:
            on_phase(text)

    def _executor(self, backend, comm) -> Executor:
        """The step's executor; the parameters and optimizer state are allocated here."""
        if backend.name == "numpy" and backend.fused is not None:
            self._phase("loading the step's CPU kernels (a first run compiles them)")
        try:
            return Executor(self.train_graph, backend, self.opts.dtype, self.cfg.seed,
                            self.opts.check_numerics, arena=self.built.arena,
                            budget_bytes=self.budget,
                            budget_includes_host=self.built.budget_includes_host, comm=comm,
                            plans={self.ROLES: self.built.storage_plan()})
        except MemoryError:
            raise room.out_of_memory(self.planned_peak_bytes(), backend, self.batch,
                                     "allocating the parameters") from None

    def _fed_inputs(self) -> list[bool]:
        """Which of the data's inputs this process's step reads (an MPI rank's part may
        read none of a pipeline's images), and the labels, which the accuracy reads."""
        fed = self.executor.feed_names()
        return [k in fed or (bool(self.acc) and k == self.acc[1])
                for k in self.data.input_names]

    # -- memory --------------------------------------------------------------------------
    def planned_peak_bytes(self) -> int:
        """The step's peak as planned before it runs (`Step.planned_peak_bytes`)."""
        return self.built.planned_peak_bytes()

    def _planned_by_device(self) -> dict[int, int]:
        return self.built.planned_by_device()

    def _state_bytes(self) -> int:
        """The parameters' and optimizer state's arrays, allocated before the first step."""
        return sum(int(v.nbytes) for v in self.executor.state.values())

    def _held_besides_plan(self, step: Graph, backend) -> int:
        return held_besides_plan(step, self.opts.dtype, backend.name == "numpy")

    def _refuse_what_cannot_fit(self, backend, comm=None) -> None:
        """Refuse, before the first step, a step that cannot fit what is free now
        (`run_memory.refuse_what_cannot_fit`)."""
        need = self.planned_peak_bytes()
        if not self.executor.arena:  # (an arena run's planned peak counts it already)
            need += self._held_besides_plan(self.train_graph, backend)
        refuse_what_cannot_fit(need, self._state_bytes(), backend, self.batch, self.budget,
                               comm, self.opts.devices)

    # -- state ---------------------------------------------------------------------------
    def state_items(self):
        """The whole state in the single-device layout (`RunState.items`)."""
        return self.state.items()

    def state_dict(self) -> dict | None:
        return self.state.copy()

    def save(self) -> Path | None:
        if self.data.classes and self.rank == 0:
            write_classes(self.opts.checkpoint, self.data.classes)
        return self.state.save({"network": self.forward.name, "step": self.step,
                                "loader": self.loader.state(), "seed": self.cfg.seed,
                                "config": json.loads(self.cfg.model_dump_json()),
                                **self.scale.header()})

    def restore(self) -> None:
        header = self.state.restore()
        if header is not None:
            self.step = int(header["step"])
            self.loader.restore(header["loader"])
            self.scale.restore(header)
            self.resumed_from = self.step

    def evaluate(self) -> dict:
        return self.evaluator.evaluate(self.step, self.warnings,
                                       getattr(self.cb, "on_eval_progress", None))

    # -- loop ----------------------------------------------------------------------------
    def feeds(self, arrays) -> dict:
        return {k: a for k, a in zip(self.data.input_names, arrays) if a is not None}

    def fit(self) -> RunResult:
        # NumPy's RuntimeWarnings (overflow, invalid value) are not for the user: a
        # non-finite loss or logits stops the run with one message naming the first node.
        # The backend's thread set-up is held for the whole run, not only inside each
        # step: a BLAS call between steps (synthetic data's labels) would wake BLAS
        # threads that spin into the next step and take a core from it.
        with np.errstate(all="ignore"), warnings.catch_warnings(), \
                self.executor.backend.running():
            warnings.simplefilter("ignore", RuntimeWarning)
            try:
                return self._fit()
            except MemoryError:
                raise room.out_of_memory(self.planned_peak_bytes(), self.executor.backend,
                                         self.batch, f"at step {self.step + 1}") from None

    def _fit(self) -> RunResult:
        if self.opts.resume:
            self.restore()
            if self.step >= self.total:
                return nothing_to_do(self)
        self.cb.on_start(self._start_info())
        log = (open_log(self.opts.log, self.opts.resume, self.step)
               if self.opts.log and self.rank == 0 else None)
        run = Progress()
        # the peak is measured by the backend (tracemalloc, the CuPy pool), not counted,
        # over the first METERED_STEPS steps
        meter = self.executor.backend.memory_meter()
        meter.__enter__()
        # the handlers stay through the final save: a first signal then lets it finish (over
        # MPI a rank can get Ctrl-C after the ranks agreed to stop; StopRequest)
        stop = StopRequest()
        with stop:
            try:
                while self.step < self.total:
                    try:
                        self._train_step(run, log)
                    except DataError as e:  # (between steps: what was trained is kept)
                        # (over MPI a save needs every rank, and only this one stopped)
                        if not (self.opts.checkpoint and self.step > (self.resumed_from or 0)
                                and not self.opts.distributed):
                            raise
                        self.save()
                        raise DataError(f"{e.message}; the checkpoint in {self.opts.checkpoint}"
                                        f" holds step {self.step}: --resume goes on from "
                                        "there") from None
                    if run.metering and len(run.times) == METERED_STEPS:
                        run.metering = False  # (its evaluation and save included)
                        meter.__exit__(None, None, None)
                    if self._stop_requested(stop):
                        break
            finally:
                self.loader.close()
                if run.metering:
                    meter.__exit__(None, None, None)
                if log:
                    log.close()
            every = self.opts.checkpoint_every
            just_saved = bool(run.losses) and bool(every) and self.step % every == 0
            if self.opts.checkpoint and not just_saved:  # the final state, once
                self.save()
        interrupted = stop.agreed  # (over MPI: every rank's, after the last step)
        final_eval = (self.evaluate() if self.data.test is not None and not interrupted
                      else {})
        result = finished(self, run, meter, final_eval, interrupted)
        self.cb.on_end(result)
        return result

    def _train_step(self, run: Progress, log) -> None:
        """One step: its batch, its run, its record (logged and reported), its evaluation
        and checkpoint when they are due."""
        arrays = self.loader.next(self._fed)
        lr = lr_at(self.cfg.schedule, self.cfg.optimizer.lr, self.step, self.total)
        feeds = self.feeds(self.loader.device_batch or arrays)
        feeds["lr"] = np.dtype(NUMPY_DTYPE[self.opts.dtype]).type(lr)  # (the run's dtype)
        self.scale.feed(feeds)
        be = self.executor.backend
        t0 = time.perf_counter()
        try:
            out = self.executor.run(feeds, training=True, roles=self.ROLES, step=self.step)
            self.loader.send_ahead(be)  # (on a GPU: the next batch's copy, during this step)
        except NonFinite as e:
            raise non_finite_error(self.executor, self.train_graph,
                                   self.forward.outputs.get("loss", []), e, feeds, lr,
                                   self.step) from None
        # over MPI the loss (and the logits) live on rank 0
        loss = float(be.to_host(out["loss"][0])) if "loss" in out else float("nan")
        be.synchronize()
        dt = time.perf_counter() - t0
        self.step += 1
        run.times.append(dt)
        run.losses.append(loss)
        rec = {"step": self.step, "loss": loss, "lr": lr, "images_per_s": self.batch / dt,
               "step_time_s": dt, "data_wait_s": self.loader.wait_s,
               "epoch": self.loader.epoch}
        self.scale.after(out, rec, self.executor)
        run.waits.append(self.loader.wait_s)
        if self.acc and "logits" in out:
            labels = arrays[self.data.input_names.index(self.acc[1])]
            c, k = accuracy(be.to_host(out["logits"][0]), self.acc[2], labels)
            if k:
                run.train_accuracy = rec["accuracy"] = c / k
        if self.cfg.eval_every and self.step % self.cfg.eval_every == 0:
            evaluated = self.evaluate()
            rec.update(evaluated)
            self.cb.on_eval(evaluated)
        if log:
            log.write(json.dumps(rec) + "\n")
            log.flush()
        self.cb.on_step({**rec, "total_steps": self.total})
        every = self.opts.checkpoint_every
        if self.opts.checkpoint and every and self.step % every == 0:
            self.save()

    def _stop_requested(self, stop: StopRequest) -> bool:
        """Whether to stop after this step: a signal arrived (over MPI: on any rank, so
        that every rank stops after the same step; `stop.agreed`). A signal that arrives
        during the agreement counts at the next one (StopRequest)."""
        if self.opts.distributed:
            from netdsl.runtime.mpi import first_on_any_rank
            stop.agreed = first_on_any_rank(stop.requested)
        else:
            stop.agreed = stop.requested
        return stop.agreed is not None

    # -- reports -------------------------------------------------------------------------
    def _start_info(self) -> dict:
        be = self.executor.backend
        return {"warnings": list(self.warnings), "network": self.forward.name,
                "params": self.stats.params, "backend": be.name, "device": device_name(be),
                "batch": self.batch, "total_steps": self.total, "start_step": self.step,
                "planned_peak_bytes": self.planned_peak_bytes(), "dataset": self.data.name,
                "train_samples": len(self.data.train), "budget_bytes": self.budget,
                "memory_plan": self.built.plan_summary(), "split": self.split,
                "profile": self.built.profile.name, "precision": self.cfg.precision}
