"""Planning a split training step per device: the parts of `memory.search` that differ
when the budget bounds each device's peak (`Sim.device_peaks`) rather than one.

A clone runs on its value's device and an offloaded value waits in that device's host
memory, so a device's bytes depend only on the decisions about its own values: the
planner's ladder is split by device and every device bisects its own ladder against its
own peak, the devices' prefixes evaluated together (`shortest_prefixes`).
"""
from __future__ import annotations

from bisect import bisect_left

from netdsl.memory.simulate import OFFLOAD, RECOMPUTE, Sim


def shortest_prefixes(pl, ladder, budget: int, consider, tick) -> None:
    """`search._shortest_prefix` for a split step, every device at once: the ladder is split by
    device, and since a device's bytes depend only on the decisions about its own values,
    each device bisects its own ladder against its own peak (regula falsi, as there),
    the devices' current prefixes evaluated together in one simulation per round. A
    device that does not fit with its whole ladder keeps it (the smallest peak, for the
    error); the union of the devices' shortest fitting prefixes is considered last."""
    dev = pl.prep.device
    ladders: dict[int, list] = {}
    for item in ladder:
        ladders.setdefault(dev[item[0]], []).append(item)
    if not ladders:
        return

    def peaks(ks: dict[int, int]) -> dict[int, int]:
        dec: dict[int, str] = {}
        for d, k in ks.items():
            dec.update(ladders[d][:k])
        return pl.held_peaks(consider(dec)[0])  # (with each process's reserve)

    lo = {d: 0 for d in ladders}
    hi = {d: len(lad) for d, lad in ladders.items()}
    f_lo = {d: v - budget for d, v in peaks(lo).items() if d in ladders}
    f_hi = {d: v - budget for d, v in peaks(hi).items() if d in ladders}
    active = {d for d in ladders if f_hi[d] <= 0 < f_lo[d]}
    for d in ladders:  # already fits: no decisions; cannot fit: the whole ladder
        if f_lo[d] <= 0:
            hi[d] = 0
    cum = {}
    for d, lad in ladders.items():
        c = [0]
        for p, _ in lad:
            c.append(c[-1] + pl.prep.full_bytes[p])
        cum[d] = c
    kept = {d: 0 for d in ladders}
    total = max(1, sum(len(v) for v in ladders.values()))
    while True:
        active = {d for d in active if hi[d] - lo[d] > max(1, len(ladders[d]) // 256)}
        if not active:
            break
        mid = dict(hi)
        for d in active:
            w_lo, w_hi = f_lo[d], f_hi[d]
            if kept[d] == -2:
                w_lo /= 2
            elif kept[d] == 2:
                w_hi /= 2
            c, a, b = cum[d], lo[d], hi[d]
            if w_lo - w_hi > 0 and c[b] > c[a]:
                x = c[a] + (c[b] - c[a]) * w_lo / (w_lo - w_hi)
                mid[d] = min(max(bisect_left(c, x, a, b), a + 1), b - 1)
            else:
                mid[d] = (a + b) // 2
        got = peaks(mid)
        for d in active:
            f = got[d] - budget
            if f <= 0:
                hi[d], f_hi[d] = mid[d], f
                kept[d] = kept[d] - 1 if kept[d] < 0 else -1
            else:
                lo[d], f_lo[d] = mid[d], f
                kept[d] = kept[d] + 1 if kept[d] > 0 else 1
            kept[d] = max(-2, min(2, kept[d]))
        left = sum(hi[d] - lo[d] for d in ladders)
        tick(0.3 + 0.7 * (1 - left / total))
    peaks(hi)



def per_device(pl, dec: dict[int, str], sim: Sim) -> dict[int, dict]:
    """Per device of a split step: its planned peak and what it recomputes / offloads."""
    prep = pl.prep
    peaks = pl.device_peaks(sim)
    out = {d: {"peak_bytes": peaks.get(d, 0), RECOMPUTE: 0, "recompute_bytes": 0,
               OFFLOAD: 0, "offload_bytes": 0} for d in pl.devices}
    for p, d in dec.items():
        row = out[prep.device[p]]
        row[d] += 1
        row[f"{d}_bytes"] += prep.full_bytes[p]
    return out
