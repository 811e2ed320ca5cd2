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
import os
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from netdsl.config import ParallelConfig, TrainConfig
from netdsl.errors import CheckpointError, NetdslError
from netdsl.ir.graph import STATE_OPS, Graph
from netdsl.ir.serialize import fingerprint
from netdsl.ir.stats import summarize
from netdsl.ir.types import NUMPY_DTYPE
from netdsl.memory.plan import device_peaks, make_plan, unplanned_bytes, value_bytes
from netdsl.memory.profiles import get_profile
from netdsl.passes.fuse import fuse_options
from netdsl.passes.pipeline import run_pipeline
from netdsl.runtime import checkpoint, room
from netdsl.runtime.accumulate import (
    accumulating_step,
    accumulation,
    fewest_microbatches,
    fits_with,
    require_loss,
)
from netdsl.runtime.data import Loader, Split, accuracy, loss_labels, make_dataset
from netdsl.runtime.evaluate import eval_pass
from netdsl.runtime.executor import Executor, NonFinite
from netdsl.runtime.options import RunOptions, backend_for, check_options, preflight, resolve_config
from netdsl.runtime.schedule import lr_at
from netdsl.runtime.stop import StopRequest
from netdsl.sizes import format_decimal, parse_size

# The memory meter watches a run's first steps and then stops: tracemalloc records every
# allocation, Python objects' too, and made each step 1.7-2x slower while it ran
# (bench/refs/netdsl_step.py --fit, two threads: ResNet-164 b16 471-501 ms against 749-844,
# transformer-tiny 16-18 ms against 31-35; docs/benchmarks.md). The
# first step allocates the optimizer's state; every later one repeats the second's
# allocations (the same graph by the same plan), so the high-water mark is theirs.
METERED_STEPS = 2


@dataclass
class RunResult:
    network: str
    steps: int
    final_loss: float | None  # None when nothing was trained (a resume past --steps)
    images_per_s: float
    # measured independently of the executor: the state's arrays plus the high-water mark
    # of what the steps allocated (tracemalloc on NumPy, the CuPy pool on a GPU), over the
    # first METERED_STEPS steps (their evaluations and checkpoint saves included)
    peak_bytes: int
    params: int
    backend: str
    device: str
    batch: int
    planned_peak_bytes: int  # the storage plan's prediction, before the first step
    step_time_s: float
    counted_peak_bytes: int = 0  # the executor's own count, which follows the plan
    # the host pool's peak (offloaded values, state streamed from the host); on NumPy the
    # pool is the same process memory, so `peak_bytes` includes it
    host_peak_bytes: int = 0
    budget_bytes: int | None = None  # --mem
    split: str | None = None  # --devices: the split made, e.g. "data=2"
    peak_by_device: dict[int, int] = field(default_factory=dict)  # counted, per device
    # --devices: the storage plan's peak per device (with --mem: each within the budget)
    planned_peak_by_device: dict[int, int] = field(default_factory=dict)
    comm_bytes_per_step: dict[int, int] = field(default_factory=dict)  # sent, counted
    memory_plan: dict | None = None  # the planner's summary, with --mem
    test_accuracy: float | None = None
    test_loss: float | None = None
    train_accuracy: float | None = None
    resumed_from: int | None = None
    # the signal that stopped the run after its step ("SIGINT", "SIGTERM"; see runtime.stop)
    interrupted: str | None = None
    note: str | None = None
    warnings: list[str] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d.pop("losses")
        return d


class Callback:
    """Hooks for progress display; every method is optional."""

    def on_phase(self, text: str) -> None: ...  # what the set-up does now (before on_start)
    def on_start(self, info: dict) -> None: ...
    def on_step(self, record: dict) -> None: ...
    def on_eval(self, record: dict) -> None: ...
    def on_eval_progress(self, done: int, total: int) -> None: ...
    def on_end(self, result: RunResult) -> None: ...

def training_graph(forward: Graph, cfg: TrainConfig, device: str = "cpu") -> Graph:
    require_loss(forward)
    opt = cfg.optimizer.model_dump()
    kind = opt.pop("kind")
    # fuse: batchnorm + relu as one op, gradient sums into batchnorm's dx (NETDSL_FUSE=0
    # leaves the graph as written); join_slice_grads: q/k/v-style slices' gradients as
    # one concat; device: the kernels' variants for the device ("gpu" on CuPy)
    fusing = fuse_options(device)
    return run_pipeline(forward, [("fuse", fusing), "autodiff",
                                  ("fuse_grads", {"enabled": fusing["enabled"]}),
                                  "join_slice_grads", ("optimizer", {"kind": kind, **opt}),
                                  ("device", {"kind": device})])

