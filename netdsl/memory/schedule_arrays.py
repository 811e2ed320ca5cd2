"""The simulator's passes over a schedule held as NumPy arrays (`simulate.simulate`).

A schedule is two arrays, each entry's kind (NODE, CLONE, D2H, H2D) and the position of
the value it runs, copies or clones. The passes are the rules of `simulate`'s module doc
written over whole arrays instead of a loop per entry: placing clones and copies
(`place`), the eager updates (`eager`), who reads which value (`reads`) and the bytes
alive after each entry (`lifetimes`, `timelines`). Each gives what a loop over the
entries in order would: where a loop let the last of several writes stand, the arrays
take the largest entry index (entries are visited in rising order), and where it kept
the first of equals, a stable sort does.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

# phases of a scheduled node
FWD, BWD, SRC, STATE = 0, 1, 2, 3
# kinds of schedule entries
NODE, CLONE, D2H, H2D = 0, 1, 2, 3


class Arrays(NamedTuple):
    """A prepared graph (`simulate.Prepared`) as arrays, made once per graph."""

    phase: np.ndarray  # each position's phase
    late: np.ndarray  # a backward node, not the optimizer's
    early: np.ndarray  # the optimizer's sources and step counter, in order
    is_early: np.ndarray  # ... as a mask over positions
    in_ptr: np.ndarray  # inputs as rows: position p reads in_idx[in_ptr[p]:in_ptr[p + 1]]
    in_idx: np.ndarray
    root: np.ndarray  # the storage each value aliases
    # the inputs whose storage an update overwrites, as rows like the inputs: (input,
    # its root); and whether each value's own storage is one of those
    ow_ptr: np.ndarray
    ow_input: np.ndarray
    ow_root: np.ndarray
    overwritten: np.ndarray
    updates: np.ndarray  # the update positions
    upd_in_start: np.ndarray  # where each update's inputs begin in upd_in
    upd_in: np.ndarray  # the updates' inputs, one after another
    upd_of_root: np.ndarray  # (index into updates, a root it overwrites) pairs
    root_of_upd: np.ndarray
    nbytes: np.ndarray
    full: np.ndarray
    to_end: np.ndarray  # values held to the end of the step (roles' outputs, MPI sends)


def arrays_of(prep) -> Arrays:
    """`prep` as `Arrays`."""
    n = len(prep.names)
    counts = np.fromiter((len(ins) for ins in prep.inputs), np.int64, n)
    in_ptr = np.zeros(n + 1, np.int64)
    np.cumsum(counts, out=in_ptr[1:])
    in_idx = np.fromiter((u for ins in prep.inputs for u in ins), np.int64, int(in_ptr[-1]))
    root = np.asarray(prep.root if prep.root else range(n), np.int64)
    written = {r for roots in prep.written.values() for r in roots}
    overwritten = np.zeros(n, bool)
    overwritten[list(written)] = True
    ow = overwritten[root[in_idx]]
    seen = np.concatenate([[0], np.cumsum(ow, dtype=np.int64)])
    ow_ptr = seen[in_ptr]
    ups = list(prep.updates)
    upd_in = [u for p in ups for u in prep.inputs[p]]
    starts = np.cumsum([0] + [len(prep.inputs[p]) for p in ups[:-1]]) if ups else []
    pairs = [(j, r) for j, p in enumerate(ups) for r in prep.written.get(p, ())]
    early = np.asarray(prep.early, np.int64)
    is_early = np.zeros(n, bool)
    is_early[early] = True
    to_end = np.zeros(n, bool)
    to_end[list(prep.wanted | prep.held_end)] = True
    return Arrays(np.asarray(prep.phase, np.int8), np.asarray(prep.late_node, bool), early,
                  is_early, in_ptr, in_idx, root, ow_ptr, in_idx[ow], root[in_idx[ow]],
                  overwritten[root], np.asarray(ups, np.int64), np.asarray(starts, np.int64),
                  np.asarray(upd_in, np.int64),
                  np.asarray([j for j, _ in pairs], np.int64),
                  np.asarray([r for _, r in pairs], np.int64),
                  np.asarray(prep.bytes, np.int64), np.asarray(prep.full_bytes, np.int64),
                  to_end)


def rows(ptr: np.ndarray, which: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The entries of rows `which` of a row table (`ptr` its row starts), row by row in
    order: (the index into `which` each belongs to, its index in the table)."""
    counts = ptr[which + 1] - ptr[which]
    owner = np.repeat(np.arange(len(which)), counts)
    begins = np.cumsum(counts) - counts
    return owner, np.repeat(ptr[which] - begins, counts) + np.arange(int(counts.sum()))


