"""Choosing a split: the `--strategy` of `netdsl split` and `netdsl run --devices`.

`choose` builds each candidate split step that `candidates.py` proposes, predicts its
step time and per-device peak (`predict.report`), drops those that do not fit a device
(`--mem`, else the profile's capacity), and picks the fastest. The alternatives are kept,
so the command can show what it considered. Which candidates it builds, in which rounds,
and which it may skip or plan is the policy of `candidates.py`; this module is the
mechanism that carries it out, in this process or shared out among processes.

With `plan=True` (`--mem`), a candidate that does not fit is planned per device
(`memplan.plan_split`: recompute and offload on each device) and fits if the plan does;
its report is that of the planned step, so its predicted time counts the clones and the
host copies. Only the chosen candidate's graph is kept.

Over MPI (`Share`) the ranks share the work out: each builds and predicts its share of
each round (by estimated work, `Share.mine`), and plans one of each wave of `size`; they
exchange the figures (allgather), so every rank makes the choice one process makes alone,
from figures computed once, and builds the chosen step again only where another rank made
it. In one process, `jobs` worker processes share it out the same way (`fanout`; by
default one a core where the candidates are big enough to pay for starting them), and the
worker that made the chosen step sends it to the caller.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from netdsl.backends import host_memory
from netdsl.errors import SplitError
from netdsl.ir.bulk import gc_paused
from netdsl.ir.graph import Graph
from netdsl.memory.profiles import Profile
from netdsl.parallel import fanout
from netdsl.parallel.candidates import (
    ORDER_GAIN,
    Choice,
    ahead,
    beats,
    candidates,
    choice_reason,
    exact,
    families,
    has_batch_statistics,
    inexact_note,
    needless,
    other_orders,
    planning_order,
    prefers_exact,
    rounds,
    schedule_reason,
    weighs_orders,
    work_of,
)
from netdsl.parallel.predict import Interconnect, SplitReport, report, step_time
from netdsl.parallel.project import mark_over_mpi
from netdsl.parallel.split import SplitSpec, split_step
from netdsl.sizes import format_bytes

# `jobs` None: worker processes only where the forward nodes times the candidates reach
# this, about where a worker saves as much as it costs to start (resnet20 on four
# devices), one a core, at most MAX_AUTO_JOBS, and no more than the free host memory
# holds (`_process_bytes`)
FANOUT_MIN_WORK = 1000
MAX_AUTO_JOBS = 8
# An inexact candidate that cannot win (an exact split fits: `candidates.outclassed`) is
# still built, for the table of what auto considered, where it makes fewer forward node
# copies than this (resnet164's pipeline of four micro-batches makes about 5,500)
OUTCLASSED_MIN_WORK = 10_000
# What a process that builds candidates holds at most (resident): the interpreter, and
# about 5 kB a forward node for each copy of the network in the largest candidate (a
# pipeline's micro-batches, data or spatial parts, tensor shards). Fitted to measurements
# of resnet2504 and resnet164 candidates (docs/benchmarks.md); an upper bound where the
# rounds skip the largest micro-batch counts.
PROCESS_BASE_BYTES = 100 << 20
PROCESS_BYTES_PER_NODE_COPY = 5 << 10


@dataclass
class Chosen:
    best: Choice
    single: Graph
    considered: list[Choice] = field(default_factory=list)
    # candidates not built: more micro-batches of a pipeline already slower than a split
    # that fits (`candidates.past_its_best`), or inexact where an exact split fits
    # (`candidates.outclassed`)
    skipped: list[SplitSpec] = field(default_factory=list)
    # candidates that cannot be made, each "spec: why" (with a layer pinned by @device(k),
    # every scheme but a pipeline)
    unavailable: list[str] = field(default_factory=list)
    # said first where auto chose a split that changes the numbers (none exact fits)
    note: str | None = None
    # why auto chose a sharded or 3-D split (`candidates.choice_reason`), or ordered its
    # pipeline so (`candidates.schedule_reason`)
    reason: str | None = None


@dataclass(frozen=True)
class Share:
    """Ranks that choose a split together (`netdsl run --distributed`, `--jobs`): each
    builds and predicts (and with `--mem`, plans) its share of the candidates (`mine`),
    and they exchange what they found with `allgather` (every rank's object, in rank order), so
    that every rank chooses from the same figures, computed once. `needs_step` False: a
    rank that wants the figures only, not the chosen step (a worker process); `gather`
    (every rank's object on rank 0, None elsewhere), where only rank 0 needs the step:
    the rank that built it sends it there instead of rank 0 building it again."""

    rank: int
    size: int
    allgather: Callable[[Any], list]
    needs_step: bool = True
    gather: Callable[[Any], list | None] | None = None

    def mine(self, items: list, work: list[float]) -> list:
        """This rank's items: the largest `work` first, each to the rank with the least so
        far (ties to the lowest rank), so the ranks finish about together; every rank
        computes the same assignment."""
        load = [0.0] * self.size
        out = []
        for k in sorted(range(len(items)), key=lambda k: -work[k]):
            r = load.index(min(load))
            load[r] += work[k]
            if r == self.rank:
                out.append(items[k])
        return out

    def merged(self, found: dict) -> dict:
        return {k: v for part in self.allgather(found) for k, v in part.items()}


@dataclass(frozen=True)
class Request:
    """What `choose` chooses among and how it prices them: its parameters but those of
    the processes that do the work (`progress`, `share`, `jobs`)."""

    fwd: Graph
    batch: int
    strategy: str | None
    devices: int
    optimizer: dict
    profile: Profile
    link: Interconnect
    mem: int | None = None
    microbatches: int | None = None
    bn: str = "sync"
    gather: tuple[str, ...] = ()
    float_dtype: str = "f32"
    schedule: str | None = None
    plan: bool = False
    outputs: dict[str, list[str]] | None = None
    mem_strategy: str = "auto"
    over_mpi: bool = False
    precision: str = "f32"
    shard: int | None = None
    offload_state: bool = False  # plans may stream optimizer state from the hosts
    virtual_stages: int | None = None

    @property
    def prefer_exact(self) -> bool:
        """Whether exact splits rank first (`candidates.prefers_exact`)."""
        return prefers_exact(self.strategy, self.microbatches, self.bn,
                             dict(self.fwd.parallel), self.devices)

    def specs(self) -> list[SplitSpec]:
        """The candidates (`candidates.candidates`)."""
        return candidates(self.strategy, self.devices, self.batch, self.microbatches,
                          dict(self.fwd.parallel), self.bn, self.schedule,
                          any(n.op == "conv2d" for n in self.fwd.nodes), self.shard,
                          self.virtual_stages)

    def orders(self, best: SplitSpec) -> list[SplitSpec]:
        """The other orders auto weighs for the pipeline it chose (`other_orders`)."""
        if not weighs_orders(self.strategy, dict(self.fwd.parallel), self.devices,
                             self.schedule, self.virtual_stages):
            return []
        return other_orders(best, any("stage" in n.annotations or "device" in n.annotations
                                      for n in self.fwd.nodes))


def choose(fwd: Graph, batch: int, strategy: str | None, devices: int, optimizer: dict,
           profile: Profile, link: Interconnect, mem: int | None = None,
           microbatches: int | None = None, bn: str = "sync", gather: tuple[str, ...] = (),
           float_dtype: str = "f32", progress=None, schedule: str | None = None,
           plan: bool = False, outputs: dict[str, list[str]] | None = None,
           mem_strategy: str = "auto", over_mpi: bool = False,
           share: Share | None = None, jobs: int | None = None,
           precision: str = "f32", shard: int | None = None,
           offload_state: bool = False,
           virtual_stages: int | None = None) -> Chosen:
    """Build and predict the candidates (module docstring); raise SplitError if none fits.
    `outputs`: output roles to add to every split step (the trainer's logits); `over_mpi`:
    the step runs one process per device, whose sends MPI holds until the peer has them
    (`project.mark_over_mpi`: predicted and planned so); `share`: ranks that share the
    candidates out (`Share`; the choice and the chosen step are the ones each would have
    made alone); `jobs`: without `share`, the processes that share them so (this one and
    jobs - 1 workers; None: `_jobs`' default); `precision`: the steps' mixed precision;
    `offload_state`: plans may keep optimizer state in the hosts' memory."""
    return choose_request(Request(fwd, batch, strategy, devices, optimizer, profile, link,
                                  mem, microbatches, bn, gather, float_dtype, schedule, plan,
                                  outputs, mem_strategy, over_mpi, precision, shard,
                                  offload_state, virtual_stages),
                          progress, share, jobs)


def choose_request(request: Request, progress=None, share: Share | None = None,
                   jobs: int | None = None) -> Chosen:
    """`choose` of a `Request`."""
    specs = request.specs()
    n_jobs = 1 if share is not None else _jobs(jobs, len(specs), len(request.fwd.nodes),
                                               max(map(_copies, specs), default=1))
    if n_jobs == 1:
        return _choose(request, specs, share, progress)
    with fanout.workers(n_jobs, f"{__name__}:_helper", {"request": request}) as ex:
        return _choose(request, specs, Share(0, n_jobs, ex.allgather, gather=ex.gather),
                       progress)


def _helper(ex: fanout.Exchange, request: Request) -> None:
    """A worker process's part of `choose` (fanout): its share of the candidates, the
    figures sent to the caller, and the chosen step where it built it."""
    _choose(request, request.specs(), Share(ex.rank, ex.size, ex.allgather,
                                            needs_step=False, gather=ex.gather), None)


@gc_paused()  # (builds and drops whole split steps: netdsl.ir.bulk)
def _choose(request: Request, specs: list[SplitSpec], share: Share | None,
            progress) -> Chosen:
    """This process's part of the choice among `specs`, with the ranks of `share`."""
    run = _Run.start(request, specs, _agreed(share, specs), progress)
    inexact = run.ranked_inexact()
    # the exact candidates built (and planned) first: where one fits, no big inexact one
    # could win, and none is built (`candidates.outclassed`)
    taken, found = run.predict(inexact, deferred=bool(inexact))
    if request.plan:
        run.plan_unfitting(_considered(taken, found), exact_only=bool(inexact))
    if inexact and not (run.best is not None and run.best.ranks_exact):
        taken, found = run.predict(inexact, found=found)
        if request.plan:
            run.plan_unfitting(_considered(taken, found))
    considered = _considered(taken, found)
    errors = [c for k in sorted(taken) if isinstance(c := found[k], str)]
    orders = run.weigh_orders()
    run.fetch_chosen()
    if run.best is None:
        raise _no_fit(considered, errors, request.devices, run.cap)
    skipped = [specs[k] for k in range(len(specs)) if k not in taken]
    note = None if run.best.exact or not request.prefer_exact else inexact_note(run.best,
                                                                                 run.cap)
    return Chosen(run.best, run.single, considered, skipped, errors, note,
                  choice_reason(run.best, considered, run.cap, request.plan)
                  or schedule_reason(run.best, considered + orders))


def _considered(taken: set[int], found: dict[int, Choice | str]) -> list[Choice]:
    """The candidates taken that were made, in the specs' order."""
    return [c for k in sorted(taken) if not isinstance(c := found[k], str)]


def _agreed(share: Share | None, specs: list[SplitSpec]) -> Share | None:
    """`share` where its ranks share the work out, else None (this rank chooses alone)."""
    if share is None or share.size <= 1:
        return None
    # ranks share only the same candidates (one candidate: every rank needs its step
    # anyway); ranks with other files or options choose alone, and the check of the
    # steps they built (trainer) says how they differ instead of a mixed choice. Every
    # rank takes part in the exchange, whatever its own candidates: one that skipped
    # it would leave the others waiting
    names = [spec.describe() for spec in specs]
    if any(x != names for x in share.allgather(names)) or len(specs) < 2:
        return None
    return share


@dataclass
class _Run:
    """One rank's part in a choice: the candidates it builds, predicts and plans, the
    figures it exchanges with the other ranks (`share`; None: this process alone), and
    the best so far, the only candidate whose graph it keeps (a deep network's split
    step is gigabytes; another is built again to be planned)."""

    request: Request
    specs: list[SplitSpec]
    share: Share | None
    progress: Callable[[float], Any] | None
    device: str  # the kernels' fusions of the device the profile describes
    single: Graph  # the single-device step
    single_step: float  # its predicted time, once, for every speed-up
    cap: int  # the bytes a device holds
    best: Choice | None = None  # the fastest candidate that fits so far
    local: dict[SplitSpec, Graph] = field(default_factory=dict)  # its graph, if here

    @classmethod
    def start(cls, request: Request, specs: list[SplitSpec], share: Share | None,
              progress) -> _Run:
        r = request
        device = "cpu" if r.profile.unified else "gpu"  # (a unified device: a CPU)
        single = split_step(r.fwd, r.batch, SplitSpec(), r.optimizer, r.gather, device=device,
                            precision=r.precision)
        return cls(r, specs, share, progress, device, single,
                   step_time(single, r.profile, r.link, r.float_dtype),
                   r.mem if r.mem is not None else r.profile.capacity_bytes)

    @property
    def width(self) -> int:
        """The ranks that share the work."""
        return self.share.size if self.share else 1

    def build(self, spec: SplitSpec) -> Graph:
        r = self.request
        # the shape rules are checked on the chosen step alone (`fetch_chosen`): a
        # candidate's verify checks its structure, its metadata and its effects
        g = split_step(r.fwd, r.batch, spec, r.optimizer, r.gather, profile=r.profile,
                       device=self.device, precision=r.precision,
                       recheck_shapes=False)
        g.outputs.update(r.outputs or {})
        return mark_over_mpi(g) if r.over_mpi else g

    def evaluate(self, spec: SplitSpec) -> Choice | str:
        """The candidate built and predicted, or why it cannot be made."""
        try:
            g = self.build(spec)
        except SplitError as e:
            if len(self.specs) == 1:
                raise
            return f"{spec.describe()}: {e.message}"
        r = self.request
        rep, _ = report(g, self.single_step, r.profile, r.link, r.float_dtype)
        same = exact(spec, has_batch_statistics(r.fwd))
        return Choice(spec, g, rep, _fits(rep, self.cap), exact=same,
                      ranks_exact=same or not r.prefer_exact)

    def ranked_inexact(self) -> frozenset[int]:
        """The places of the candidates that rank with the inexact splits (`evaluate`'s
        `ranks_exact`, known before they are built) and that `rounds` leaves out once an
        exact split fits: those that make OUTCLASSED_MIN_WORK forward node copies or
        more (smaller ones are built for the table of what was considered)."""
        r = self.request
        if not r.prefer_exact:
            return frozenset()
        stats, n = has_batch_statistics(r.fwd), len(r.fwd.nodes)
        return frozenset(k for k, spec in enumerate(self.specs)
                         if not exact(spec, stats) and n * _copies(spec) >= OUTCLASSED_MIN_WORK)

    def keep_if_best(self, c: Choice, others: list = ()) -> None:
        """Make `c` the best if it fits and is faster (and is not a needless shard stage
        of a data split among `others`); only the best keeps its graph."""
        if c.fits and beats(c, self.best) and not needless(c, others, self.request.plan):
            if self.best is not None:
                self.best.graph = None
            self.local.clear()
            self.best = c
            if c.graph is not None:
                self.local[c.spec] = c.graph
        elif c is not self.best:
            c.graph = None

    def predict(self, inexact: frozenset[int], deferred: bool = False,
                found: dict[int, Choice | str] | None = None,
                ) -> tuple[set[int], dict[int, Choice | str]]:
        """Every rank's figures, round by round as `candidates.rounds` goes through them
        (`inexact`: `ranked_inexact`; `deferred`: none of them built; `found`: the figures
        so far); several ranks also build the next count of each of a round's families
        ahead (`candidates.ahead`: figures that `rounds` drops where it stops before them,
        so the choice, the figures and the skipped counts are those of one process).
        Between rounds the best is the best by `rounds`. Returns (the candidates taken,
        the figures by the candidates' places)."""
        work = [work_of(spec) for spec in self.specs]
        fams = families(self.specs)
        found = {} if found is None else found
        while True:
            taken, now, self.best = rounds(fams, found, self.request.plan, inexact, deferred)
            for spec in [x for x in self.local if self.best is None or x != self.best.spec]:
                del self.local[spec]
            if not now:
                return taken, found
            if self.width > 1:
                now += ahead(fams, found, now, work, self.width, inexact, deferred)
            found.update(self._round(now, work, len(found)))

    def _round(self, now: list[int], work: list[float], done: int) -> dict[int, Choice | str]:
        """This rank's share of candidates `now` built and predicted, then every rank's
        figures (`done`: the candidates with figures before, for `progress`)."""
        share, specs = self.share, self.specs
        got: dict[int, Choice | str] = {}
        for k in share.mine(now, [work[k] for k in now]) if share else now:
            if self.progress is not None:
                self.progress((done + len(got)) / len(specs))
            got[k] = c = self.evaluate(specs[k])
            if not isinstance(c, str) and not (self.request.plan and not c.fits
                                               and len(specs) == 1):
                # (a lone candidate that does not fit is planned from it)
                self.keep_if_best(c, list(got.values()))
        if share:  # every rank's figures, on every rank
            got = share.merged({k: c if isinstance(c, str) else replace(c, graph=None)
                                for k, c in got.items()})
        return got

    def plan_unfitting(self, considered: list[Choice], exact_only: bool = False) -> None:
        """Plan the candidates that do not fit in `candidates.planning_order`, each only if
        it would still beat the fastest that fits (so the choice is the fastest planned or
        unplanned step that fits, in the fewest plans), and none twice (`exact_only`: the
        candidates that rank with the exact splits alone); shared out, a wave of one a rank
        at a time, a plan taken only where it would have been made alone."""
        self._plan_in_turn([c for c in planning_order(considered) if not c.spec.shard
                            and c.memory is None and (c.ranks_exact or not exact_only)],
                           considered)
        # the data split's shard stages where it did not fit even planned
        sharded = [c for c in considered if c.spec.shard and not needless(c, considered, True)]
        for c in sharded:
            if c.fits:
                self.keep_if_best(c, considered)
        self._plan_in_turn(sorted((c for c in planning_order(sharded) if c.memory is None),
                                  key=lambda c: c.spec.shard), considered)

    def _plan_in_turn(self, queue: list[Choice], considered: list[Choice]) -> None:
        """`plan_unfitting` of the candidates `queue`, in its order: a shard stage once the
        stages below it are planned and do not fit (`candidates.needless`)."""
        r, req = self.share.rank if self.share else 0, self.request
        while True:
            queue = [c for c in queue if beats(c, self.best)]
            ready = [c for c in queue if not needless(c, considered, True)]
            if not ready:
                return
            wave = ready[:self.width]
            queue = [c for c in queue if all(c is not w for w in wave)]
            ours = wave[r] if r < len(wave) else None
            g, res, rep = (None, None, None) if ours is None else _plan(
                ours.graph if ours.graph is not None else self.build(ours.spec), self.cap,
                self.single_step, req.profile, req.link, req.float_dtype, req.mem_strategy,
                req.offload_state)
            plans = {} if ours is None else {r: (res, rep)}
            if self.share:
                plans = self.share.merged(plans)
            for j, c in enumerate(wave):
                if beats(c, self.best):
                    _take_plan(c, *plans[j], self.cap, g if j == r else None)
                    self.keep_if_best(c, considered)

    def weigh_orders(self) -> list[Choice]:
        """The other orders of the pipeline chosen (`Request.orders`: ZB-H1, interleaved),
        each built and predicted here (every rank alike) and chosen where it fits and is
        predicted ORDER_GAIN faster than 1F1B; a planned choice keeps its order (another
        would need a plan of its own).
        A worker process (`Share.needs_step` False) leaves it to the caller, which has
        the graph of whichever it chooses."""
        best = self.best
        if best is None or best.memory is not None or (
                self.share is not None and not self.share.needs_step):
            return []
        out = []
        bar = (1 - ORDER_GAIN) * best.report.predicted_step_s
        for spec in self.request.orders(best.spec):
            try:
                g = self.build(spec)
            except SplitError:  # (a network too short for 2 chunks a stage)
                continue
            r = self.request
            rep, _ = report(g, self.single_step, r.profile, r.link, r.float_dtype)
            c = Choice(spec, g, rep, _fits(rep, self.cap), exact=best.exact,
                       ranks_exact=best.ranks_exact)
            out.append(c)
            if rep.predicted_step_s <= bar:
                self.keep_if_best(c)
        return out

    def fetch_chosen(self) -> None:
        """The chosen step's graph: from the rank that built it where only rank 0 needs
        it (`Share.gather`), else built again where the choice was made from figures
        (another rank's, or this one's made before an exchange) and this rank needs it."""
        share, best = self.share, self.best
        if best is None:
            return
        if share is not None and share.gather is not None:
            # (every rank: the same condition) the chosen step from the rank that has it
            sent = share.gather(None if share.rank == 0 else self.local.get(best.spec))
            if share.rank == 0 and best.graph is None:
                best.graph = next((g for g in sent if g is not None), None)
        if best.graph is None and (share is None or share.needs_step):
            g = self.local.get(best.spec)
            best.graph = g if g is not None else _rebuild(self.build(best.spec), best.memory)
        if best.graph is not None:  # (every shape rule once, on the step chosen)
            best.graph.verify()


def _no_fit(considered: list[Choice], errors: list[str], devices: int,
            cap: int) -> SplitError:
    """The error when no candidate fits: why none could be made, or the least it needs."""
    if not considered:
        return SplitError("no split of this network works: " + "; ".join(errors))
    worst = min(considered, key=_least_peak)
    if worst.memory is not None:
        m = worst.memory
        return SplitError(
            f"no split onto {devices} device(s) fits {format_bytes(cap)} per device, "
            f"even with memory planning: the best ({worst.spec.describe()}) needs at "
            f"least {format_bytes(m.min_feasible_bytes)} ({m.min_feasible_bytes:,} "
            f"bytes) on device {m.worst_device} "
            f"({m.dominant or 'its persistent state'}); use more devices, a smaller "
            "batch, or more memory")
    peak = max(worst.report.per_device, key=lambda d: d.peak_bytes + d.outside_plan_bytes)
    return SplitError(
        f"no split onto {devices} device(s) fits {format_bytes(cap)} per device: the "
        f"best ({worst.spec.describe()}) needs "
        f"{format_bytes(peak.peak_bytes + peak.outside_plan_bytes)} on device "
        f"{peak.device}; use more devices, a smaller batch, or more memory")


def _jobs(jobs: int | None, n_specs: int, n_nodes: int, copies: int = 1) -> int:
    """The processes to share `n_specs` candidates of an `n_nodes`-node network among, the
    largest making `copies` copies of it."""
    if jobs is None:
        if n_nodes * n_specs < FANOUT_MIN_WORK:
            return 1
        jobs = min(fanout.cores(), MAX_AUTO_JOBS)
        free = host_memory.available_bytes()
        if free is not None:  # the caller builds candidates too
            jobs = max(1, min(jobs, free // _process_bytes(n_nodes, copies)))
    if jobs < 1:
        raise SplitError(f"--jobs must be at least 1, not {jobs}")
    return min(jobs, max(n_specs, 1))


def _process_bytes(n_nodes: int, copies: int) -> int:
    """What a process building candidates holds at most (PROCESS_BYTES_PER_NODE_COPY)."""
    return PROCESS_BASE_BYTES + PROCESS_BYTES_PER_NODE_COPY * n_nodes * copies


def _copies(spec: SplitSpec) -> int:
    """The copies of the network a candidate's step makes (as `_process_bytes` counts)."""
    return spec.microbatches * spec.data * spec.spatial * spec.tensor


def _least_peak(c: Choice) -> int:
    """The smallest budget a candidate fits (planned, where it was): its largest device
    peak with what that device's process holds besides it (over MPI)."""
    if c.memory is not None:
        return c.memory.min_feasible_bytes
    return max(d.peak_bytes + d.outside_plan_bytes for d in c.report.per_device)


def _fits(rep: SplitReport, cap: int) -> bool:
    return all(d.peak_bytes + d.outside_plan_bytes <= cap for d in rep.per_device)


def _plan(g: Graph, cap: int, single_step: float, profile: Profile, link: Interconnect,
          float_dtype: str, strategy: str = "auto", offload_state: bool = False) -> tuple:
    """Candidate step `g` planned per device into `cap` bytes: (the planned step, the plan
    without its search state, the planned step's report), or (None, the plan, None)."""
    from netdsl.parallel.memplan import plan_split
    planned, res = plan_split(g, cap, profile, float_dtype, strategy,
                              offload_state=offload_state)
    res = replace(res, prep=None, sim=None, baseline_sim=None, storage=None)  # (sent)
    if planned is None:
        return None, res, None
    return planned, res, report(planned, single_step, profile, link, float_dtype)[0]


def _take_plan(c: Choice, res, rep: SplitReport | None, cap: int,
               graph: Graph | None = None) -> None:
    """Candidate `c` as planned (`_plan`): the planned step and its report where a plan
    fits (`graph` None: built again if it is chosen, `_rebuild`)."""
    c.memory = res
    c.unplanned_step_s = c.report.predicted_step_s
    c.unplanned_peak_bytes = max(d.peak_bytes for d in c.report.per_device)
    c.graph = None
    if rep is not None:
        c.graph, c.report, c.fits = graph, rep, _fits(rep, cap)


def _rebuild(g: Graph, res) -> Graph:
    """A candidate's step as chosen, from its split step built again: planned (`res`,
    the plan, or None) as plan_split rewrote it, by the plan's decisions."""
    if res is None:
        return g
    from netdsl.memory.strategies import apply_decisions
    planned = apply_decisions(g, res.decisions, prefetch=res.prefetch)
    planned.meta["split"] = dict(g.meta.get("split", {}))
    return planned