class Trainer:
    ROLES = ("loss", "output", "updates")  # what a training step computes
    def __init__(self, forward: Graph, cfg: TrainConfig | None, opts: RunOptions,
                 callback: Callback | None = None):
        self.opts = opts
        self.warnings = check_options(opts)
        preflight(opts)  # what would fail at the end fails now, before any work
        self.cfg = resolve_config(cfg, opts)
        self.cb = callback or Callback()
        self.forward = forward
        try:
            self.data = make_dataset(forward, self.cfg.data, self.cfg.seed)
        except MemoryError:
            raise NetdslError(f"out of memory making the {self.cfg.data.kind} data set "
                              f"for network `{forward.name}`; its inputs or classes are "
                              "too large for this machine (use fewer samples or a smaller "
                              "network)") from None
        self.batch = self.cfg.batch
        self.loader = Loader(self.data.train, self.batch, self.cfg.seed)
        if self.cfg.steps is not None:
            self.total = self.cfg.steps
        elif self.cfg.epochs is not None:
            self.total = self.cfg.epochs * self.loader.batches_per_epoch
        else:
            self.total = self.loader.batches_per_epoch  # one epoch
        bound = forward.bind(self.batch)
        self.acc = loss_labels(forward)
        backend = backend_for(opts)
        # the step's kernels and fusions: a GPU's on CuPy (`training_graph`'s `device`)
        self.kind = "gpu" if backend.name == "cupy" else "cpu"
        self.split = None
        self.mem_plan = self.split_plan = None  # --mem: the planner's result, its summary
        self.rank, comm = 0, None
        if opts.distributed:
            from netdsl.runtime.mpi import MPIComm, world
            self.rank, size = world()
            if size == 1:  # (a split of one device has no parts to spread)
                raise NetdslError("--distributed runs one process per device under "
                                  "`mpiexec -n N` with N of 2 or more, and this is one "
                                  "process; run without --distributed, or under mpiexec")
            if opts.devices not in (1, size):
                raise NetdslError(f"--devices {opts.devices} but mpiexec started {size} "
                                  "ranks; with --distributed there is one device per rank")
            opts.devices = size
            comm = MPIComm(backend)
        micro, order = accumulation(forward, opts.microbatches, opts.schedule, opts.devices)
        declared = ParallelConfig(**dict(forward.parallel)).devices
        if opts.devices == 1 and declared > 1:  # (the declared split needs its devices)
            self.warnings.append(
                f"the file's parallel {{ }} splits the step over {declared} devices, which "
                f"takes --devices {declared} (or mpiexec -n {declared} ... --distributed); "
                "this run is on one device")
        if opts.devices > 1:
            self.train_graph, self.split = self._split_step(backend)
        elif micro > 1:
            self._phase(f"building the training step ({micro} micro-batches)")
            self.train_graph = accumulating_step(
                forward, self.batch, self.cfg, micro, order, (self.acc[0],) if self.acc else (),
                self.kind)
            from netdsl.parallel.split import SplitSpec
            self.split = SplitSpec(microbatches=micro, schedule=order).describe()
        else:
            self.train_graph = training_graph(
                bound, self.cfg, self.kind).verify()
        if self.acc:  # fetch the loss's own logits (not the first output) for accuracy
            for g in (self.train_graph, bound):
                g.outputs["logits"] = [self.acc[0]]
        # --mem, or on one device a budget within the free memory when the step as
        # written does not fit it (the run plans itself, as Layup's and SuperNeurons' do)
        self.mem, self.mem_from = opts.mem, "--mem" if opts.mem is not None else None
        if opts.mem is None:
            # the updates as one node per kind, settings and device (a planned step keeps
            # each update right after its gradient, which frees the gradient early)
            grouped = run_pipeline(self.train_graph, ["group_updates"], recheck_shapes=False)
            self.mem = self._budget_to_fit(grouped, backend)
            if self.mem is None:
                self.train_graph = grouped
            else:
                self.mem_from = "free memory"
        if self.mem is None and (opts.profile is not None or opts.strategy != "auto"):
            self.warnings.append("--profile and --strategy have no effect without --mem "
                                 "(they say how to plan the step into a memory budget)")
        if opts.distributed:
            from netdsl.parallel.project import project
            self.full_graph = self.train_graph
            _agree_on_the_step(self.full_graph, self.split, self.rank)
            self.train_graph = project(self.train_graph, self.rank)
        self.ROLES = _roles(self.train_graph)
        self.budget = None
        self.budget_host = False
        if self.mem is not None and opts.devices > 1:  # planned per device by _split_step
            self.budget = parse_size(self.mem, "--mem")
            self.budget_host = get_profile(self._profile_name(backend)).unified
        elif self.mem is not None:  # plan the step into the budget, then run exactly that
            from netdsl.memory.search import infeasible_error, plan_and_apply
            profile = opts.profile or ("cpu" if backend.name == "numpy" else "h200")
            planned, self.mem_plan = plan_and_apply(
                self.train_graph, self.mem, profile, opts.strategy, opts.dtype,
                roles=self.ROLES, arena=True, offload_state=opts.offload_state)
            if planned is None:
                fitting = self._microbatches_to_fit(profile, micro)
                if self.mem_from == "free memory":
                    raise self._cannot_fit_even_planned(backend, fitting)
                raise infeasible_error(self.mem_plan, fits_with(fitting))
            self.train_graph = planned
            self.budget = self.mem_plan.budget_bytes
            # where host and device are one memory, the host pool counts against the budget
            self.budget_host = self.mem_plan.profile.unified
        if backend.name == "numpy" and backend.fused is not None:
            self._phase("loading the step's CPU kernels (a first run compiles them)")
        try:  # the parameters and optimizer state are allocated here
            # a split step's devices are counted per value, not packed into one arena
            self.executor = Executor(self.train_graph, backend, opts.dtype, self.cfg.seed,
                                     opts.check_numerics,
                                     arena=self.budget is not None and opts.devices == 1,
                                     budget_bytes=self.budget,
                                     budget_includes_host=self.budget_host, comm=comm)
        except MemoryError:
            raise room.out_of_memory(self.planned_peak_bytes(), backend, self.batch,
                                     "allocating the parameters") from None
        self._refuse_what_cannot_fit(backend, comm)
        # the inputs this process's step reads (an MPI rank's part may read none of a
        # pipeline's images: held through its step, they were 2.5-4% of rank 1's peak),
        # and the labels, which the accuracy reads
        fed = self.executor.feed_names()
        self._fed = [k in fed or (bool(self.acc) and k == self.acc[1])
                     for k in self.data.input_names]
        status = getattr(backend, "cudnn_status", "")
        if status.startswith("not used"):  # (loaded by the executor: a GPU convolution)
            self.warnings.append(f"the convolutions run as columns and GEMMs; cuDNN {status}")
        # evaluation runs the forward graph on the step's state where the executor holds
        # it under the forward graph's names, whole; else (over MPI, spread over the
        # ranks; a tensor split, in shards) on a copy joined before each evaluation
        shares = not opts.distributed and self.executor.holds_state_whole()
        self._eval_base = self.executor if shares else None
        self._eval_execs: dict[int, Executor] = {}
        self._eval_refused: str | None = None  # why a joined copy cannot fit, decided once
        if self.rank != 0:
            self.cb = Callback()  # rank 0 reports
        self.stats = summarize(bound)
        self.executor.stop_if_nonfinite = set(forward.outputs.get("loss", [])) | (
            {self.acc[0]} if self.acc else set())
        self.step = 0
        self.resumed_from = None

    def _phase(self, text: str) -> None:
        on_phase = getattr(self.cb, "on_phase", None)  # (every hook is optional)
        if on_phase is not None:
            on_phase(text)

    def _budget_to_fit(self, step: Graph, backend) -> str | None:
        """A run without --mem on one device: None when `step` as written fits the free
        memory, else the budget within it to plan the step into (what the refusal below
        would tell the user to give), with a warning saying so."""
        if self.opts.devices > 1 or self.opts.distributed:
            return None  # (a split chooses with --mem; without it, it is refused below)
        free = room.available_bytes(backend)
        if free is None:
            return None
        need = (make_plan(step, _roles(step), self.opts.dtype, pack_arena=False).peak_bytes
                + self._held_besides_plan(step, backend))
        self._as_written = need, free
        if need <= free:
            return None
        mem = room.budget_within(free)
        self.warnings.append(
            f"the step as written needs about {format_decimal(need)} and about "
            f"{format_decimal(free)} is free on {room.where(backend)}: planned into --mem "
            f"{mem} (activations recomputed or offloaded, so a step takes longer; give --mem "
            "to choose the budget)")
        return mem

    def _microbatches_to_fit(self, profile: str, micro: int) -> int | None:
        """For a budget no plan of the step meets: more micro-batches whose step a plan
        fits into it, for the error to name (the run does not switch by itself: with
        batchnorm the step would compute other numbers), or None."""
        from netdsl.memory.search import plan_and_apply
        opts, failed = self.opts, self.mem_plan
        if self.batch <= micro:  # (no more parts than samples)
            return None
        self._phase("no plan fits: trying more micro-batches")

        def fits(step):
            return plan_and_apply(step, failed.budget_bytes, profile, opts.strategy,
                                  opts.dtype, roles=_roles(step), arena=True,
                                  offload_state=opts.offload_state)[1]
        return fewest_microbatches(self.forward, self.batch, self.cfg, failed, fits, micro,
                                   self.kind, opts.dtype)

    def _cannot_fit_even_planned(self, backend, fitting: int | None = None) -> NetdslError:
        """The error for a run without --mem whose step fits the free memory neither as
        written nor planned (`fitting`: micro-batches a plan of whose step would fit)."""
        (need, free), p = self._as_written, self.mem_plan
        return NetdslError(
            f"out of memory before the first step: a training step needs about "
            f"{format_decimal(need)} as written (at batch {self.batch}), about "
            f"{format_decimal(free)} is free on {room.where(backend)}, and no memory plan "
            f"fits {format_decimal(p.budget_bytes)} of it: the least a plan needs is about "
            f"{format_decimal(p.min_feasible_bytes)}, "
            f"dominated by {p.dominant or 'the persistent state'}; use a smaller batch "
            f"(e.g. --batch {max(self.batch // 2, 1)}: activations shrink with it)"
            f"{room.ACCUMULATE if self.batch > 1 else ''}, or a smaller network"
            f"{fits_with(fitting)}")

    def _refuse_what_cannot_fit(self, backend, comm=None) -> None:
        """Refuse, before the first step, a step whose planned peak is more than the memory
        left once the state is allocated: Linux lets the allocations through and then
        kills the process (no MemoryError to say in words: `netdsl run
        examples/resnet2504.net` without --mem was killed after a minute), and a GPU's
        step would fail only after the build. The plan's peak is the executor's own count
        (tests/test_plan.py), so the refusal is not a guess. Over MPI (`comm`) the ranks
        that share one machine's memory (or one GPU) are counted together: each alone
        could fit where all of them cannot; so are the devices of a split run in one
        process (whose plan's peak is all of them at once). What a process holds besides
        its plan counts too (`_held_besides_plan`)."""
        need, state, ranks = self.planned_peak_bytes(), self._state_bytes(), 1
        if not self.executor.arena:  # (an arena run's planned peak counts it already)
            need += self._held_besides_plan(self.train_graph, backend)
        part = "rank"
        if comm is None:
            free = room.available_bytes(backend)
            ranks, part = self.opts.devices, "device"
        else:
            need, state, free, ranks = comm.memory_totals(
                getattr(backend, "device", 0) if backend.name == "cupy" else 0, need, state,
                lambda: room.available_bytes(backend))
        if free is not None and need - state > free:
            raise room.out_of_memory(need, backend, self.batch, "before the first step",
                                     free + state, self.budget, ranks, part)

    def _held_besides_plan(self, step: Graph, backend) -> int:
        """What a process running `step` holds besides its storage plan in the memory that
        `room` reads: on NumPy the fed batch and the interpreter's objects
        (`memory.plan.unplanned_bytes`; over MPI `step` is this rank's part, so this is
        its reserve, `plan.process_reserves`); on a GPU those are host memory."""
        return unplanned_bytes(step, self.opts.dtype) if backend.name == "numpy" else 0

    def _split_step(self, backend):
        """The training step split over `--devices` logical devices (netdsl.parallel),
        the trainer's logits made whole on the loss's device."""
        from netdsl.parallel.choose import Share, choose
        from netdsl.parallel.predict import get_interconnect
        opts = self.opts
        profile = get_profile(self._profile_name(backend))
        mem = parse_size(opts.mem, "--mem") if opts.mem is not None else None
        self._phase(f"choosing how to split the step over {opts.devices} devices"
                    + (f" ({opts.split})" if opts.split else ""))
        share = None
        if opts.distributed:  # the ranks share the candidates out
            from netdsl.runtime import mpi
            share = Share(*mpi.world(), mpi.allgather)
        chosen = choose(self.forward, self.batch, opts.split, opts.devices,
                        self.cfg.optimizer.model_dump(), profile, get_interconnect("shm"),
                        mem=mem, microbatches=opts.microbatches, schedule=opts.schedule,
                        bn=opts.bn,
                        gather=(self.acc[0],) if self.acc else (), plan=mem is not None,
                        mem_strategy=opts.strategy, float_dtype=opts.dtype,
                        outputs={"logits": [self.acc[0]]} if self.acc else None,
                        over_mpi=opts.distributed, share=share, jobs=opts.jobs)
        self._phase(f"building the training step ({chosen.best.spec.describe()})")
        # --mem: the chosen split planned per device (None when it fits as it is)
        best = chosen.best
        self.mem_plan = best.memory
        if best.memory is not None:
            from netdsl.parallel.memplan import summary
            self.split_plan = summary(best.memory, best.unplanned_step_s,
                                      best.unplanned_peak_bytes, best.report.predicted_step_s)
        return chosen.best.graph, chosen.best.spec.describe()

    def _profile_name(self, backend) -> str:
        return self.opts.profile or ("cpu" if backend.name == "numpy" else "h200")

    # -- state ---------------------------------------------------------------------------
    def _state_spec(self) -> dict[str, tuple]:
        spec = self.executor.state_spec()
        if self.opts.distributed:  # every rank's part: the single-device layout
            from netdsl.runtime.mpi import merge_all
            spec = merge_all(spec)
        return spec

    def state_items(self):
        """The whole state in the single-device layout, (key, host array) one entry at a
        time (over MPI: on rank 0, which must take every item, while the other ranks send
        their parts; None elsewhere). The arrays may be the state itself: read each before
        the next step."""
        if not self.opts.distributed:
            return self.executor.state_items(copy=False)
        ex = self.executor
        return ex.comm.gather_state(ex.state_parts(), lambda x: ex.host_state(x, copy=False))

    def state_dict(self) -> dict | None:
        """A copy of the whole state in the single-device layout (over MPI: on rank 0, else
        None; every rank must call it)."""
        items = self.state_items()
        return None if items is None else {k: np.array(v) for k, v in items}

    def save(self) -> Path | None:
        """Write the checkpoint (over MPI rank 0 writes it as the parts arrive, and every
        rank learns whether that worked: a failed save stops every rank with its reason;
        the checkpoint there before is kept)."""
        header = {"network": self.forward.name, "step": self.step,
                  "loader": self.loader.state(), "seed": self.cfg.seed,
                  "config": json.loads(self.cfg.model_dump_json())}
        items = self.state_items()
        if not self.opts.distributed:
            return checkpoint.save(self.opts.checkpoint, items, header)
        path, failed = None, ""
        if items is not None:
            try:
                path = checkpoint.save(self.opts.checkpoint, items, header)
            except CheckpointError as e:
                failed = e.message
            finally:
                for _ in items:  # the other ranks' parts, so that their sends complete
                    pass
        from netdsl.runtime.mpi import bcast
        failed = bcast(failed)
        if failed:
            raise CheckpointError(failed)
        return path

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
        # over MPI each rank takes its own part of the (complete, just checked) file
        self.executor.load_state_dict(arrays, strict=not self.opts.distributed)
        self.step = int(header["step"])
        self.loader.restore(header["loader"])
        self.resumed_from = self.step

    # -- loop ----------------------------------------------------------------------------
    def feeds(self, arrays) -> dict:
        return {k: a for k, a in zip(self.data.input_names, arrays) if a is not None}

    def eval_limit(self) -> int:
        """How many held-out samples an evaluation uses (see RunOptions.eval_samples)."""
        have = len(self.data.test) if self.data.test is not None else 0
        want = self.opts.eval_samples
        if want is None:
            want = self.batch if self.data.name == "synthetic" else have
        return min(have, want)

    def evaluate(self) -> dict:
        limit = self.eval_limit()
        if limit == 0:
            return {}
        if self._eval_base is not self.executor:
            if self._eval_refused is None:
                self._eval_refused = self._joined_eval_refusal()
                if self._eval_refused:
                    self.warnings.append(self._eval_refused)
            if self._eval_refused:
                return {}
            if self._eval_base is None and self.rank == 0:  # (before the others send)
                self._eval_base = Executor(self.forward.bind(self.batch),
                                           self.executor.backend, self.opts.dtype,
                                           self.cfg.seed)
            items = self.state_items()
            if items is None:
                return {}
            self._eval_base.load_state_items(items)
        test = Split(self.data.test.take(slice(0, limit)))
        out = eval_pass(self._eval_base, self.forward, self.data.input_names, test,
                        self.batch, self.acc, self._eval_execs,
                        getattr(self.cb, "on_eval_progress", None))
        return {"step": self.step, "eval_samples": limit,
                **{f"test_{k}": v for k, v in out.items()}}

    def _joined_eval_refusal(self) -> str:
        """Where the state is split (over MPI, or in shards) rank 0 evaluates with an
        executor of the whole forward graph, into which the state is joined entry by
        entry: why that cannot fit in what is free on its machine now ("" if it can).
        Over MPI decided on rank 0 and sent to every rank, since all of them take part in
        the gather. (resnet2504 over two ranks trained its step and was then killed by the
        kernel's OOM killer in this evaluation, the run lost.)"""
        why = ""
        if self.rank == 0:
            g = self.forward.bind(self.batch)
            roles = tuple(r for r in ("output", "loss") if r in g.outputs)
            plan = make_plan(g, roles, self.opts.dtype)
            # the eval executor's state and forward pass, and the entry on its way in
            need = plan.peak_bytes + max((value_bytes(n.type, self.opts.dtype)
                                          for n in g.nodes if n.op in STATE_OPS), default=0)
            free = room.available_bytes(self.executor.backend)
            if free is not None and need > free:
                why = (f"evaluation skipped: it runs the whole model, joined from every "
                       f"{'rank' if self.opts.distributed else 'device'} of the split, "
                       f"which needs about {room.gib(need)} "
                       f"(its parameters and the forward pass at batch {self.batch}), "
                       f"but {room.gib(free)} is free on its machine; use --eval-samples 0 not "
                       "to evaluate, or evaluate a checkpoint afterwards with `netdsl eval`")
        if not self.opts.distributed:
            return why
        from netdsl.runtime.mpi import bcast
        return bcast(why)

    def fit(self) -> RunResult:
        # NumPy's RuntimeWarnings (overflow, invalid value) are not for the user: a
        # non-finite loss or logits stops the run with one message naming the first node.
        # The backend's thread set-up (NumPy's BLAS at one thread while the fused kernels'
        # threads do the GEMMs) is held for the whole run, not only inside each step: a
        # BLAS call between steps (synthetic data's labels) woke OpenBLAS's threads, which
        # then spun into the next step and took a core from it (MobileNetV2 b8, two
        # threads, netdsl_step.py --fit: 512-519 -> 437-457 ms a step)
        with np.errstate(all="ignore"), warnings.catch_warnings(), \
                self.executor.backend.running():
            warnings.simplefilter("ignore", RuntimeWarning)
            try:
                return self._fit()
            except MemoryError:
                raise room.out_of_memory(self.planned_peak_bytes(), self.executor.backend,
                                         self.batch, f"at step {self.step + 1}") from None

    def _open_log(self):
        """The log to append to. On resume it goes on from the checkpoint's step: lines of
        later steps (written by the run after its last checkpoint, then lost with it) and
        a line torn by a kill are dropped first, so each step is in it once (TensorBoard's
        purge_step); the file is rewritten atomically."""
        path = Path(self.opts.log)
        if self.opts.resume and path.exists():
            kept = []
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("step"), int) \
                        and rec["step"] <= self.step:
                    kept.append(line + "\n")
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text("".join(kept), encoding="utf-8")
            os.replace(tmp, path)
        return open(path, "a" if self.opts.resume else "w", encoding="utf-8")

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

    def _fit(self) -> RunResult:
        if self.opts.resume:
            self.restore()
            if self.step >= self.total:
                return self._nothing_to_do()
        be = self.executor.backend
        info = {"warnings": list(self.warnings),
                "network": self.forward.name, "params": self.stats.params,
                "backend": be.name, "device": _device_name(be), "batch": self.batch,
                "total_steps": self.total, "start_step": self.step,
                "planned_peak_bytes": self.planned_peak_bytes(), "dataset": self.data.name,
                "train_samples": len(self.data.train), "budget_bytes": self.budget,
                "memory_plan": self._plan_summary(), "split": self.split}
        self.cb.on_start(info)
        log = self._open_log() if self.opts.log and self.rank == 0 else None
        times, losses = [], []
        last_eval: dict = {}
        train_acc = None
        lr_base = self.cfg.optimizer.lr
        labels_at = self.data.input_names.index(self.acc[1]) if self.acc else None
        # the peak is measured by the backend (tracemalloc, the CuPy pool), not counted,
        # over the first METERED_STEPS steps
        meter = be.memory_meter()
        meter.__enter__()
        metering = True
        # the handlers stay through the final save: a first signal then lets it finish (over
        # MPI a rank can get Ctrl-C after the ranks agreed to stop; StopRequest)
        stop = StopRequest()
        with stop:
            try:
                while self.step < self.total:
                    arrays = self.loader.next(self._fed)
                    lr = lr_at(self.cfg.schedule, lr_base, self.step, self.total)
                    lr_value = np.dtype(NUMPY_DTYPE[self.opts.dtype]).type(lr)
                    feeds = self.feeds(arrays)
                    feeds["lr"] = lr_value  # at the executor's dtype: f64 runs used to get f32
                    t0 = time.perf_counter()
                    try:
                        out = self.executor.run(feeds, training=True, roles=self.ROLES,
                                                step=self.step)
                    except NonFinite as e:
                        raise self._non_finite(e, feeds, lr) from None
                    # over MPI the loss (and the logits) live on rank 0
                    loss = float(be.to_host(out["loss"][0])) if "loss" in out else float("nan")
                    be.synchronize()
                    dt = time.perf_counter() - t0
                    self.step += 1
                    times.append(dt)
                    losses.append(loss)
                    rec = {"step": self.step, "loss": loss, "lr": lr,
                           "images_per_s": self.batch / dt, "step_time_s": dt,
                           "epoch": self.loader.epoch}
                    if labels_at is not None and "logits" in out:
                        c, k = accuracy(be.to_host(out["logits"][0]), self.acc[2],
                                        arrays[labels_at])
                        if k:
                            train_acc = c / k
                            rec["accuracy"] = train_acc
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
                    if metering and len(times) == METERED_STEPS:  # its evaluation and save too
                        meter.__exit__(None, None, None)
                        metering = False
                    if self._stop_requested(stop):
                        break
            finally:
                if metering:
                    meter.__exit__(None, None, None)
                if log:
                    log.close()
            interrupted = stop.agreed  # (over MPI: every rank's, after the last step)
            every = self.opts.checkpoint_every
            just_saved = bool(losses) and bool(every) and self.step % every == 0
            if self.opts.checkpoint and not just_saved:  # the final state, once
                self.save()
        final_eval = (self.evaluate() if self.data.test is not None and not interrupted
                      else {})
        steady = times[METERED_STEPS:] or times[1:] or times  # (the metered steps run slower)
        ips = self.batch / statistics.median(steady) if steady else 0.0
        result = RunResult(
            network=self.forward.name, steps=self.step,
            final_loss=losses[-1] if losses else float("nan"), images_per_s=ips,
            peak_bytes=self._measured_peak(meter), params=self.stats.params, backend=be.name,
            device=_device_name(be), batch=self.batch,
            planned_peak_bytes=self.planned_peak_bytes(),
            counted_peak_bytes=self.executor.peak_bytes, budget_bytes=self.budget,
            split=self.split, peak_by_device=dict(sorted(self.executor.peak_by_device.items())),
            planned_peak_by_device=self._planned_by_device(),
            comm_bytes_per_step={d: b // max(len(losses), 1) for d, b in
                                 sorted(self.executor.comm.sent_bytes.items())},
            host_peak_bytes=self.executor.host_peak_bytes,
            memory_plan=self._plan_summary(),
            step_time_s=statistics.median(steady) if steady else 0.0,
            test_accuracy=final_eval.get("test_accuracy"),
            test_loss=final_eval.get("test_loss"), train_accuracy=train_acc,
            resumed_from=self.resumed_from, losses=losses, interrupted=interrupted,
            note=self._interrupted_note(interrupted),
            warnings=list(self.warnings) + self._replay_warnings())
        self.cb.on_end(result)
        return result

    def _interrupted_note(self, signal_name: str | None) -> str | None:
        if signal_name is None:
            return None
        saved = (f"the checkpoint in {self.opts.checkpoint} holds it: --resume goes on from "
                 "there" if self.opts.checkpoint else "nothing was saved (no --checkpoint)")
        return f"stopped by {signal_name} after step {self.step} of {self.total}; {saved}"

    def _replay_warnings(self) -> list[str]:
        """NETDSL_CUDA_GRAPH=1: the kinds of run that were not replayed, and why."""
        rep = self.executor.replay
        if rep is None:
            return []
        return [f"NETDSL_CUDA_GRAPH: {'training' if training else 'evaluation'} runs were not "
                f"recorded as a CUDA graph: {why}" for (_, training), why in rep.reasons.items()]

    def _non_finite(self, e: NonFinite, feeds: dict, lr: float) -> NetdslError:
        """The loss or logits of step `self.step + 1` went NaN/Inf; the step stopped before
        its updates, so replaying it with --check-numerics finds the first such node."""
        what = "loss" if e.node in self.forward.outputs.get("loss", []) else "logits"
        head = f"the {what} became NaN or Inf at step {self.step + 1} (lr {lr:g})"
        try:  # the same step number: the same dropout masks
            self.executor.with_graph(self.train_graph, check_numerics=True).run(
                feeds, training=True, roles=("loss",), step=self.step)
        except NetdslError as found:
            if not isinstance(found, NonFinite):
                where = found.message.removeprefix("check-numerics: ")
                return NetdslError(f"{head}: the first non-finite value: {where}; lower the "
                                   "learning rate, or check the data and the initialisation",
                                   loc=found.loc, stack=found.diagnostics[0].stack)
        return NetdslError(f"{head}; lower the learning rate or run with --check-numerics")

    def _nothing_to_do(self) -> RunResult:
        """A resumed run already at (or past) its last step: say so, train nothing."""
        be = self.executor.backend
        result = RunResult(
            network=self.forward.name, steps=self.step, final_loss=None, images_per_s=0.0,
            peak_bytes=0, params=self.stats.params, backend=be.name,
            device=_device_name(be), batch=self.batch,
            planned_peak_bytes=self.planned_peak_bytes(), budget_bytes=self.budget,
            step_time_s=0.0, resumed_from=self.resumed_from,
            note=f"the checkpoint is at step {self.step}, already at or past the "
                 f"{self.total} steps asked for; nothing to train (raise --steps to go on)",
            warnings=list(self.warnings))
        self.cb.on_end(result)
        return result

    def planned_peak_bytes(self) -> int:
        """The step's peak as its storage plan predicts it before running. The executor's
        count equals it (both follow one schedule and one rule); in an arena run it is the
        state, the largest transient and the packed arena, which the count stays under by
        the arena's fragmentation, plus, in unified memory, what a run holds besides the
        plan (the batch, the interpreter's objects: `memory.plan.unplanned_bytes`)."""
        if not hasattr(self, "executor"):  # failed before the executor existed
            return make_plan(self.train_graph, self.ROLES, self.opts.dtype,
                             pack_arena=False).peak_bytes
        plan = self.executor.plan(self.ROLES)
        if not self.executor.arena:
            return plan.peak_bytes
        # an arena run holds the packed arena, not just the bytes alive at the peak
        return plan.arena_peak_bytes + self.mem_plan.outside_plan_bytes

    def _planned_by_device(self) -> dict[int, int]:
        """The storage plan's peak of each device of a split step (the one accounting rule,
        `memory.plan.device_peaks`, which the executor's `peak_by_device` follows)."""
        if self.opts.devices == 1 or self.opts.distributed:
            return {}
        return device_peaks(self.train_graph, self.executor.plan(self.ROLES))

    def _plan_summary(self) -> dict | None:
        """What the memory planner decided (`run --mem`), for the log and --json."""
        p = self.mem_plan
        if p is None:
            return None
        if self.split_plan is not None:  # a split step, planned per device
            return self.split_plan
        return {"strategy": p.strategy, "profile": p.profile.name, "budget": self.mem_from,
                "decisions": dict(p.counts), "predicted_overhead": p.predicted_overhead,
                "offload_bytes": p.offload_bytes, "recompute_flops": p.recompute_flops,
                "arena_bytes": self.executor.plan(self.ROLES).arena_bytes,
                "outside_plan_bytes": p.outside_plan_bytes, "plan_s": p.plan_s}

    def _measured_peak(self, meter) -> int:
        """The state's arrays (allocated before the steps) plus the steps' high-water mark."""
        return self._state_bytes() + meter.read()

    def _state_bytes(self) -> int:
        """The parameters' and optimizer state's arrays, allocated before the first step."""
        return sum(int(v.nbytes) for v in self.executor.state.values())


