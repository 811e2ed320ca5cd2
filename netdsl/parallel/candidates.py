"""Which splits `choose` tries, and in what order: the policy half of choosing a split.

`candidates` lists the specs a `--strategy` allows: one for `data`, `pipeline`, `hybrid`,
`tensor` and `spatial` (the schemes of `split.py`); for `auto`, every data x pipeline
factorisation of the device count (with micro-batch counts 1, 2, 4 ... up to the batch
for pipelines), the tensor split, its data x tensor hybrids and its tensor x pipeline
(x data) splits of three dimensions, and (for a network with convolutions) the spatial
split and its data x spatial hybrids.

The candidates are built in rounds (`rounds`): a pipeline's micro-batch counts in rising
order, each only while it could still win (`past_its_best`); the counts not built are
listed as skipped. Ranks that would be idle in a round build the next counts ahead
(`ahead`), with figures the rounds drop where they stop before them, so the choice is the
one a single process makes. `work_of` estimates what each candidate costs to build, to
share the candidates out evenly.

With `--mem`, planning never makes a step faster, so the candidates that do not fit are
planned fastest first (`planning_order`), each only while it would beat the fastest that
fits (`beats`): the choice is the fastest step that fits, planned or not, in the fewest
plans.

`auto` does not change what the step computes unless it must: a split is `exact` when its
step is the single-device step's (data with synchronised batchnorm, tensor, spatial, a
pipeline or accumulation of one micro-batch, or any split of a network without batch
statistics); one that normalises batchnorm over micro-batches, or over each device's
rows alone, computes other numbers. Where `prefer_exact` (auto, with neither
--microbatches nor --bn local asked for), every exact candidate that fits ranks before
every inexact one (`rank`), so an inexact split is chosen only where no exact one fits,
planned or not. Once one fits, the rounds build no big inexact candidate (`outclassed`:
none could win, whatever its time; `choose.OUTCLASSED_MIN_WORK`) and list it as skipped;
`choose` builds and plans the exact candidates before any big inexact one (`deferred`), so
that one fitting only planned leaves them out too.

The functions read the candidates' figures (`Choice`, or a string saying why one
cannot be made) by their place in the list of specs; building and predicting them is
`choose.py`'s.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from netdsl.config import MICROBATCHES_APPLY, ParallelConfig
from netdsl.errors import SplitError
from netdsl.ir.graph import Graph
from netdsl.options import split_sizes
from netdsl.parallel.predict import SplitReport
from netdsl.parallel.schedules import SCHEDULES
from netdsl.parallel.split import SHARD_STAGES, SplitSpec
from netdsl.sizes import format_bytes, format_seconds

CHOICES = ("auto", "data", "pipeline", "hybrid", "tensor", "spatial")
# another pipeline order than 1F1B is taken where it is predicted this much faster: less
# is within what the simulation misses of a step (docs/parallel.md's schedules table sets
# the predicted bubbles beside the measured ones)
ORDER_GAIN = 0.03
# ops whose result depends on the other samples of the batch (its statistics)
BATCH_STATISTICS_OPS = ("batchnorm",)


@dataclass
class Choice:
    """One candidate split, built and predicted (and planned, under a budget)."""
    spec: SplitSpec
    graph: Graph
    report: SplitReport
    fits: bool
    memory: object | None = None  # memory.search.PlanResult, when planned per device
    unplanned_step_s: float | None = None  # the predicted step before planning
    unplanned_peak_bytes: int | None = None  # ... and its largest device peak
    exact: bool = True  # its step computes the single-device step's numbers
    ranks_exact: bool = True  # ranked with the exact splits (`rank`)


def has_batch_statistics(fwd) -> bool:
    return any(n.op in BATCH_STATISTICS_OPS for n in fwd.nodes)


def exact(spec: SplitSpec, batch_statistics: bool) -> bool:
    """Whether `spec`'s step computes the single-device step's numbers (module doc)."""
    if not batch_statistics:
        return True
    if spec.bn == "local" and spec.data * spec.spatial > 1:
        return False
    return spec.microbatches == 1


def prefers_exact(strategy: str | None, microbatches: int | None, bn: str,
                  declared: dict, devices: int) -> bool:
    """Whether the choice ranks exact splits first: `auto` (asked for, or for a file that
    declares no split of these devices), unless the user asked for micro-batches or for
    batchnorm on each device's rows."""
    declared_here = strategy is None and ParallelConfig(**declared).devices == devices > 1
    auto = strategy == "auto" or (strategy is None and not declared_here)
    return auto and microbatches is None and bn == "sync"