def place(n: int, need: dict[int, int], rec: list[bool], first_bwd: int, prefetch: int
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int], list[int]]:
    """2. clones and prefetches before the node where they are needed, each place's in
    the values' forward order; each to_host right after its value. Returns (the kinds,
    the positions, how each value is read from its backward readers: 0 as is, 1 its
    clone, 2 its device copy; the values offloaded, the values cloned)."""
    ps = np.asarray(sorted(need), np.int64)
    ks = np.asarray([need[p] for p in ps.tolist()], np.int64)
    is_rec = np.asarray([rec[p] for p in ps.tolist()], bool)
    renamed = np.zeros(n, np.int8)
    renamed[ps[is_rec]] = 1
    renamed[ps[~is_rec]] = 2
    cp, ck, op, ok = ps[is_rec], ks[is_rec], ps[~is_rec], ks[~is_rec]
    # not before its own copy out (a split graph's backward starts before the last
    # micro-batch's forward ends)
    at = np.maximum(np.maximum(ok - prefetch, first_bwd), op + 1)
    base = np.arange(n, dtype=np.int64)
    kind = np.concatenate([np.full(n, NODE), np.full(len(cp), CLONE), np.full(len(op), D2H),
                           np.full(len(op), H2D)]).astype(np.int8)
    pos = np.concatenate([base, cp, op, op])
    anchor = np.concatenate([base, ck, op, at])
    slot = np.concatenate([np.ones(n, np.int8), np.zeros(len(cp), np.int8),
                           np.full(len(op), 2, np.int8), np.zeros(len(op), np.int8)])
    order = np.lexsort((pos, slot, anchor))
    return kind[order], pos[order], renamed, op.tolist(), cp.tolist()


def eager(a: Arrays, kind: np.ndarray, pos: np.ndarray, renamed: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray]:
    """3. apply_decisions' eager updates: the optimizer's sources before the first
    backward entry, and each update right after the last entry that makes one of its
    inputs or reads what it overwrites (a clone reads what it resolves to)."""
    gone = (kind == NODE) & a.is_early[pos]
    rk, rp = kind[~gone], pos[~gone]
    late = (rk == CLONE) | (rk == H2D) | ((rk == NODE) & a.late[rp])
    if not late.any():
        return kind, pos
    first = int(np.argmax(late))
    kind = np.concatenate([rk[:first], np.full(len(a.early), NODE, np.int8), rk[first:]])
    pos = np.concatenate([rp[:first], a.early, rp[first:]])
    m, n = len(kind), len(a.phase)
    idx = np.arange(m, dtype=np.int64)
    node = kind == NODE
    where = np.full(n, -1, np.int64)
    where[pos[node]] = idx[node]
    runs = np.flatnonzero(node | (kind == CLONE))
    owner, e = rows(a.ow_ptr, pos[runs])
    ent, read = runs[owner], a.ow_root[e]
    resolve = (kind[ent] == CLONE) | (a.phase[pos[ent]] == BWD)
    keep = ~resolve | (renamed[a.ow_input[e]] == 0)
    out = np.flatnonzero((kind == D2H) & a.overwritten[pos])
    ent = np.concatenate([ent[keep], out])
    read = np.concatenate([read[keep], a.root[pos[out]]])
    # the last and the last but one entry reading each overwritten storage
    top = np.full(n, -1, np.int64)
    np.maximum.at(top, read, ent)
    other = ent != top[read]
    second = np.full(n, -1, np.int64)
    np.maximum.at(second, read[other], ent[other])
    at = where[a.updates]
    last = np.maximum.reduceat(where[a.upd_in], a.upd_in_start)
    reader = np.where(top[a.root_of_upd] != at[a.upd_of_root], top[a.root_of_upd],
                      second[a.root_of_upd])
    np.maximum.at(last, a.upd_of_root, reader)
    moved = last < at
    if not moved.any():
        return kind, pos
    order = _moved_order(m, dict(zip(at[moved].tolist(), last[moved].tolist())))
    return kind[order], pos[order]


