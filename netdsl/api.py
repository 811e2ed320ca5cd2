"""The Python API behind the CLI.

    import netdsl
    net = netdsl.load("examples/resnet50.net")   # parse, import, check; NetdslError if bad
    g = net.lower(batch=16)                      # verified forward graph, batch bound
    g.to_text()                                  # the readable IR
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from netdsl.config import TrainConfig
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
    """A data path in the file (`npz(path="data.npz")`) means next to that file, as an
    import does, not in whatever folder netdsl runs from."""
    if train is None or train.data.kind != "npz" or Path(train.data.path).is_absolute() \
            or file.startswith("<"):
        return train
    path = str(Path(file).resolve().parent / train.data.path)
    return train.model_copy(update={"data": train.data.model_copy(update={"path": path})})


def train(net: Network, options=None, callback=None):
    """Train `net` as its `train` section says, with `options` (a RunOptions) overriding it.
    Returns a RunResult; raises NetdslError for bad data, checkpoints or settings."""
    from netdsl.runtime.options import RunOptions
    from netdsl.runtime.trainer import Trainer
    return Trainer(net.graph, net.train, options or RunOptions(), callback).fit()


def evaluate(net: Network, checkpoint: str | Path, batch: int | None = None,
             split: str = "test", samples: int | None = None, backend: str = "numpy",
             device: int | None = None, dtype: str = "f32", progress=None):
    """Evaluate `net` with the parameters and buffers of the checkpoint in `checkpoint`
    (a run's, or the weights `netdsl import` writes) on the `split` ("test" or "train")
    samples of its train section's data, in evaluation mode; returns a
    `netdsl.runtime.evaluate.EvalResult` (loss, accuracy, images/s). Raises NetdslError
    (CheckpointError for a missing, corrupt or mismatched checkpoint)."""
    from netdsl.runtime.evaluate import evaluate_checkpoint
    from netdsl.runtime.options import RunOptions, backend_for, check_options
    opts = RunOptions(backend=backend, device=device, dtype=dtype)
    check_options(opts)  # (its refusals: a dtype that is neither f32 nor f64)
    be = backend_for(opts)
    return evaluate_checkpoint(net.graph, net.train, checkpoint, batch=batch, split=split,
                               samples=samples, backend=be, dtype=dtype, progress=progress)


def plan(net: Network, mem: int | str | None = None, batch: int | None = None,
         profile: str = "k40-12gb", strategy: str = "auto", float_dtype: str = "f32",
         prefetch: int | None = None, progress=None, verify: bool = True,
         offload_state: bool = False, microbatches: int = 1):
    """Plan `net`'s training step at `batch` into `mem` bytes ("12GB" works; None: the
    profile's memory) on a device `profile`, its gradients accumulated over `microbatches`
    parts of the batch (`runtime.accumulate.accumulating_step`, as `run --microbatches`
    runs it); returns a `netdsl.memory.search.PlanResult`
    (`feasible` says whether it fits). With `verify`, the decisions are applied
    (`memory.strategies.apply_decisions`) and the storage plan of the rewritten step
    (`memory.plan.make_plan`) gives
    `verified_peak_bytes`; were it over the budget, the search is run again with the
    budget lowered by the excess (`memory.search.plan_and_apply`). Raises NetdslError for
    bad sizes, profiles or strategies."""
    from netdsl.memory.profiles import get_profile
    from netdsl.memory.search import plan_and_apply
    from netdsl.runtime.accumulate import accumulating_step
    from netdsl.runtime.trainer import training_graph
    b = batch if batch is not None else net.default_batch
    if mem is None:
        mem = get_profile(profile).capacity_bytes
    # a GPU's step (its kernels' variants, and their scratch) for a device profile, as
    # `run --backend cupy --mem` plans it; the CPU's for a unified one
    device = "cpu" if get_profile(profile).unified else "gpu"
    cfg = net.train or TrainConfig()
    if microbatches > 1:
        step = accumulating_step(net.graph, b, cfg, microbatches, device=device)
    else:
        step = training_graph(net.lower(b), cfg, device)
    # checked as `run --mem` runs the step: values packed into an arena
    _, res = plan_and_apply(step, mem, profile, strategy, float_dtype, arena=True,
                            prefetch=prefetch, progress=progress,
                            offload_state=offload_state, verify=verify)
    return res


def microbatches_to_fit(net: Network, failed, batch: int | None = None,
                        float_dtype: str = "f32", offload_state: bool = False,
                        microbatches: int = 1) -> int | None:
    """For a `plan` result that does not fit (`failed`, of the step at `batch` in
    `microbatches` parts), a larger count of micro-batches whose step a plan fits into
    the same budget, profile and strategy, or None
    (`runtime.accumulate.fewest_microbatches`: three plans at most)."""
    from netdsl.memory.search import plan_and_apply
    from netdsl.runtime.accumulate import fewest_microbatches
    b = batch if batch is not None else net.default_batch
    prof = failed.profile

    def fits(step):
        return plan_and_apply(step, failed.budget_bytes, prof, failed.strategy, float_dtype,
                              arena=True, offload_state=offload_state)[1]
    return fewest_microbatches(net.graph, b, net.train or TrainConfig(), failed, fits,
                               microbatches, "cpu" if prof.unified else "gpu", float_dtype)


@dataclass
class SplitResult:
    """What `split` decided and predicted, and the equivalence gate's result if run."""

    chosen: object  # netdsl.parallel.choose.Chosen
    batch: int
    gate: object | None = None  # netdsl.runtime.gate.GateResult
    mpi: bool = False  # predicted and planned as one process per device runs it

    def to_json(self) -> dict:
        best = self.chosen.best
        out = {"network": best.graph.name, "batch": self.batch, **best.report.to_json(),
               "spec": best.spec.describe(), "mpi": self.mpi,
               "alternatives": [{"spec": c.spec.describe(), "strategy": c.spec.name,
                                 "fits": c.fits, "planned": c.memory is not None
                                 and c.memory.feasible,
                                 "predicted_step_s": c.report.predicted_step_s,
                                 "predicted_speedup": c.report.predicted_speedup,
                                 "bubble": c.report.bubble,
                                 "max_peak_bytes": max(d.peak_bytes
                                                       for d in c.report.per_device)}
                                for c in self.chosen.considered],
               # not built: more micro-batches of a pipeline that could not win
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
          profile: str = "k40-12gb", interconnect: str = "pcie3", bn: str = "sync",
          verify: bool = False, seed: int = 0, progress=None,
          schedule: str | None = None, mpi: bool = False,
          jobs: int | None = None) -> SplitResult:
    """Split `net`'s training step over `devices` devices (`netdsl split`): the scheme
    `strategy` picks (auto: the fastest predicted that fits), its per-device table and
    predictions (strategy None: the file's `parallel { }`, else auto); with `verify`, the
    equivalence gate on one batch in float64. With `mem`, a split that does not fit a
    device is planned per device (recompute, offload: `parallel.memplan`). `mpi`: predict
    and plan the split as `run --distributed` runs it, one process per device, whose sends
    MPI holds until the peer has them (`project.mark_over_mpi`). `jobs`: processes that
    build and predict the candidates (None: one a core where they are big enough;
    `choose`). Raises SplitError (exit 3) for splits that cannot be made or do not fit."""
    from netdsl.memory.profiles import get_profile
    from netdsl.parallel.choose import choose
    from netdsl.parallel.predict import get_interconnect
    from netdsl.sizes import parse_size
    b = batch if batch is not None else net.default_batch
    cfg = net.train or TrainConfig()
    budget = parse_size(mem, "--mem") if mem is not None else None
    chosen = choose(net.graph, b, strategy, devices, cfg.optimizer.model_dump(),
                    get_profile(profile), get_interconnect(interconnect), budget,
                    microbatches, bn, progress=progress, schedule=schedule,
                    plan=budget is not None, over_mpi=mpi, jobs=jobs)
    result = SplitResult(chosen, b, mpi=mpi)
    if verify:
        from netdsl.runtime.data import Loader, make_dataset
        from netdsl.runtime.gate import verify_split
        data = make_dataset(net.graph, cfg.data, seed)
        feeds = dict(zip(data.input_names, Loader(data.train, b, seed).next(), strict=True))
        result.gate = verify_split(net.graph, b, chosen.best.spec, cfg.optimizer.model_dump(),
                                   feeds, split=chosen.best.graph, seed=seed)
    return result
