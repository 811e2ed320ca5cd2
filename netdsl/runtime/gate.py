"""The equivalence gate (`netdsl split --verify`): run the split training step and the
single-device step on the same batch from the same initial state, in float64, and
compare the loss, every parameter's gradient and every state value after the step
(parameters, optimizer state, batchnorm running statistics).

With micro-batches (or `--bn local`) a network with batchnorm normalises each part with
its own statistics, which is not the single-device step; the reference is then the
single-device graph run over the same parts (gradient accumulation on one device), and
the result says so; data replicas synchronising batchnorm over their micro-batches are
compared with one device over the same micro-batches.

On a difference, both forward passes are run again keeping every value, and the first
forward node (in the single-device order) whose parts, put back together, differ from the
single-device value is named with its source line.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from netdsl.ir.graph import Graph
from netdsl.ir.placement import Shard, canonical
from netdsl.parallel.split import SplitSpec
from netdsl.runtime.executor import Executor
from netdsl.step.graphs import split_training_step

ROLES = ("loss", "output", "grads", "updates", "state_updates")  # what a step computes


@dataclass
class GateResult:
    ok: bool
    rtol: float
    loss: float
    loss_rel: float
    grad_rel: float  # the largest relative difference over all gradients
    state_rel: float
    worst: str  # the value with the largest difference
    reference: str  # "single-device step" or "single-device step over the same parts"
    comm_bytes: dict[int, int] = field(default_factory=dict)  # sent, as counted (float64)
    peak_by_device: dict[int, int] = field(default_factory=dict)  # counted by the executor
    first_divergence: str | None = None
    dtype: str = "f64"  # the gate runs both steps in float64: bytes are float64 bytes

    def to_json(self) -> dict:
        return dict(self.__dict__)


def rel(a, b, whole=None) -> float:
    """The largest difference of `a` from `b` relative to `b`'s largest magnitude, or to
    that of `whole`, the single-device value `b` is a piece of (a shard's gradient can be
    rounding noise alone: a key projection's bias gets none, mathematically)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ref = b if whole is None else np.asarray(whole, np.float64)
    scale = max(float(np.abs(ref).max(initial=0.0)), 1e-300)
    return float(np.abs(a - b).max(initial=0.0)) / scale


def _roles(g: Graph) -> tuple[str, ...]:
    return tuple(r for r in ROLES if r in g.outputs)


def verify_split(fwd: Graph, batch: int, spec: SplitSpec, optimizer: dict,
                 feeds: dict, split: Graph | None = None, seed: int = 0,
                 rtol: float = 1e-9) -> GateResult:
    """Compare the split step with the single-device step (module docstring). `fwd` is
    the unbound forward graph, `feeds` one batch by input name."""
    per_part_bn = any(n.op == "batchnorm" for n in fwd.nodes) and (
        spec.microbatches > 1 or (spec.bn == "local" and spec.data > 1))
    if per_part_bn and spec.bn == "sync":
        # micro-batch m of every replica normalises as one device's micro-batch m
        ref_spec = SplitSpec(microbatches=spec.microbatches)
        reference = "single-device step over the same micro-batches (batchnorm per " \
                    "micro-batch)"
    elif per_part_bn:
        ref_spec = SplitSpec(microbatches=spec.data * spec.microbatches, bn="local")
        reference = "single-device step over the same parts (batchnorm per part)"
    else:
        ref_spec = SplitSpec()
        reference = "single-device step"
    single = split_training_step(fwd, batch, ref_spec, optimizer)
    split = split if split is not None else split_training_step(fwd, batch, spec, optimizer)
    e1 = Executor(single, "numpy", "f64", seed)
    e2 = Executor(split, "numpy", "f64", seed)
    o1 = e1.run(dict(feeds), training=True, roles=_roles(single), step=0)
    o2 = e2.run(dict(feeds), training=True, roles=_roles(split), step=0)
    loss1, loss2 = float(o1["loss"][0]), float(o2["loss"][0])
    g1 = dict(zip([canonical(p.name) for p in single.params()], o1["grads"], strict=True))
    worst, grad_rel = "", 0.0
    for p, gv in zip(updated(split), o2["grads"], strict=True):
        full = g1[canonical(p.name)]
        r = rel(gv, _slice_of(p, full), whole=full)
        if r > grad_rel:
            worst, grad_rel = f"gradient of {p.name}", r
    s1, s2 = e1.state_dict(), e2.state_dict()
    state_rel = 0.0
    for k in s1:
        r = rel(s2[k], s1[k])
        if r > state_rel:
            state_rel = r
            if r > grad_rel:
                worst = f"state {k} after the step"
    loss_rel = abs(loss2 - loss1) / max(abs(loss1), 1e-300)
    ok = max(loss_rel, grad_rel, state_rel) <= rtol
    result = GateResult(ok, rtol, loss2, loss_rel, grad_rel, state_rel, worst, reference,
                        dict(sorted(e2.comm.sent_bytes.items())), dict(e2.peak_by_device))
    if not ok:
        result.first_divergence = first_divergence(single, split, feeds, seed, fwd=fwd)
    return result


def updated(g: Graph) -> list:
    """What each of the step's gradients is of: its parameters, or the pieces of them
    each replica updates (sharded state, `meta["update_targets"]`)."""
    targets = g.meta.get("update_targets")
    return g.params() if targets is None else [g[x] for x in targets]


def _slice_of(p, full):
    """The part of a single-device value that split parameter `p` holds (a shard's rows)."""
    sh = Shard.of(p)
    return full if sh is None else sh.take(full)


def _copies(g: Graph) -> dict[str, list]:
    """The forward copies of every single-device node in a split graph, by rows."""
    out: dict[str, list] = {}
    for n in g.nodes:
        o = n.meta.get("origin")
        if (o is None or n.is_source or n.meta.get("phase") is not None
                or n.meta.get("combined") or n.op in ("send", "recv")
                or n.meta.get("mirror") or n.meta.get("tensor_shard")
                or (n.meta.get("sync_bn") and n.name != n.meta["sync_bn"])):
            continue
        out.setdefault(o, []).append(n)
    for v in out.values():
        v.sort(key=lambda m: ((m.meta.get("rows") or (0, 0))[0],
                              (m.meta.get("hrows") or (0, 0))[0]))
    return out


def first_divergence(single: Graph, split: Graph, feeds: dict, seed: int,
                     rtol: float = 1e-9, fwd: Graph | None = None) -> str | None:
    """The first forward node of the single-device graph whose split copies, joined by
    rows, differ from it: '%name (op) at FILE:LINE:COL: relative difference r', the op
    as the user's forward graph `fwd` has it where it has the node (not the rewrite's:
    a synchronised batchnorm is the file's batchnorm)."""
    want, have = _copies(single), _copies(split)
    origins = [o for o in want if o in have]

    def values(g: Graph, copies) -> dict:
        probe = g.copy()
        probe.outputs["probe"] = [n.name for o in origins for n in copies[o]]
        out = Executor(probe, "numpy", "f64", seed).run(dict(feeds), training=True,
                                                        roles=("probe",), step=0)["probe"]
        return dict(zip(probe.outputs["probe"], out, strict=True))

    va, vb = values(single, want), values(split, have)

    def joined(copies, v):
        parts = [v[n.name] for n in copies]
        if len(parts) > 1 and all(n.meta.get("hrows") for n in copies):
            # a spatial split's strips: joined by height within each replica's rows
            rows: dict = {}
            for n, p in zip(copies, parts, strict=True):
                rows.setdefault(n.meta.get("rows"), []).append(p)
            parts = [np.concatenate(ps, axis=2) for ps in rows.values()]
            if len(parts) == 1:
                return parts[0]
        if len(parts) > 1 and all(n.meta.get("rows") for n in copies):
            return np.concatenate(parts)
        return parts[0]

    for o in origins:
        if len(have[o]) > 1 and not have[o][0].type.shape:
            continue  # each copy's share of a reduced value (the loss): not joinable
        a, b = joined(want[o], va), joined(have[o], vb)
        r = rel(b, a) if a.shape == b.shape else float("inf")
        if r > rtol:
            n = want[o][0]
            where = f" at {n.loc}" if n.loc else ""
            op = fwd[o].op if fwd is not None and o in fwd else n.op
            return f"%{o} ({op}){where}: relative difference {r:.3g}"
    return None
