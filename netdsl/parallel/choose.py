"""Choosing a split: the `--strategy` of `netdsl split` and `netdsl run --devices`.

`data`, `pipeline`, `hybrid`, `tensor` and `spatial` are the schemes of `split.py`; `auto`
builds every data x pipeline factorisation of the device count (with micro-batch counts 1,
2, 4 ... up to the batch for pipelines), the tensor split and its data x tensor hybrids
and (for a network with convolutions) the spatial split and its data x spatial hybrids,
predicts each one's step time
and per-device peak (`predict.report`), drops those that do not fit a device (`--mem`,
else the profile's capacity), and picks the fastest. The alternatives are kept, so the
command can show what it considered. It builds them in rounds: a pipeline's micro-batch
counts in rising order, each only while it could still win (`_past_its_best`); the
counts not built are listed as skipped.

With `plan=True` (`--mem`), a candidate that does not fit is planned per device
(`memplan.plan_split`: recompute and offload on each device) and fits if the plan does;
its report is that of the planned step, so its predicted time counts the clones and the
host copies. Planning never makes a step faster, so the candidates that do not fit are
planned fastest first, each only while it would beat the fastest that fits: the choice is
the fastest step that fits, planned or not, in the fewest plans. Only the chosen
candidate's graph is kept.

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
from netdsl.config import MICROBATCHES_APPLY, ParallelConfig
from netdsl.errors import SplitError
from netdsl.ir.bulk import gc_paused
from netdsl.ir.graph import Graph
from netdsl.memory.profiles import Profile
from netdsl.parallel import fanout
from netdsl.parallel.predict import Interconnect, SplitReport, report, step_time
from netdsl.parallel.project import mark_over_mpi
from netdsl.parallel.split import SplitSpec, split_step
from netdsl.sizes import format_decimal

CHOICES = ("auto", "data", "pipeline", "hybrid", "tensor", "spatial")

# `jobs` None: worker processes only where the forward nodes times the candidates reach
# this (resnet20's 183 x 13, about the break-even: 1.8-2.2 s with or without a worker, on
# four devices; mobilenet_v2's 418 x 10, 5.2 -> 4.7 s), one a core, at most MAX_AUTO_JOBS,
# and no more than the free host memory holds (`_process_bytes`)
FANOUT_MIN_WORK = 1000
MAX_AUTO_JOBS = 8
# What a process that builds candidates holds at most (resident): the interpreter, and
# about 5 kB a forward node for each copy of the network in the largest candidate (a
# pipeline's micro-batches, data or spatial parts, tensor shards). Measured: resnet2504 at
# batch 16 on 4 devices (16 micro-batches), a worker 1.65 GB and the caller 2.20 GB
# against 1.77 GB estimated; resnet164 (128 micro-batches, the largest counts skipped by
# the rounds) 0.21 GB against 0.98 GB.
PROCESS_BASE_BYTES = 100 << 20
PROCESS_BYTES_PER_NODE_COPY = 5 << 10


@dataclass
class Choice:
    spec: SplitSpec
    graph: Graph
    report: SplitReport
    fits: bool
    memory: object | None = None  # memory.search.PlanResult, when planned per device
    unplanned_step_s: float | None = None  # the predicted step before planning
    unplanned_peak_bytes: int | None = None  # ... and its largest device peak


@dataclass
class Chosen:
    best: Choice
    single: Graph
    considered: list[Choice] = field(default_factory=list)
    # candidates not built: more micro-batches of a pipeline already slower than a split
    # that fits (`_past_its_best`)
    skipped: list[SplitSpec] = field(default_factory=list)
    # candidates that cannot be made, each "spec: why" (with a layer pinned by @device(k),
    # every scheme but a pipeline)
    unavailable: list[str] = field(default_factory=list)


def candidates(strategy: str | None, devices: int, batch: int, microbatches: int | None,
               declared: dict, bn: str, schedule: str | None = None,
               has_conv: bool = False) -> list[SplitSpec]:
    """The specs `strategy` allows on `devices` devices (pipelines in `schedule` order,
    else the file's `parallel { schedule = ... }`, else GPipe's; `has_conv`: the network
    has 2-d convolutions, which a spatial split cuts)."""
    # auto prefers 1F1B: the same bubble as GPipe with fewer activations alive
    sched = schedule or declared.get("schedule") or ("1f1b" if strategy == "auto"
                                                     else "gpipe")
    if sched not in ("gpipe", "1f1b"):
        raise SplitError(f"--schedule must be gpipe or 1f1b, not {sched!r}")
    if strategy is None:  # the file's `parallel { }` if it declares devices, else auto
        d, p, t, s = (declared.get(k, 1) for k in ("data", "pipeline", "tensor", "spatial"))
        if ParallelConfig(**declared).devices == devices > 1:
            if p == 1 and not (schedule or declared.get("schedule")):
                sched = "1f1b"  # replicas accumulating micro-batches: each part in turn
            return [SplitSpec(data=d, pipeline=p, tensor=t, spatial=s, bn=bn, schedule=sched,
                              microbatches=microbatches or declared.get("microbatches", 1))]
        strategy = "auto"
        sched = schedule or declared.get("schedule") or "1f1b"
    if strategy not in CHOICES:
        raise SplitError(f"unknown --strategy `{strategy}`; choose one of "
                         f"{', '.join(CHOICES)}")
    if devices < 1:
        raise SplitError(f"--devices must be at least 1, not {devices}")

    def micro_for(p: int) -> list[int]:
        if p == 1:
            return [1]
        if microbatches is not None:
            return [microbatches]
        out, m = [], 1
        while m <= batch:
            if m >= p or m == 1:
                out.append(m)
            m *= 2
        return out or [1]

    if strategy in ("tensor", "spatial") and (microbatches or 1) > 1:
        raise SplitError(f"--microbatches {microbatches}: {MICROBATCHES_APPLY}")
    if strategy == "data":  # micro-batches: each replica accumulates, each part in turn
        return [SplitSpec(data=devices, bn=bn, microbatches=microbatches or 1,
                          schedule=schedule or declared.get("schedule") or "1f1b")]
    if strategy == "tensor":
        return [SplitSpec(tensor=devices, bn=bn)]
    if strategy == "spatial":
        return [SplitSpec(spatial=devices, bn=bn)]
    if strategy == "pipeline":
        m = microbatches if microbatches is not None else min(batch, 4 * devices)
        return [SplitSpec(pipeline=devices, microbatches=m, bn=bn, schedule=sched)]
    if strategy == "hybrid":
        d = declared.get("data", 1)
        p = declared.get("pipeline", 1)
        if d * p != devices or d == 1 or p == 1:
            d, p = _hybrid_factors(devices)
        m = microbatches or declared.get("microbatches") or min(batch // d or 1, 4 * p)
        return [SplitSpec(data=d, pipeline=p, microbatches=m, bn=bn, schedule=sched)]
    out = []
    for d in range(1, devices + 1):
        if devices % d:
            continue
        p = devices // d
        for m in micro_for(p):
            if d * m <= batch:
                out.append(SplitSpec(data=d, pipeline=p, microbatches=m, bn=bn,
                                     schedule=sched))
    if devices > 1:
        out.append(SplitSpec(tensor=devices, bn=bn))
        out.extend(SplitSpec(data=d, tensor=devices // d, bn=bn)
                   for d in range(2, devices) if devices % d == 0 and d <= batch)
    if devices > 1 and has_conv:
        out.append(SplitSpec(spatial=devices, bn=bn))
        if bn == "sync":
            out.extend(SplitSpec(data=d, spatial=devices // d, bn=bn)
                       for d in range(2, devices) if devices % d == 0 and d <= batch)
    return out


def _hybrid_factors(devices: int) -> tuple[int, int]:
    for d in range(2, devices):
        if devices % d == 0 and devices // d > 1:
            return d, devices // d
    raise SplitError(f"a hybrid split needs a device count with two factors above 1 "
                     f"(4, 6, 8 ...), not {devices}")


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


@gc_paused()  # (builds and drops whole split steps: netdsl.ir.bulk)
def choose(fwd: Graph, batch: int, strategy: str | None, devices: int, optimizer: dict,
           profile: Profile, link: Interconnect, mem: int | None = None,
           microbatches: int | None = None, bn: str = "sync", gather: tuple[str, ...] = (),
           float_dtype: str = "f32", progress=None, schedule: str | None = None,
           plan: bool = False, outputs: dict[str, list[str]] | None = None,
           mem_strategy: str = "auto", over_mpi: bool = False,
           share: Share | None = None, jobs: int | None = None) -> Chosen:
    """Build and predict the candidates (module docstring); raise SplitError if none fits.
    `outputs`: output roles to add to every split step (the trainer's logits); `over_mpi`:
    the step runs one process per device, whose sends MPI holds until the peer has them
    (`project.mark_over_mpi`: predicted and planned so); `share`: ranks that share the
    candidates out (`Share`; the choice and the chosen step are the ones each would have
    made alone); `jobs`: without `share`, the processes that share them so (this one and
    jobs - 1 workers; None: `_jobs`' default)."""
    specs = candidates(strategy, devices, batch, microbatches, dict(fwd.parallel), bn,
                       schedule, any(n.op == "conv2d" for n in fwd.nodes))
    n_jobs = 1 if share is not None else _jobs(jobs, len(specs), len(fwd.nodes),
                                               max(map(_copies, specs), default=1))
    if n_jobs > 1:
        args = dict(fwd=fwd, batch=batch, strategy=strategy, devices=devices,
                    optimizer=optimizer, profile=profile, link=link, mem=mem,
                    microbatches=microbatches, bn=bn, gather=gather,
                    float_dtype=float_dtype, schedule=schedule, plan=plan, outputs=outputs,
                    mem_strategy=mem_strategy, over_mpi=over_mpi)
        with fanout.workers(n_jobs, f"{__name__}:_helper", args) as ex:
            return choose(**args, progress=progress,
                          share=Share(0, n_jobs, ex.allgather, gather=ex.gather))
    if share is not None and share.size > 1:
        # ranks share only the same candidates (one candidate: every rank needs its step
        # anyway); ranks with other files or options choose alone, and the check of the
        # steps they built (trainer) says how they differ instead of a mixed choice. Every
        # rank takes part in the exchange, whatever its own candidates: one that skipped
        # it would leave the others waiting
        names = [spec.describe() for spec in specs]
        if any(x != names for x in share.allgather(names)) or len(specs) < 2:
            share = None
    else:
        share = None
    # the kernels' fusions of the device the profile describes (a unified one: a CPU's)
    device = "cpu" if profile.unified else "gpu"
    single = split_step(fwd, batch, SplitSpec(), optimizer, gather, device=device)
    single_step = step_time(single, profile, link, float_dtype)  # once, for every speed-up
    cap = mem if mem is not None else profile.capacity_bytes
    considered: list[Choice] = []
    errors = []

    def build(spec: SplitSpec) -> Graph:
        g = split_step(fwd, batch, spec, optimizer, gather, profile=profile, device=device)
        g.outputs.update(outputs or {})
        return mark_over_mpi(g) if over_mpi else g

    def evaluate(spec: SplitSpec) -> Choice | str:
        """The candidate built and predicted, or why it cannot be made."""
        try:
            g = build(spec)
        except SplitError as e:
            if len(specs) == 1:
                raise
            return f"{spec.describe()}: {e.message}"
        rep, _ = report(g, single_step, profile, link, float_dtype)
        return Choice(spec, g, rep, _fits(rep, cap))

    best: Choice | None = None  # the fastest candidate that fits so far

    def faster(c: Choice) -> bool:
        return best is None or c.report.predicted_step_s < best.report.predicted_step_s

    local: dict[SplitSpec, Graph] = {}  # the best's graph, where this rank has it

    def keep_if_best(c: Choice) -> None:
        """Make `c` the best if it fits and is faster; only the best keeps its graph
        (a resnet2504 split step is gigabytes; another is built again to be planned)."""
        nonlocal best
        if c.fits and faster(c):
            if best is not None:
                best.graph = None
            local.clear()
            best = c
            if c.graph is not None:
                local[c.spec] = c.graph
        elif c is not best:
            c.graph = None

    # candidates in rounds, as `_rounds` goes through them: every family's first (a
    # family: pipelines that differ only in their micro-batches, by their count; any
    # other candidate alone), then each family's next while it could still win. The
    # ranks (all of them: one without `share`) build and predict a round's candidates,
    # and several ranks the next count of each of its families ahead, more where ranks
    # would be idle (figures that `_rounds` drops where it stops before them, so the
    # choice, the figures and the skipped counts are those of one process); then they
    # exchange the figures. Only the best so far keeps its graph (keep_if_best), between
    # rounds the best by `_rounds`
    work = [_work(spec) for spec in specs]
    families = _families(specs)
    width = share.size if share else 1
    found: dict[int, Choice | str] = {}
    while True:
        taken, now, best = _rounds(families, found)
        for spec in [x for x in local if best is None or x != best.spec]:
            del local[spec]
        if not now:
            break
        if width > 1:
            now += _ahead(families, found, now, work, width)
        got: dict[int, Choice | str] = {}
        for k in share.mine(now, [work[k] for k in now]) if share else now:
            if progress is not None:
                progress((len(found) + len(got)) / len(specs))
            got[k] = c = evaluate(specs[k])
            if isinstance(c, Choice) and not (plan and not c.fits and len(specs) == 1):
                keep_if_best(c)  # (a lone candidate that does not fit is planned from it)
        if share:  # every rank's figures, on every rank
            got = share.merged({k: c if isinstance(c, str) else replace(c, graph=None)
                                for k, c in got.items()})
        found.update(got)
    skipped = [k for k in range(len(specs)) if k not in taken]
    for k in sorted(taken):
        c = found[k]
        if isinstance(c, str):
            errors.append(c)
        else:
            considered.append(c)
    if plan:
        # planning adds recomputation and copies, never speed: the candidates that do not
        # fit are planned in the order of their unplanned predicted times, each only if
        # it would still beat the fastest that fits (so the choice is the fastest planned
        # or unplanned step that fits, in the fewest plans); shared out, a wave of one a
        # rank at a time, a plan taken only where it would have been made alone
        queue = sorted((c for c in considered if not c.fits),
                       key=lambda c: c.report.predicted_step_s)
        width = share.size if share else 1
        while queue := [c for c in queue if faster(c)]:
            wave, queue = queue[:width], queue[width:]
            r = share.rank if share else 0
            ours = wave[r] if r < len(wave) else None
            g, res, rep = (None, None, None) if ours is None else _plan(
                ours.graph if ours.graph is not None else build(ours.spec), cap,
                single_step, profile, link, float_dtype, mem_strategy)
            plans = {} if ours is None else {r: (res, rep)}
            if share:
                plans = share.merged(plans)
            for j, c in enumerate(wave):
                if faster(c):
                    _take_plan(c, *plans[j], cap, g if j == r else None)
                    keep_if_best(c)
    if share is not None and share.gather is not None and best is not None:
        # (every rank: the same condition) the chosen step from the rank that has it
        sent = share.gather(None if share.rank == 0 else local.get(best.spec))
        if share.rank == 0 and best.graph is None:
            best.graph = next((g for g in sent if g is not None), None)
    if best is not None and best.graph is None and (share is None or share.needs_step):
        # chosen from figures (another rank's, or this one's made before an exchange)
        g = local.get(best.spec)
        best.graph = g if g is not None else _rebuild(build(best.spec), best.memory)
    if best is None:
        if not considered:
            raise SplitError("no split of this network works: " + "; ".join(errors))
        worst = min(considered, key=_least_peak)
        if worst.memory is not None:
            m = worst.memory
            raise SplitError(
                f"no split onto {devices} device(s) fits {format_decimal(cap)} per device, "
                f"even with memory planning: the best ({worst.spec.describe()}) needs at "
                f"least {format_decimal(m.min_feasible_bytes)} ({m.min_feasible_bytes:,} "
                f"bytes) on device {m.worst_device} "
                f"({m.dominant or 'its persistent state'}); use more devices, a smaller "
                "batch, or more memory")
        peak = max(worst.report.per_device, key=lambda d: d.peak_bytes + d.outside_plan_bytes)
        raise SplitError(
            f"no split onto {devices} device(s) fits {cap / 1e9:.3g} GB per device: the "
            f"best ({worst.spec.describe()}) needs "
            f"{(peak.peak_bytes + peak.outside_plan_bytes) / 1e9:.3g} GB on device "
            f"{peak.device}; use more devices, a smaller batch, or more memory")
    return Chosen(best, single, considered, [specs[k] for k in sorted(skipped)], errors)


def _families(specs: list[SplitSpec]) -> list[list[int]]:
    """The candidates (their places) by family: pipelines that differ only in their
    micro-batches together, fewest first; any other candidate alone."""
    out: dict[SplitSpec, list[int]] = {}
    for k, spec in enumerate(specs):
        key = replace(spec, microbatches=1) if spec.pipeline > 1 else spec
        out.setdefault(key, []).append(k)
    return [sorted(ks, key=lambda k: specs[k].microbatches) for ks in out.values()]


def _rounds(families: list[list[int]], found: dict) -> tuple[set[int], list[int],
                                                             Choice | None]:
    """One process's way through the candidates, on the figures `found` so far: each
    round every family's next candidate (its first, then more micro-batches while
    `_past_its_best` does not stop it), the best (the fastest that fits, visited in spec
    order) after each. Returns (the candidates taken so far, the next round's candidates
    that have no figures yet, [] when it is done, and the best so far)."""
    depth = [0] * len(families)
    going = list(range(len(families)))
    taken: set[int] = set()
    best = None
    while going:
        now = [families[f][depth[f]] for f in going]
        if any(k not in found for k in now):
            return taken, [k for k in now if k not in found], best
        taken.update(now)
        best = min((c for k in sorted(taken) if isinstance(c := found[k], Choice) and c.fits),
                   key=lambda c: c.report.predicted_step_s, default=None)  # (the first)
        stopped, going = going, []
        for f in stopped:
            depth[f] += 1
            fam = families[f]
            if depth[f] < len(fam) and not _past_its_best(
                    found, [fam[depth[f] - 1], fam[depth[f] - 2]] if depth[f] > 1 else [],
                    best):
                going.append(f)
    return taken, [], best


def _ahead(families: list[list[int]], found: dict, now: list[int], work: list[float],
           width: int) -> list[int]:
    """The counts `width` ranks build ahead of round `now`: each of its families' next
    count, all of a family's where they cost less than the rest of the round (they run
    beside it rather than after it), more where ranks would be idle."""
    total = sum(work[k] for k in now)
    out, rests = [], []
    for fam in (fam for fam in families if any(k in now for k in fam)):
        rest = [k for k in fam if k not in found and k not in now]
        if sum(work[k] for k in rest) <= total - sum(work[k] for k in fam if k in now):
            out += rest
        elif rest:
            out.append(rest.pop(0))
            rests.append(rest)
    for rest in rests:
        out += rest[:max(0, width - len(now) - len(out))]
    return out


def _past_its_best(found: dict, last_two: list[int], best: Choice | None) -> bool:
    """Whether a pipeline family's next candidates (more micro-batches) cannot win: its
    last (`last_two`: the last and the one before) was slower than the one before and
    than `best`, the fastest that fits. The predicted time of a pipeline falls with its
    bubble, (p - 1) / (m + p - 1), and rises with its per-node costs, which grow with m,
    so once it rises it goes on rising (resnet164 on four devices, m = 1, 4 ... 128:
    0.211, 0.112, 0.114, 0.144, 0.212, 0.357, 0.648 s), and planning only adds time."""
    if best is None or len(last_two) < 2:
        return False
    last, before = (found[k] for k in last_two)
    if isinstance(last, str) or isinstance(before, str):
        return False
    t = last.report.predicted_step_s
    return t > before.report.predicted_step_s and t >= best.report.predicted_step_s


def _work(spec: SplitSpec) -> float:
    """About a candidate's time to build and predict, in a pipeline's micro-batches: a
    pipeline costs about one each, a data or spatial part about 3.4 (with its micro-
    batches, in a hybrid), a tensor split 1.4 times as much. Measured on four devices
    (seconds): resnet2504 at batch 16, a micro-batch 2.9 (pipelines of 1 ... 16: 3.2, 11.7,
    22.4, 47.4), data=4 39.8, spatial=4 43.6, tensor=4 15.4, data=2 x pipeline=2 22.6;
    resnet164 at batch 128, a micro-batch 0.15-0.19 (128 of them: 24.7), data=4 2.2,
    tensor=4 0.8."""
    if spec.data == spec.tensor == spec.spatial == 1:
        return spec.microbatches
    return 3.4 * spec.data * spec.spatial * spec.microbatches * (
        1.4 if spec.tensor > 1 else 1.0)


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


def _helper(ex: fanout.Exchange, **args) -> None:
    """A worker process's part of `choose` (fanout): its share of the candidates, the
    figures sent to the caller, and the chosen step where it built it."""
    choose(**args, share=Share(ex.rank, ex.size, ex.allgather, needs_step=False,
                               gather=ex.gather))


def _least_peak(c: Choice) -> int:
    """The smallest budget a candidate fits (planned, where it was): its largest device
    peak with what that device's process holds besides it (over MPI)."""
    if c.memory is not None:
        return c.memory.min_feasible_bytes
    return max(d.peak_bytes + d.outside_plan_bytes for d in c.report.per_device)


def _fits(rep: SplitReport, cap: int) -> bool:
    return all(d.peak_bytes + d.outside_plan_bytes <= cap for d in rep.per_device)


def _plan(g: Graph, cap: int, single_step: float, profile: Profile, link: Interconnect,
          float_dtype: str, strategy: str = "auto") -> tuple:
    """Candidate step `g` planned per device into `cap` bytes: (the planned step, the plan
    without its search state, the planned step's report), or (None, the plan, None)."""
    from netdsl.parallel.memplan import plan_split
    planned, res = plan_split(g, cap, profile, float_dtype, strategy)
    res = replace(res, prep=None, sim=None, baseline_sim=None)  # (sent between ranks)
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