def inexact_note(c: Choice, cap: int) -> str:
    """What a run says first when auto had to choose a split that changes the numbers."""
    spec = c.spec
    how = ("normalises batchnorm over each device's rows alone" if spec.bn == "local"
           else f"normalises batchnorm over each of {spec.microbatches} micro-batches "
           "alone")
    return (f"auto chose {spec.describe()}, which {how}: its step computes other numbers "
            f"than one device's, since no split that computes the same fits "
            f"{format_bytes(cap)} a device (give --split data, tensor or spatial with more "
            "memory or devices to keep them)")


def candidates(strategy: str | None, devices: int, batch: int, microbatches: int | None,
               declared: dict, bn: str, schedule: str | None = None,
               has_conv: bool = False, shard: int | None = None,
               virtual: int | None = None) -> list[SplitSpec]:
    """The specs `strategy` allows on `devices` devices (pipelines in `schedule` order,
    else the file's `parallel { schedule = ... }`, else GPipe's; `has_conv`: the network
    has 2-d convolutions, which a spatial split cuts; `shard`: the data replicas' state
    sharded so (--shard; None: the file's, else auto's choice); `virtual`: a pipeline's
    virtual stages (--virtual-stages; None: the file's, else 1))."""
    v = virtual or declared.get("virtual_stages", 1)
    if v > 1 and not (schedule or declared.get("schedule")):
        schedule = "1f1b"  # (interleaving is of 1F1B)
    # auto prefers 1F1B: the same bubble as GPipe with fewer activations alive
    sched = schedule or declared.get("schedule") or ("1f1b" if strategy == "auto"
                                                     else "gpipe")
    if sched not in SCHEDULES:
        raise SplitError(f"--schedule must be {', '.join(SCHEDULES[:-1])} or {SCHEDULES[-1]}, "
                         f"not {sched!r}")
    sizes = split_sizes(strategy)
    if sizes is not None:  # `--split data=2,pipeline=2,tensor=2`: as a file declares it
        if (n := ParallelConfig(**sizes).devices) != devices:
            raise SplitError(f"--split {strategy} splits the step over {n} devices, but "
                             f"there are {devices} (--devices, or the ranks under mpiexec); "
                             f"give {n} (mpiexec -n {n})")
        declared = {k: v for k, v in declared.items() if k in ("schedule", "shard")} | sizes
        strategy = None
    if strategy is None:  # the file's `parallel { }` if it declares devices, else auto
        d, p, t, s = (declared.get(k, 1) for k in ("data", "pipeline", "tensor", "spatial"))
        if ParallelConfig(**declared).devices == devices > 1:
            if p == 1 and not (schedule or declared.get("schedule")):
                sched = "1f1b"  # replicas accumulating micro-batches: each part in turn
            return [SplitSpec(data=d, pipeline=p, tensor=t, spatial=s, bn=bn, schedule=sched,
                              microbatches=microbatches or declared.get("microbatches", 1),
                              shard=declared.get("shard", 0) if shard is None else shard,
                              virtual_stages=v)]
        strategy = "auto"
        sched = schedule or declared.get("schedule") or "1f1b"
    if strategy not in CHOICES:
        raise SplitError(f"unknown --strategy `{strategy}`; choose one of "
                         f"{', '.join(CHOICES)}")
    if devices < 1:
        raise SplitError(f"--devices must be at least 1, not {devices}")
    if strategy in ("tensor", "spatial") and (microbatches or 1) > 1:
        raise SplitError(f"--microbatches {microbatches}: {MICROBATCHES_APPLY}")
    if strategy == "data" or (strategy == "auto" and shard):
        # micro-batches: each replica accumulates, each part in turn
        out = [SplitSpec(data=devices, bn=bn, microbatches=microbatches or 1, shard=shard or 0,
                         schedule=schedule or declared.get("schedule") or "1f1b")]
        if strategy == "auto":  # --shard S: the 3-D splits' replicas sharded alike
            out += [replace(s, shard=shard) for s in _three_d(devices, batch, microbatches,
                                                               bn, sched) if s.data > 1]
        return out
    if strategy == "tensor":
        return [SplitSpec(tensor=devices, bn=bn)]
    if strategy == "spatial":
        return [SplitSpec(spatial=devices, bn=bn)]
    if strategy == "pipeline":
        m = microbatches if microbatches is not None else min(batch, 4 * devices)
        return [SplitSpec(pipeline=devices, microbatches=m, bn=bn, schedule=sched,
                          virtual_stages=v)]
    if strategy == "hybrid":
        d = declared.get("data", 1)
        p = declared.get("pipeline", 1)
        if d * p != devices or d == 1 or p == 1:
            d, p = _hybrid_factors(devices)
        m = microbatches or declared.get("microbatches") or min(batch // d or 1, 4 * p)
        return [SplitSpec(data=d, pipeline=p, microbatches=m, bn=bn, schedule=sched,
                          virtual_stages=v)]
    specs = _auto(devices, batch, microbatches, bn, sched, has_conv, shard)
    if v > 1:
        specs = [replace(s, virtual_stages=v) for s in specs
                 if s.pipeline > 1 and s.microbatches % s.pipeline == 0]
        if not specs:
            raise SplitError(f"virtual_stages={v} needs a pipeline whose micro-batches are a "
                             f"multiple of its stages, and auto has none on {devices} devices "
                             f"at batch {batch}; give --split pipeline with --microbatches")
        return specs
    return specs


def other_orders(spec: SplitSpec, pinned: bool) -> list[SplitSpec]:
    """The orders auto also weighs for the 1F1B pipeline it chose (`choose`): ZB-H1, and
    1F1B interleaved over 2 virtual stages where the micro-batches go in groups of the
    stages and no layer is `pinned` to a stage. Weighed for the chosen pipeline alone: a
    new order changes its bubble, not which data x pipeline split wins by far."""
    if spec.pipeline < 2 or spec.schedule != "1f1b" or spec.virtual_stages > 1 \
            or spec.microbatches < spec.pipeline:
        return []
    out = [replace(spec, schedule="zb-h1")]
    if spec.microbatches % spec.pipeline == 0 and not pinned:
        out.append(replace(spec, virtual_stages=2))
    return out


def weighs_orders(strategy: str | None, declared: dict, devices: int, schedule: str | None,
                  virtual: int | None) -> bool:
    """Whether auto weighs other orders for its pipeline: it chose the split (not the
    file's `parallel { }`), and neither --schedule, --virtual-stages nor the file named
    an order."""
    declared_here = strategy is None and ParallelConfig(**declared).devices == devices > 1
    return (strategy == "auto" or (strategy is None and not declared_here)) and \
        schedule is None and virtual is None and declared.get("schedule") is None and \
        declared.get("virtual_stages", 1) == 1


def _auto(devices: int, batch: int, microbatches: int | None, bn: str, sched: str,
          has_conv: bool, shard: int | None = None) -> list[SplitSpec]:
    """`auto`'s candidates (module docstring)."""
    out = []
    for d in range(1, devices + 1):
        if devices % d:
            continue
        p = devices // d
        for m in _micro_counts(p, batch, microbatches):
            if d * m <= batch:
                out.append(SplitSpec(data=d, pipeline=p, microbatches=m, bn=bn,
                                     schedule=sched))
    if devices > 1 and devices <= batch and shard is None:
        # the replicas' state sharded: chosen where the data split does not fit (`needless`)
        out.extend(SplitSpec(data=devices, bn=bn, schedule=sched, shard=s)
                   for s in SHARD_STAGES)
    if devices > 1:
        out.append(SplitSpec(tensor=devices, bn=bn))
        out.extend(SplitSpec(data=d, tensor=devices // d, bn=bn)
                   for d in range(2, devices) if devices % d == 0 and d <= batch)
        out.extend(_three_d(devices, batch, microbatches, bn, sched))
    if devices > 1 and has_conv:
        out.append(SplitSpec(spatial=devices, bn=bn))
        if bn == "sync":
            out.extend(SplitSpec(data=d, spatial=devices // d, bn=bn)
                       for d in range(2, devices) if devices % d == 0 and d <= batch)
    return out


def _three_d(devices: int, batch: int, microbatches: int | None, bn: str,
              sched: str) -> list[SplitSpec]:
    """Tensor x pipeline splits (with data replicas where devices remain), each with one
    micro-batch and with four a stage (as `--strategy pipeline`), or --microbatches: two
    counts, not the pipelines' every power of two, since each such candidate holds a copy
    of the network per micro-batch and tensor rank, the dearest to build."""
    out = []
    for t in range(2, devices):
        for p in range(2, devices // t + 1):
            if devices % (t * p):
                continue
            d = devices // (t * p)
            counts = [microbatches] if microbatches is not None else sorted(
                {1, max(p, min(4 * p, batch // d))})
            out.extend(SplitSpec(data=d, pipeline=p, tensor=t, microbatches=m, bn=bn,
                                 schedule=sched) for m in counts if d * m <= batch)
    return out


def _micro_counts(p: int, batch: int, microbatches: int | None) -> list[int]:
    """The micro-batch counts auto tries for a pipeline of `p` stages."""
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


def _hybrid_factors(devices: int) -> tuple[int, int]:
    for d in range(2, devices):
        if devices % d == 0 and devices // d > 1:
            return d, devices // d
    raise SplitError(f"a hybrid split needs a device count with two factors above 1 "
                     f"(4, 6, 8 ...), not {devices}")


def families(specs: list[SplitSpec]) -> list[list[int]]:
    """The candidates (their places) by family: pipelines that differ only in their
    micro-batches together, fewest first; any other candidate alone."""
    out: dict[SplitSpec, list[int]] = {}
    for k, spec in enumerate(specs):
        key = replace(spec, microbatches=1) if spec.pipeline > 1 else spec
        out.setdefault(key, []).append(k)
    return [sorted(ks, key=lambda k: specs[k].microbatches) for ks in out.values()]


def rank(c: Choice) -> tuple[int, float]:
    """How candidates are ordered: exact splits first where that is preferred, then by
    their predicted step time."""
    return (0 if c.ranks_exact else 1, c.report.predicted_step_s)


def beats(c: Choice, best: Choice | None) -> bool:
    """Whether candidate `c` ranks before `best`, the best that fits (None: none)."""
    return best is None or rank(c) < rank(best)


def outclassed(k: int, inexact: frozenset[int], best: Choice | None,
               deferred: bool = False) -> bool:
    """Whether candidate `k` cannot win before it is built: it ranks with the inexact
    splits (`inexact`: the places of those left out so) and `best`, which fits, with the
    exact ones; `deferred`: not built yet whatever the best, while the exact candidates
    are built and planned first (`choose`)."""
    return k in inexact and (deferred or (best is not None and best.ranks_exact))


def rounds(families: list[list[int]], found: dict, planning: bool = False,
           inexact: frozenset[int] = frozenset(),
           deferred: bool = False) -> tuple[set[int], list[int], Choice | None]:
    """One process's way through the candidates, on the figures `found` so far: each
    round every family's next candidate (its first, then more micro-batches while
    `past_its_best` does not stop it and it is not `outclassed`: `inexact` are the places
    of the candidates that rank with the inexact splits, which in a family are its counts
    from the first of them on; `deferred`: none of them yet), the best (the fastest that
    fits, visited in spec order) after each. Returns (the candidates taken so far, the
    next round's candidates that have no figures yet, [] when it is done, and the best
    so far)."""
    depth = [0] * len(families)
    going = list(range(len(families)))
    taken: set[int] = set()
    best = None
    while going:
        now = [families[f][depth[f]] for f in going]
        if any(k not in found for k in now):
            return taken, [k for k in now if k not in found], best
        taken.update(now)
        done = [found[k] for k in sorted(taken)]
        best = min((c for c in done if not isinstance(c, str) and c.fits
                    and not needless(c, done, planning)),
                   key=rank, default=None)  # (the first of equals)
        stopped, going = going, []
        for f in stopped:
            depth[f] += 1
            fam = families[f]
            if depth[f] < len(fam) and not past_its_best(
                    found, [fam[depth[f] - 1], fam[depth[f] - 2]] if depth[f] > 1 else [],
                    best) and not outclassed(fam[depth[f]], inexact, best, deferred):
                going.append(f)
    return taken, [], best


def ahead(families: list[list[int]], found: dict, now: list[int], work: list[float],
          width: int, inexact: frozenset[int] = frozenset(),
          deferred: bool = False) -> list[int]:
    """The counts `width` ranks build ahead of round `now`: each of its families' next
    count, all of a family's where they cost less than the rest of the round (they run
    beside it rather than after it), more where ranks would be idle. Where the round has
    an exact candidate, or they are `deferred` (`rounds`), none of the `inexact` ones
    (likely `outclassed` once it fits)."""
    total = sum(work[k] for k in now)
    out, rests = [], []
    hold = inexact if deferred or any(k not in inexact for k in now) else frozenset()
    for fam in (fam for fam in families if any(k in now for k in fam)):
        rest = [k for k in fam if k not in found and k not in now and k not in hold]
        if sum(work[k] for k in rest) <= total - sum(work[k] for k in fam if k in now):
            out += rest
        elif rest:
            out.append(rest.pop(0))
            rests.append(rest)
    for rest in rests:
        out += rest[:max(0, width - len(now) - len(out))]
    return out


def past_its_best(found: dict, last_two: list[int], best: Choice | None) -> bool:
    """Whether a pipeline family's next candidates (more micro-batches) cannot win: its
    last (`last_two`: the last and the one before) was slower than the one before and
    than `best`, the fastest that fits. The predicted time of a pipeline falls with its
    bubble, (p - 1) / (m + p - 1), and rises with its per-node costs, which grow with m,
    so once it rises it goes on rising, and planning only adds time."""
    if best is None or len(last_two) < 2:
        return False
    last, before = (found[k] for k in last_two)
    if isinstance(last, str) or isinstance(before, str):
        return False
    t = last.report.predicted_step_s
    return t > before.report.predicted_step_s and not beats(last, best)


def needless(c: Choice, choices, planning: bool = False) -> bool:
    """Whether `c` shards a data split's state where a lower stage of it (among `choices`,
    Choices or strings) fits each device as it is, or (`planning`: with --mem) fits or
    might fit once planned (it is not planned yet): auto shards only where the replicated
    state is what stops the data split fitting, which recomputing and offloading
    activations cannot change (sharding divides the state, and adds the pieces and
    gathered buckets to the step). Where that state is most of the replicated split's
    peak (`state_bound`), only a lower stage that fits as it is makes `c` needless: the
    rest, planned or not, compare on their predicted step times (`rank`)."""
    if not c.spec.shard:
        return False
    lower = [o for o in choices if not isinstance(o, str)
             and o.spec in {replace(c.spec, shard=s) for s in range(c.spec.shard)}]
    if any(o.fits and o.memory is None for o in lower):
        return True
    plain = next((o for o in lower if not o.spec.shard), None)
    if plain is not None and state_bound(plain):
        return False
    return any(o.fits or (planning and o.memory is None) for o in lower)


def state_bound(plain: Choice) -> bool:
    """Whether the replicated data split's state is most of its peak: on its fullest
    device, its weights (counted twice: once more for their gradients) and optimizer state
    are more than half of what it needs, unplanned. Sharding is then the remedy for what
    stops it fitting, and planning the activations only another."""
    d = max(plain.report.per_device, key=lambda d: d.peak_bytes)
    peak = plain.unplanned_peak_bytes or d.peak_bytes  # (planned: the peak it had before)
    return 2 * (2 * d.state_bytes - d.optimizer_state_bytes) > peak


def shard_reason(best: Choice, considered: list[Choice], cap: int,
                 planning: bool = False) -> str | None:
    """Whether sharded data parallelism beats the other choices, where auto weighed it
    (a shard stage that was not `needless`): why it sharded the data split it chose
    (what the replicated one needs) and against what it won, or what the fastest shard
    stage that fits lost to (`planning`: with --mem)."""
    sharded = [c for c in considered if c.spec.shard and c.fits
               and c.ranks_exact == best.ranks_exact and not needless(c, considered, planning)]
    if not best.spec.shard:
        if not sharded:
            return None
        c = min(sharded, key=rank)
        return (f"sharded data parallelism does not beat {best.spec.describe()}: the "
                f"fastest shard stage that fits, {_timed(c)}, is slower than its "
                f"{best.report.predicted_step_s:.4g} s")
    plain = next((c for c in considered if c.spec == replace(best.spec, shard=0)), None)
    if plain is None:
        return None
    need = max(d.peak_bytes + d.outside_plan_bytes for d in plain.report.per_device)
    others = [c for c in considered if not c.spec.shard and c.fits
              and c.ranks_exact == best.ranks_exact]
    if others:
        versus = (f"; predicted {best.report.predicted_step_s:.4g} s a step, it beats "
                  f"{_timed(min(others, key=rank))}")
    else:
        versus = "; no split that does not shard fits"
    if planning and not plain.fits and plain.memory is None:
        versus += (f", and {plain.spec.describe()} planned would take at least its "
                   f"unplanned {plain.report.predicted_step_s:.4g} s")
    return (f"auto sharded the replicas' state (ZeRO stage {best.spec.shard}): "
            f"{plain.spec.describe()} needs {format_bytes(need)} ({need:,} bytes) on a "
            f"device, more than its {format_bytes(cap)} ({cap:,} bytes){versus}")


def _timed(c: Choice) -> str:
    """A candidate and its predicted step, for `shard_reason`."""
    how = ", planned" if c.memory is not None else ""
    return f"{c.spec.describe()}{how} ({c.report.predicted_step_s:.4g} s)"


def schedule_reason(best: Choice, considered: list[Choice]) -> str | None:
    """Why auto ordered the pipeline it chose so: the predicted step and bubble of each
    order it weighed for that pipeline (`_schedules`)."""
    if best.spec.pipeline < 2:
        return None
    base = replace(best.spec, schedule="1f1b", virtual_stages=1)
    rivals = [c for c in considered if c is not best
              and replace(c.spec, schedule="1f1b", virtual_stages=1) == base]
    if not rivals:
        return None

    def said(c: Choice) -> str:
        v = c.spec.virtual_stages
        name = f"interleaved 1F1B (V={v})" if v > 1 else c.spec.schedule.upper()
        return (f"{name} {format_seconds(c.report.predicted_step_s)}, bubble "
                f"{c.report.bubble:.1%}")

    against = "; ".join(said(c) + ("" if c.fits else " (does not fit)") for c in rivals)
    return (f"auto ordered the pipeline's micro-batches by the predicted step (another "
            f"order than 1F1B where it fits and is {ORDER_GAIN:.0%} faster or more): "
            f"{said(best)}; against {against}")


def choice_reason(best: Choice, considered: list[Choice], cap: int,
                  planning: bool = False) -> str | None:
    """Why auto chose `best`, where it is not the obvious one: the replicas' state sharded
    (`shard_reason`), or a split of three dimensions (tensor ranks in pipeline stages),
    against the best of the splits of fewer dimensions (`planning`: with --mem)."""
    why = shard_reason(best, considered, cap, planning)
    if why or best.spec.tensor == 1 or best.spec.pipeline == 1 or len(considered) < 2:
        return why  # (one candidate: the split asked for, not a choice)
    alt = min((c for c in considered if c.fits and (c.spec.tensor == 1 or c.spec.pipeline == 1)
               and c.ranks_exact >= best.ranks_exact), key=rank, default=None)
    t = best.report.predicted_step_s
    if alt is None:
        return (f"auto chose {best.spec.describe()}, tensor ranks in pipeline stages "
                f"({t:.3g} s a step predicted): no split of fewer dimensions"
                + (" that computes the same numbers" if best.ranks_exact else "")
                + f" fits {format_bytes(cap)} a device")
    return (f"auto chose {best.spec.describe()}, tensor ranks in pipeline stages: "
            f"{t:.3g} s a step predicted, against {alt.report.predicted_step_s:.3g} s for "
            f"{alt.spec.describe()}, the fastest split of fewer dimensions that fits")


def planning_order(considered: list[Choice]) -> list[Choice]:
    """The candidates that do not fit, in the order they are planned: by `rank` on their
    unplanned predicted times, since planning adds recomputation and copies, never
    speed."""
    return sorted((c for c in considered if not c.fits), key=rank)


def work_of(spec: SplitSpec) -> float:
    """About a candidate's time to build and predict, in a pipeline's micro-batches: a
    pipeline costs about one each, a data or spatial part about 3.4 (with its micro-
    batches, in a hybrid), a tensor split 1.4 times as much. Fitted to measurements of
    resnet2504 and resnet164 candidates on four devices (docs/benchmarks.md)."""
    if spec.data == spec.tensor == spec.spatial == 1:
        return spec.microbatches
    return 3.4 * spec.data * spec.spatial * spec.microbatches * (
        1.4 if spec.tensor > 1 else 1.0)