def _moved_order(m: int, moves: dict[int, int]) -> np.ndarray:
    """The entries with each moved one (entry -> the entry it follows) right after its
    anchor, those following one anchor in their own order, each followed at once by
    those that follow it."""
    after: dict[int, list[int]] = {}
    for k in sorted(moves):
        after.setdefault(moves[k], []).append(k)
    anchor = np.arange(m, dtype=np.int64)
    rank = np.zeros(m, np.int64)
    for start in sorted(after):
        if start in moves:  # (placed with the anchor it follows)
            continue
        stack, r = list(reversed(after[start])), 0
        while stack:
            j = stack.pop()
            r += 1
            anchor[j], rank[j] = start, r
            stack.extend(reversed(after.get(j, ())))
    return np.lexsort((rank, anchor))


class Reads(NamedTuple):
    """Who reads what in a schedule, by value id: p (original), n + p (clone), 2n + p
    (device copy), 3n + p (host copy)."""

    started: np.ndarray  # each device value's id, in the order of the entries making them
    start: np.ndarray  # ... and the entry that makes it
    last: np.ndarray  # the last entry reading each value id (-1: none)
    waits: dict[int, list[int]]  # entry -> offloaded values whose device copies it reads
    host_start: dict[int, int]  # value -> the entry that copies it to the host


def reads(a: Arrays, kind: np.ndarray, pos: np.ndarray, renamed: np.ndarray,
          held: dict[int, list[int]]) -> Reads:
    """4. who reads what (`Reads`); `held`: values held to a later node's entry."""
    n, m = len(a.phase), len(kind)
    idx = np.arange(m, dtype=np.int64)
    runs = np.flatnonzero((kind == NODE) | (kind == CLONE))
    owner, e = rows(a.in_ptr, pos[runs])
    ent, u = runs[owner], a.in_idx[e]
    # backward nodes and clones read the renamed values: the original (0), its clone (1)
    # or its device copy (2)
    renames = (kind[ent] == CLONE) | (a.phase[pos[ent]] == BWD)
    r = np.where(renames, renamed[u], 0).astype(np.int64)
    last = np.full(4 * n, -1, np.int64)
    np.maximum.at(last, r * n + u, ent)
    waits: dict[int, list[int]] = {}
    dev = r == 2
    for i, v in zip(ent[dev].tolist(), u[dev].tolist()):
        waits.setdefault(i, []).append(v)
    if held:
        node = kind == NODE
        where = np.full(n, -1, np.int64)
        where[pos[node]] = idx[node]
        for p, us in held.items():
            for v in us:
                last[v] = max(last[v], where[p])
    out = np.flatnonzero(kind == D2H)
    po = pos[out]
    state = a.phase[po] == STATE
    np.maximum.at(last, np.where(state, 2 * n + po, po), out)
    copies = np.flatnonzero(kind == H2D)
    np.maximum.at(last, 3 * n + pos[copies], copies)
    made = np.flatnonzero(kind != D2H)
    started = pos[made] + n * np.where(kind[made] == H2D, 2, kind[made]).astype(np.int64)
    return Reads(started, made, last, waits, dict(zip(po.tolist(), out.tolist())))


def lifetimes(a: Arrays, rd: Reads, m: int) -> np.ndarray:
    """5. each device value's (id, bytes, first entry, one past the last entry alive),
    in the order they are made; values of no bytes are left out."""
    n = len(a.phase)
    vid, s = rd.started, rd.start
    p = vid % n
    b = np.where(a.phase[p] != STATE, a.nbytes[p], np.where(vid >= 2 * n, a.full[p], 0))
    keep = b != 0
    vid, s, p, b = vid[keep], s[keep], p[keep], b[keep]
    last = rd.last[vid]
    # nobody reads it: dropped as soon as made
    e = np.where((vid < n) & a.to_end[p], m, np.where(last >= 0, last + 1, s + 1))
    return np.stack([vid, b, s, e], axis=1) if len(vid) else np.zeros((0, 4), np.int64)


def timeline(life: np.ndarray, m: int, base: int) -> np.ndarray:
    """The bytes held after each of `m` entries: `base` and the values of `life` alive."""
    diff = np.zeros(m + 1, np.int64)
    diff[0] = base
    np.add.at(diff, life[:, 2], life[:, 1])
    np.add.at(diff, life[:, 3], -life[:, 1])
    return np.cumsum(diff[:m])
