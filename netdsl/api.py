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
    from netdsl.runtime.trainer import RunOptions, Trainer
    return Trainer(net.graph, net.train, options or RunOptions(), callback).fit()


def plan(net: Network, mem: int | str, batch: int | None = None,
         profile: str = "k40-12gb", strategy: str = "auto", float_dtype: str = "f32",
         prefetch: int | None = None, progress=None, verify: bool = True,
         offload_state: bool = False):
    """Plan `net`'s training step at `batch` into `mem` bytes ("12GB" works) on a device
    `profile`; returns a `netdsl.memory.search.PlanResult` (`feasible` says whether it
    fits). With `verify`, the decisions are applied (`memory.strategies.apply_decisions`)
    and the storage plan of the rewritten step (`memory.plan.make_plan`) gives
    `verified_peak_bytes`; were it over the budget, the search is run again with the
    budget lowered by the excess (`memory.search.plan_and_apply`). Raises NetdslError for
    bad sizes, profiles or strategies."""
    from netdsl.memory.search import plan_and_apply
    from netdsl.runtime.trainer import training_graph
    b = batch if batch is not None else net.default_batch
    step = training_graph(net.lower(b), net.train or TrainConfig())
    _, res = plan_and_apply(step, mem, profile, strategy, float_dtype, prefetch=prefetch,
                            progress=progress, offload_state=offload_state, verify=verify)
    return res
