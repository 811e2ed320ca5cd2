"""The Python API behind the CLI.

    import netdsl
    net = netdsl.load("examples/resnet50.net")   # parse, import, check; NetdslError if bad
    g = net.lower(batch=16)                      # verified forward graph, batch bound
    g.to_text()                                  # the readable IR
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from netdsl.config import DATA_PATHS, TrainConfig
from netdsl.frontend import ModuleEnv, elaborate, load_module, train_config
from netdsl.ir.graph import Graph


@dataclass
class Network:
    """A checked network: its module, its train section, and its symbolic-batch graph."""

    module: ModuleEnv
    graph: Graph  # batch is the symbol N
    train: TrainConfig | None
    _bound: dict = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        return self.graph.name

    @property
    def file(self) -> str:
        return self.module.file

    @property
    def default_batch(self) -> int:
        return self.train.batch if self.train is not None else 1

    def lower(self, batch: int | None = None) -> Graph:
        """The forward graph; with `batch`, the symbolic N is replaced by that integer."""
        if batch is None:
            return self.graph
        if batch not in self._bound:
            self._bound[batch] = self.graph.bind(batch)
        return self._bound[batch]


def load(path: str | Path, network: str | None = None) -> Network:
    """Load and check a `.net` file; raises NetdslError with every problem found."""
    env = load_module(path)
    return _network(env, network)


def loads(text: str, file: str = "<string>", network: str | None = None) -> Network:
    """Like `load`, from source text (imports resolve relative to `file`)."""
    return _network(load_module(text=text, file=file), network)


def _network(env: ModuleEnv, network: str | None) -> Network:
    from netdsl.errors import NetdslError
    errors = []
    graph = train = None
    try:
        graph = elaborate(env, network)
    except NetdslError as e:
        errors += e.diagnostics
    try:
        train = train_config(env.tree.train)
    except NetdslError as e:
        errors += e.diagnostics
    if errors:
        raise NetdslError(diagnostics=errors)
    return Network(env, graph, _paths_relative_to(env.file, train))


def _paths_relative_to(file: str, train: TrainConfig | None) -> TrainConfig | None:
    """A data path in the file (`npz(path="data.npz")`, `images("train/")`) means next to
    that file, as an import does, not in whatever folder netdsl runs from."""
    if train is None or file.startswith("<"):
        return train
    here = Path(file).resolve().parent
    update = {}
    for part in ("data", "val"):
        data = getattr(train, part)
        fields = DATA_PATHS.get(data.kind, ()) if data is not None else ()
        moved = {k: str(here / getattr(data, k)) for k in fields
                 if getattr(data, k) is not None and not Path(getattr(data, k)).is_absolute()}
        if moved:
            update[part] = data.model_copy(update=moved)
    return train.model_copy(update=update) if update else train


def train(net: Network, options=None, callback=None):
    """Train `net` as its `train` section says, with `options` (a RunOptions) overriding it.
    Returns a RunResult; raises NetdslError for bad data, checkpoints or settings."""
    from netdsl.runtime.options import RunOptions
    from netdsl.runtime.trainer import Trainer
    return Trainer(net.graph, net.train, options or RunOptions(), callback).fit()


def describe_data(net: Network, batch: int | None = None, workers: int | None = None,
                  batches: int = 8, bad_images: str = "stop", png: str | Path | None = None,
                  progress=None):
    """What `net`'s training data is and how fast this machine loads `batches` batches of
    it (`netdsl data`): a `netdsl.runtime.data.inspect.DataReport`; `png`: a few samples
    as a picture there. Raises NetdslError for data that cannot be read."""
    from netdsl.options import RunOptions, conflicts
    from netdsl.runtime.data.inspect import describe
    from netdsl.step.request import resolve_config
    opts = RunOptions(batch=batch, workers=workers, bad_images=bad_images)
    conflicts(opts)
    return describe(net.graph, resolve_config(net.train, opts), workers, batches, bad_images,
                    None if png is None else str(png), progress)


def save_images(net: Network, folder: str | Path, progress=None) -> int:
    """Write `net`'s data (training then held-out samples) as an image folder that
    `images(folder)` reads (`netdsl data --save-images`); returns the count."""
    from netdsl.runtime.data.inspect import save_images as save
    from netdsl.step.request import resolve_config
    return save(net.graph, resolve_config(net.train, None), str(folder), progress)


def evaluate(net: Network, checkpoint: str | Path, batch: int | None = None,
             split: str = "test", samples: int | None = None, backend: str = "numpy",
             device: int | None = None, dtype: str = "f32", progress=None,
             precision: str | None = None):
    """Evaluate `net` with the parameters and buffers of the checkpoint in `checkpoint`
    (a run's, or the weights `netdsl import` writes) on the `split` ("test" or "train")
    samples of its train section's data, in evaluation mode; returns a
    `netdsl.runtime.evaluate.EvalResult` (loss, accuracy, images/s). Raises NetdslError
    (CheckpointError for a missing, corrupt or mismatched checkpoint). `precision`: the
    forward pass's mixed precision (None: the train section's)."""
    from netdsl.options import StepOptions, check_precision, conflicts
    from netdsl.runtime.evaluate import evaluate_checkpoint
    from netdsl.runtime.options import backend_for
    opts = StepOptions(backend=backend, device=device, dtype=dtype, precision=precision)
    conflicts(opts)  # (its refusals: a dtype that is neither f32 nor f64, f64 with bf16)
    if precision is None and net.train is not None:
        check_precision(net.train.precision, dtype, "the train section's precision")
    be = backend_for(opts)
    return evaluate_checkpoint(net.graph, net.train, checkpoint, batch=batch, split=split,
                               samples=samples, backend=be, dtype=dtype, progress=progress,
                               precision=precision)


def build(net: Network, options=None, *, runs: bool = False, mem_default: bool = False,
          progress=None, phase=None, **overrides):
    """The training step of `net` that `options` (a `netdsl.options.StepOptions`, or a
    RunOptions) ask for: `netdsl.step.build.build_step`, the one builder every command
    uses; returns the `Step`. `runs`: built to run in this process (its kernels are the
    backend's); `mem_default`: with no --mem, the profile's capacity is the budget;
    `overrides`: StepRequest fields (prefetch, verify_plan, fetch_logits, interconnect,
    over_mpi). Raises NetdslError for bad options, sizes, profiles or splits."""
    from netdsl.options import StepOptions, conflicts
    from netdsl.runtime.options import backend_for
    from netdsl.step.build import build_step
    from netdsl.step.request import request_for, resolve_config
    opts = options or StepOptions()
    warnings = conflicts(opts, budgeted=mem_default)
    cfg = resolve_config(net.train, opts)
    backend = backend_for(opts) if opts.backend != "numpy" else None
    req = request_for(opts, cfg, backend, runs=runs, mem_default=mem_default, **overrides)
    step = build_step(net.graph, cfg, req, progress=progress, phase=phase)
    step.warnings[:0] = warnings
    return step


def plan(net: Network, mem: int | str | None = None, batch: int | None = None,
         profile: str | None = None, strategy: str = "auto", float_dtype: str = "f32",
         prefetch: int | None = None, progress=None, verify: bool = True,
         offload_state: bool = False, microbatches: int | None = None,
         backend: str = "numpy", precision: str | None = None):
    """Plan `net`'s training step at `batch` into `mem` bytes ("12GB" works; None: the
    profile's memory) for a device `profile` (None: the device `backend` runs on), its
    gradients accumulated over `microbatches` parts of the batch (None: the file's), the
    step `run` would run (`build`); returns a `netdsl.memory.search.PlanResult`
    (`feasible` says whether it fits). With `verify`, the decisions are applied and the
    storage plan of the rewritten step gives `verified_peak_bytes`, the peak a run holds.
    `precision`: mixed precision (None: the train section's). Raises NetdslError for bad
    sizes, profiles or strategies."""
    return plan_step(net, mem, batch, profile, strategy, float_dtype, prefetch, progress,
                     verify, offload_state, microbatches, backend, precision).memory_plan


def plan_step(net: Network, mem: int | str | None = None, batch: int | None = None,
              profile: str | None = None, strategy: str = "auto", float_dtype: str = "f32",
              prefetch: int | None = None, progress=None, verify: bool = True,
              offload_state: bool = False, microbatches: int | None = None,
              backend: str = "numpy", precision: str | None = None):
    """`plan`'s step itself (a `netdsl.step.build.Step`, its `memory_plan` the plan)."""
    from netdsl.options import StepOptions
    opts = StepOptions(batch=batch, mem=mem, profile=profile, strategy=strategy,
                       dtype=float_dtype, offload_state=offload_state,
                       microbatches=microbatches, backend=backend, precision=precision)
    return build(net, opts, mem_default=True, progress=progress, prefetch=prefetch,
                 verify_plan=verify)


def microbatches_to_fit(step, phase=None) -> int | None:
    """For a planned step that does not fit (`plan_step`), a larger count of micro-batches
    whose step a plan fits into the same budget, profile and strategy, or None (three
    plans at most)."""
    from netdsl.step.build import microbatches_to_fit as fewest
    return fewest(step, phase)


@dataclass
class SplitResult:
    """What `split` decided and predicted, and the equivalence gate's result if run."""

    chosen: object  # netdsl.parallel.choose.Chosen
    batch: int
    gate: object | None = None  # netdsl.runtime.gate.GateResult
    mpi: bool = False  # predicted and planned as one process per device runs it
    profile: object | None = None  # the netdsl.memory.profiles.Profile predicted for
    warnings: list[str] = field(default_factory=list)  # options that did nothing
    precision: str = "f32"  # the step's mixed precision

    def to_json(self) -> dict:
        best = self.chosen.best
        out = {"network": best.graph.name, "batch": self.batch, **best.report.to_json(),
               "spec": best.spec.describe(), "mpi": self.mpi, "warnings": self.warnings,
               "exact": best.exact, "note": self.chosen.note, "precision": self.precision,
               "reason": self.chosen.reason,
               "alternatives": [{"spec": c.spec.describe(), "strategy": c.spec.name,
                                 "fits": c.fits, "exact": c.exact,
                                 "planned": c.memory is not None
                                 and c.memory.feasible,
                                 "predicted_step_s": c.report.predicted_step_s,
                                 "predicted_speedup": c.report.predicted_speedup,
                                 "bubble": c.report.bubble,
                                 "max_peak_bytes": max(d.peak_bytes
                                                       for d in c.report.per_device)}
                                for c in self.chosen.considered],
               # not built: more micro-batches of a pipeline that could not win (slower, or inexact
               # where an exact split fits)
               "skipped": [spec.describe() for spec in self.chosen.skipped],
               # cannot be made, with why
               "unavailable": list(self.chosen.unavailable)}
        out["memory_plan"] = None
        if best.memory is not None:  # planned per device (--mem): what each one does
            from netdsl.parallel.memplan import summary
            out["memory_plan"] = summary(best.memory, best.unplanned_step_s,
                                         best.unplanned_peak_bytes,
                                         best.report.predicted_step_s)
            for row in out["per_device"]:
                mine = best.memory.per_device.get(row["device"], {})
                for k in ("recompute", "recompute_bytes", "offload", "offload_bytes"):
                    row[k] = mine.get(k, 0)
        if self.gate is not None:
            out["verify"] = self.gate.to_json()
        return out


def split(net: Network, devices: int, strategy: str | None = None, batch: int | None = None,
          microbatches: int | None = None, mem: int | str | None = None,
          profile: str | None = None, interconnect: str = "pcie3", bn: str = "sync",
          verify: bool = False, seed: int = 0, progress=None,
          schedule: str | None = None, mpi: bool = False,
          jobs: int | None = None, backend: str = "numpy",
          precision: str | None = None, shard: int | None = None,
          offload_state: bool = False,
          virtual_stages: int | None = None) -> SplitResult:
    """Split `net`'s training step over `devices` devices (`netdsl split`): the scheme
    `strategy` picks (auto: the fastest predicted that fits), its per-device table and
    predictions (strategy None: the file's `parallel { }`, else auto), for a device
    `profile` (None: the device `backend` runs on); with `verify`, the equivalence gate
    on one batch in float64. With `mem`, a split that does not fit a device is planned
    per device (recompute, offload: `parallel.memplan`; `offload_state`: the optimizer
    state too, streamed from each device's host through its update). `mpi`: predict and plan the
    split as `run --distributed` runs it, one process per device, whose sends MPI holds
    until the peer has them. `jobs`: processes that build and predict the candidates
    (None: one a core where they are big enough); `precision`: mixed precision (None: the
    train section's). Raises SplitError (exit 3) for splits that cannot be made or do
    not fit."""
    from netdsl.options import StepOptions
    opts = StepOptions(batch=batch, mem=mem, profile=profile, devices=devices,
                       split=strategy, microbatches=microbatches, schedule=schedule, bn=bn,
                       interconnect=interconnect, jobs=jobs, backend=backend,
                       precision=precision, shard=shard, offload_state=offload_state,
                       virtual_stages=virtual_stages)
    step = build(net, opts, progress=progress, over_mpi=mpi, fetch_logits=False,
                 weigh_splits=True)
    chosen = step.chosen
    result = SplitResult(chosen, step.request.batch, mpi=mpi, profile=step.profile,
                         warnings=step.warnings, precision=step.request.precision)
    if verify:
        from netdsl.runtime.data import Loader, make_dataset
        from netdsl.runtime.gate import verify_split
        cfg, b = step.cfg, step.request.batch
        data = make_dataset(net.graph, cfg.data, seed, cfg)
        feeds = dict(zip(data.input_names, Loader(data.train, b, seed).next(), strict=True))
        # the gate checks the split's rewrite in float64, against the single-device step:
        # a mixed-precision step's split is checked as the same split of the f32 step
        same = step.request.precision == "f32"
        result.gate = verify_split(net.graph, b, chosen.best.spec, cfg.optimizer.model_dump(),
                                   feeds, split=chosen.best.graph if same else None,
                                   seed=seed)
    return result
