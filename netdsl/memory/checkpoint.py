"""Checkpoint plans on the forward pass's cut points (Chen et al. 2016, done on the graph).

A *cut* is a retained forward value that every later forward value depends on only
through it: when it is made, no other forward value made before it is still read by a
later forward node (a residual block's output; a chain's every value). Keeping a cut and
recomputing the values after it therefore rebuilds them from the cut alone. Keeping a
value that is not a cut (a ReLU inside a residual block) cuts nothing: the residual
stream still runs around it, so the segment to rebuild is as long as before.

The forward pass is split at its cuts into *units*; a plan is a sequence of segments of
units, each

- recomputed (`RECOMPUTED`): only the cut at its end is kept; in the backward pass all its
  retained values are rebuilt at once (clones before its first backward reader);
- kept (`KEPT`, one unit): all its retained values stay from the forward pass;
- or part-kept (`PART`, one unit): its cut and its *dear* values (those whose rebuild
  costs more time per byte than the unit's average: convolution outputs) stay, the cheap
  ones (norm, activation outputs) are rebuilt from them.

While a segment's backward pass runs the device holds what earlier segments stored (their
end cuts, or the values a kept or part-kept unit keeps) plus the segment's own retained
values and the backward pass's temporaries. `chain_plan` minimises the recomputation time
(the cost model's time of the clones) subject to that bound, by dynamic programming over
units and the bytes stored so far; the search scores its result with the exact
simulator, which is the truth (the model leaves out small values and the forward pass).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from netdsl.memory.simulate import FWD, KEEP, RECOMPUTE

RECOMPUTED, KEPT, PART = 0, 1, 2  # segment modes (module doc)


@dataclass
class Unit:
    cands: list[int]  # retained values in this unit (positions), in forward order
    cut: int  # the cut that ends it
    held: int  # bytes of its retained values, all alive while its backward pass runs
    cut_bytes: int
    time: float  # predicted time of recomputing all of it
    cut_time: float  # ... of which its end cut's own clone
    temp: int  # backward temporaries estimate: three of its largest values
    cheap: list[int] = field(default_factory=list)  # what a part-kept unit rebuilds
    part_bytes: int = 0  # what a part-kept unit keeps (its cut and dear values)
    part_time: float = 0.0  # predicted time of rebuilding its cheap values
    anchor: bool = False  # its cut is not a retained value: kept from the forward pass


def cut_points(pl, device: int | None = None, anchors: bool = False) -> list[int]:
    """The retained forward values that are cuts (module doc), in forward order; of a
    split step, those of `device`'s own forward pass (its nodes only). With `anchors`,
    other forward values that are cuts too (*anchors*: a synchronised batchnorm's input,
    which its backward does not read, in a split step); a plan keeps an anchor from the
    forward pass until the clones that read it."""
    prep = pl.prep
    n = len(prep.names)
    mine = [device is None or d == device for d in prep.device] if prep.device \
        else [True] * n
    last = [-1] * n  # last forward reader of each forward value
    for k in range(n):
        if prep.phase[k] == FWD and mine[k]:
            for u in prep.inputs[k]:
                if prep.phase[u] == FWD and k > last[u]:
                    last[u] = k
    cuts, reach = [], -1
    for k in range(n):
        if prep.phase[k] != FWD or not mine[k]:
            continue
        if reach <= k and (k in pl.cand_set or (
                anchors and prep.bytes[k] > 0 and k not in pl.fixed
                and k not in prep.wanted)):
            cuts.append(k)
        reach = max(reach, last[k])
    return cuts


def units(pl, cuts: list[int], device: int | None = None) -> list[Unit]:
    """The units between consecutive cuts; candidates after the last cut join the last
    unit (the network's head). Of a split step: `device`'s candidates."""
    out: list[Unit] = []
    ci = 0
    cur: list[int] = []
    anchors = frozenset(c for c in cuts if c not in pl.cand_set)
    for p in pl.cand:
        if device is not None and pl.prep.device[p] != device:
            continue
        while ci < len(cuts) and cuts[ci] < p and cuts[ci] in anchors:
            if cur:  # an anchor ends the unit of the candidates before it
                out.append(_unit(pl, cur, cuts[ci], anchors))
                cur = []
            ci += 1
        cur.append(p)
        if ci < len(cuts) and p == cuts[ci]:
            out.append(_unit(pl, cur, p, anchors))
            cur, ci = [], ci + 1
    if cur and out:
        last = out[-1]
        out[-1] = _unit(pl, last.cands + cur, last.cut, anchors)
    elif cur:
        out.append(_unit(pl, cur, cur[-1], anchors))
    return out


def _unit(pl, cands: list[int], cut: int, anchors: frozenset = frozenset()) -> Unit:
    prep, t = pl.prep, pl.costs.time
    pins = dict.fromkeys(anchors, KEEP)  # clones read the anchors, never rebuild them

    def close(dec):
        return pl.close({**pins, **dec})
    clones = close({p: RECOMPUTE for p in cands})
    time = sum(t[p] for p in clones)
    if cut in anchors:  # rebuilt only inside a recomputed segment: its own closure
        only_cut = pl.close({**pins, cut: RECOMPUTE})
        cut_time = sum(t[p] for p in only_cut if p not in clones)
        time += cut_time
    else:
        only_cut = close({cut: RECOMPUTE})
        others = set(close({p: RECOMPUTE for p in cands if p != cut}))
        cut_time = sum(t[p] for p in only_cut if p not in others)
    b = [prep.bytes[p] for p in cands]
    # an anchor is held with its unit's values while it is kept (read by a later clone)
    held = sum(b) + (prep.bytes[cut] if cut in anchors else 0)
    u = Unit(cands, cut, held, prep.bytes[cut], time, cut_time, 3 * max(b),
             anchor=cut in anchors)
    # dear: rebuilding costs more per byte than the unit's average
    cheap = [p for p in cands if p != cut and
             pl.closure_time(p, anchors) * held <= time * prep.bytes[p]]
    if cheap and len(cheap) < len(cands) - 1:
        u.cheap = cheap
        u.part_bytes = held - sum(prep.bytes[p] for p in cheap)
        u.part_time = sum(t[p] for p in close({p: RECOMPUTE for p in cheap}))
    return u


def decisions_of(us: list[Unit], plan: list[tuple[int, int, int]]) -> dict[int, str]:
    """Decisions of a plan given as segments (first unit, last unit, mode). An anchor
    that ends a segment is kept (`KEEP`, which `Planner.close` does not rebuild); one
    inside a recomputed segment is rebuilt with it."""
    dec: dict[int, str] = {}
    for a, b, mode in plan:
        if mode == PART:
            dec.update((p, RECOMPUTE) for p in us[a].cheap)
        elif mode == RECOMPUTED:
            for u in us[a:b + 1]:
                dec.update((p, RECOMPUTE) for p in u.cands if p != us[b].cut)
            dec.update((u.cut, RECOMPUTE) for u in us[a:b] if u.anchor)
        if us[b].anchor:
            dec[us[b].cut] = KEEP
    return dec


def grain_of(us: list[Unit]) -> int:
    """The step in which `chain_plan` counts stored bytes: fixed per network, so that a
    larger limit only ever admits more plans (a larger budget is never slower)."""
    return max(1, sum(u.held for u in us) // 8192)


def model_peak(us: list[Unit], plan: list[tuple[int, int, int]]) -> int:
    """The most bytes the model says a plan holds in any segment's backward pass."""
    stored = peak = 0
    for a, b, mode in plan:
        seg = us[a:b + 1]
        peak = max(peak, stored + sum(u.held for u in seg) + max(u.temp for u in seg))
        stored += (us[b].cut_bytes if mode == RECOMPUTED else us[a].held if mode == KEPT
                   else us[a].part_bytes)
    return peak


def chain_plan(us: list[Unit], limit: int, grain: int
               ) -> list[tuple[int, int, int]] | None:
    """The fastest plan (module doc) whose modelled backward-pass bytes stay within
    `limit` at every segment: segments (first unit, last unit, mode), or None when no
    plan fits. Stored bytes are counted in steps of `grain` bytes, rounded up; the least
    time for each (units done, stored bytes) is a NumPy row.

    Row k (k units done) is made from the rows before it, as they offer their entries:
    first the segments recomputing units i..k-1 for i < k - 1 (the kept cut of unit k - 1
    adds the same bytes to each, so they are one block of rows and its least entry per
    column, the earliest row among equals), then keeping unit k - 1, part-keeping it and
    recomputing it alone; an offer replaces an entry only where it is strictly less."""
    m = len(us)
    if not m or limit <= 0:
        return None
    q = limit // grain
    best = np.full((m + 1, q + 1), np.inf)
    best[0, 0] = 0.0
    came = np.full((m + 1, q + 1), -1, dtype=np.int32)  # the unit the segment began at
    modes = np.zeros((m + 1, q + 1), dtype=np.int8)  # ... and its mode
    rt = np.zeros(m)  # rt[i]: the time of recomputing units i..k-1, summed from i
    reach = np.zeros(m, dtype=np.int64)  # one past each row's last finite entry
    first = 0  # the first unit a recomputed segment ending at unit k - 1 may begin at
    for k in range(1, m + 1):
        i = k - 1
        finite = np.flatnonzero(np.isfinite(best[i]))
        if not len(finite):
            return None
        reach[i] = finite[-1] + 1
        u = us[i]
        rt[first:k] += u.time
        first, tops = _sources(us, first, k, limit, grain)
        shift = _up(u.cut_bytes, grain)
        if first < i:  # (entries past a row's reach are infinite: offered or not, the same)
            _offer_block(best, came, modes, k, first,
                         np.minimum(np.array(tops[:-1]) + 1, reach[first:i]), shift,
                         rt[first:i] - u.cut_time)
        top = (limit - u.held - u.temp) // grain
        _relax(best, came, modes, i, k, top, _up(u.held, grain), 0.0, KEPT)
        if u.cheap:
            _relax(best, came, modes, i, k, top, _up(u.part_bytes, grain), u.part_time,
                   PART)
        if first <= i:
            _relax(best, came, modes, i, k, tops[-1], shift, rt[i] - u.cut_time, RECOMPUTED)
    if not np.isfinite(best[m]).any():
        return None
    s = int(np.argmin(best[m]))
    plan = []
    k = m
    while k:
        i, mode = int(came[k, s]), int(modes[k, s])
        u = us[k - 1]
        s -= _up(u.held if mode == KEPT else u.part_bytes if mode == PART else u.cut_bytes,
                 grain)
        plan.append((i, k - 1, mode))
        k = i
    return plan[::-1]


def _sources(us: list[Unit], first: int, k: int, limit: int, grain: int
             ) -> tuple[int, list[int]]:
    """The units i >= `first` a recomputed segment i..k-1 may begin at (its bytes within
    `limit`: fewer units only hold fewer), from the first, and for each the most stored
    grains before it (ascending)."""
    tops: list[int] = []
    held = temp = 0
    for i in range(k - 1, first - 1, -1):
        held += us[i].held
        temp = max(temp, us[i].temp)
        top = (limit - held - temp) // grain
        if top < 0:
            return i + 1, tops[::-1]
        tops.append(top)
    return first, tops[::-1]


def chain_fits(us: list[Unit], limit: int, grain: int) -> bool:
    """Whether `chain_plan(us, limit, grain)` finds a plan, without its times: a row's
    finite entries are the stored bytes some plan reaches it with, and every offer takes
    a row's entries up to a bound, so a row has some exactly when the least of the row it
    comes from is within the bound; the least stored bytes of each row decide it."""
    m = len(us)
    if not m or limit <= 0:
        return False
    width = limit // grain + 1
    least = [width] * (m + 1)  # (width: none)
    least[0] = 0
    first = 0
    for k in range(1, m + 1):
        i = k - 1
        if least[i] >= width:
            return False
        u = us[i]
        first, tops = _sources(us, first, k, limit, grain)
        top = (limit - u.held - u.temp) // grain
        offers = [(least[j], t, _up(u.cut_bytes, grain)) for j, t in enumerate(tops, first)]
        offers.append((least[i], top, _up(u.held, grain)))
        if u.cheap:
            offers.append((least[i], top, _up(u.part_bytes, grain)))
        for s, t, shift in offers:
            if s <= t and s + shift < min(width, least[k]):
                least[k] = s + shift
    return least[m] < width


def _relax(best, came, modes, i: int, k: int, top: int, shift: int, cost: float,
           mode: int) -> None:
    """Offer row i's entries with stored bytes <= top, stored + shift after the segment,
    to row k at `cost` more."""
    n = min(top + 1, best.shape[1] - shift)
    if n <= 0:
        return
    cand = best[i, :n] + cost
    tgt = best[k, shift:shift + n]
    better = cand < tgt
    if better.any():
        tgt[better] = cand[better]
        came[k, shift:shift + n][better] = i
        modes[k, shift:shift + n][better] = mode


def _offer_block(best, came, modes, k: int, first: int, counts, shift: int, costs) -> None:
    """Offer the first `counts` entries of rows first.. (one a recomputed segment ending
    at unit k - 1, `costs` theirs) to row k, as `_relax` would one after another: per
    column the least, of equals the earliest row."""
    n = min(int(counts.max()), best.shape[1] - shift)
    if n <= 0:
        return
    block = best[first:first + len(counts), :n] + costs[:, None]
    cols = np.arange(n)
    block[cols[None, :] >= counts[:, None]] = np.inf
    at = np.argmin(block, axis=0)
    least = block[at, cols]
    tgt = best[k, shift:shift + n]
    better = least < tgt
    if better.any():
        tgt[better] = least[better]
        came[k, shift:shift + n][better] = first + at[better]
        modes[k, shift:shift + n][better] = RECOMPUTED


def _up(b: int, grain: int) -> int:
    return -(-b // grain)