def _agree_on_the_step(step: Graph, split: str, rank: int) -> None:
    """Every rank builds the split step itself, from its own copy of the network file, the
    stdlib, the options and a --profile file; ranks that built different steps would wait
    on messages that never come or mix unrelated values, so they compare fingerprints
    first (an allgather of a digest) and all stop with the reason."""
    from netdsl.runtime.mpi import allgather
    rows = allgather((split, fingerprint(step)))
    if all(r == rows[0] for r in rows):
        return
    if rank != 0:
        raise NetdslError("the ranks built different training steps (rank 0 says which)")
    groups: dict[tuple[str, str], list[int]] = {}
    for r, row in enumerate(rows):
        groups.setdefault(row, []).append(r)

    def ranks(rs: list[int]) -> str:
        return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))
    if len({s for s, _ in rows}) > 1:
        said = "; ".join(f"{ranks(rs)} chose {s}" for (s, _), rs in groups.items())
    else:
        said = "; ".join(f"{ranks(rs)} built step {fp[:12]}"
                         for (_, fp), rs in groups.items()) + f", all {split}"
    raise NetdslError(
        f"the ranks built different training steps ({said}), which cannot run together: "
        "the network file, the files it imports, a --profile file or the options differ "
        "between them; give every rank the same ones (--split and --microbatches fix the "
        "split)")


def _roles(step: Graph) -> tuple[str, ...]:
    """The outputs a training step computes (the trainer's ROLES and those a split or a
    projection adds), which its storage plan keeps to the end of the step."""
    return tuple(r for r in (*Trainer.ROLES, "logits", "state_updates", "comm")
                 if r in step.outputs)


def _device_name(be) -> str:
    if be.name == "numpy":
        return "cpu"
    return f"cuda:{be.device}"
