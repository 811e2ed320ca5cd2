"""The optimizer as graph nodes: one in-place update node per parameter.

`add_optimizer(g, kind, **hyper)` takes a training graph (from `autodiff`) and appends
  - an `input` node `lr` (a scalar) so a schedule can change the learning rate every step
    without rebuilding the graph (its `default` attribute is used when it is not fed);
  - optimizer state as `buffer` nodes with `attrs["role"] = "optimizer_state"`
    (`<param>.momentum_buffer`, `<param>.exp_avg`, `<param>.exp_avg_sq`, and one shared
    `optimizer.step` counter for adam/adamw), initialised to zeros;
  - the update nodes (`sgd_update`, `adam_update`, `step_increment`), listed in
    `outputs["updates"]`. They are in place: `OpDef.writes` names the inputs
    whose storage the kernel overwrites (parameter and state), and `attrs` carry the
    hyper-parameters. Their value is the updated parameter.

Semantics are PyTorch's: SGD(lr, momentum, nesterov, weight_decay) with dampening 0;
Adam(lr, betas, eps, weight_decay) with L2 decay added to the gradient; AdamW with
decoupled decay p *= 1 - lr * weight_decay; both with bias correction. With
`clip_grad_norm=c` the gradients are first scaled as torch.nn.utils.clip_grad_norm_(c)
scales them (`_clip_grad_norm`).

`group_updates(g)` then makes the updates that run one after another (with nothing but
other updates between them, as `add_optimizer` leaves them at the end of the step) one
`*_update_group` node per kind, hyper-parameters, dtype and device: PyTorch's
multi-tensor ("foreach") optimizers, as a rewrite. A batchnorm weight or bias gradient
the group reads as a row of batchnorm's backward statistics, not as its copy. The
numbers do not change.
"""
from __future__ import annotations

from netdsl.errors import NetdslError
from netdsl.ir import registry
from netdsl.ir.graph import Graph, Node
from netdsl.ir.ops.optim import GROUP_SHARED, group_op, member_inputs
from netdsl.ir.placement import replica_key
from netdsl.ir.rewrite import make_node, make_source
from netdsl.ir.types import TensorType
from netdsl.passes.registry import register_pass

KINDS = {
    "sgd": {"lr": 0.1, "momentum": 0.0, "nesterov": False, "weight_decay": 0.0,
            "clip_grad_norm": None},
    "adam": {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0,
             "clip_grad_norm": None},
    "adamw": {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 1e-2,
              "clip_grad_norm": None},
}


def _state(g: Graph, name: str, like: Node, shape=None, dtype=None) -> str:
    shape = like.type.shape if shape is None else shape
    t = TensorType(tuple(shape), dtype or like.type.dtype)
    g.add(make_source(name, "buffer", t,
                      {"shape": tuple(shape), "init": "zeros", "fan_in": 1, "dtype": t.dtype,
                       "role": "optimizer_state"}, like=like,
                      # the state of a parameter's shard is the same shard of the state
                      meta={"phase": "optimizer", **({"shard": like.meta["shard"]}
                                                     if "shard" in like.meta else {})}))
    return name


def _update(g: Graph, name: str, op_name: str, inputs: list[str], attrs: dict,
            like: Node, gate: str | None = None) -> str:
    meta = {"phase": "optimizer", **({"gate": gate} if gate else {})}
    g.add(make_node(g, name, op_name, inputs, attrs, like=like, meta=meta))
    return name


def _gates(g: Graph, grads: list[str]) -> list[str | None]:
    """Per gradient, the f16 loss scale's flag its update is skipped by (the `unscale`
    that made it reads it: netdsl.passes.precision), or None."""
    return [g[x].inputs[2] if g[x].op == "unscale" else None for x in grads]


@register_pass("optimizer")
def add_optimizer(g: Graph, kind: str = "sgd", **hyper) -> Graph:
    """A copy of training graph `g` with `kind` ("sgd" | "adam" | "adamw") update nodes."""
    if kind not in KINDS:
        raise NetdslError(f"unknown optimizer `{kind}`; choose one of {', '.join(KINDS)}")
    unknown = set(hyper) - set(KINDS[kind])
    if unknown:
        raise NetdslError(f"optimizer {kind} has no setting {', '.join(sorted(unknown))}; "
                          f"it takes {', '.join(KINDS[kind])}")
    if "grads" not in g.outputs:
        raise NetdslError(f"graph `{g.name}` has no gradients; run autodiff first")
    if "updates" in g.outputs:
        raise NetdslError(f"graph `{g.name}` already has an optimizer")
    h = {**KINDS[kind], **hyper}
    g = g.copy()
    lr = g.fresh_name("lr")
    g.add(make_source(lr, "input", TensorType((), "f32"),
                      {"shape": (), "dtype": "f32", "default": float(h["lr"]), "role": "lr"},
                      meta={"phase": "optimizer"}))
    # what each gradient updates: its parameter, or (sharded state, `parallel.zero`) the
    # piece of it that this replica updates
    targets = g.meta.get("update_targets")
    params = ([g[x] for x in targets] if targets is not None
              else [n for n in g.nodes if n.op == "param"])
    grads = list(g.outputs["grads"])
    gates = _gates(g, grads)
    if h["clip_grad_norm"] is not None and params:  # (nothing to clip without parameters)
        grads = _clip_grad_norm(g, params, grads, float(h["clip_grad_norm"]))
    updates: list[str] = []
    step = None
    if kind in ("adam", "adamw"):
        step = _state(g, g.fresh_name("optimizer.step"), g[lr], shape=(), dtype="i64")
        updates.append(_update(g, g.fresh_name("optimizer.step_increment"), "step_increment",
                               [step], {}, g[lr], next(filter(None, gates), None)))
        step = updates[-1]  # updates read the incremented counter (t = 1 on the first step)
    for p, gp, gate in zip(params, grads, gates, strict=True):
        name = g.fresh_name(f"{p.name}.update")
        if kind == "sgd":
            ins = [p.name, gp, lr]
            if h["momentum"]:
                ins.append(_state(g, g.fresh_name(f"{p.name}.momentum_buffer"), p))
            attrs = {"momentum": h["momentum"], "nesterov": h["nesterov"],
                     "weight_decay": h["weight_decay"]}
            if h["nesterov"] and not h["momentum"]:
                raise NetdslError("sgd: nesterov momentum needs momentum > 0")
            updates.append(_update(g, name, "sgd_update", ins, attrs, p, gate))
        else:
            m = _state(g, g.fresh_name(f"{p.name}.exp_avg"), p)
            v = _state(g, g.fresh_name(f"{p.name}.exp_avg_sq"), p)
            attrs = {"beta1": h["beta1"], "beta2": h["beta2"], "eps": h["eps"],
                     "weight_decay": h["weight_decay"], "decoupled": kind == "adamw"}
            updates.append(_update(g, name, "adam_update", [p.name, gp, lr, m, v, step],
                                   attrs, p, gate))
    g.outputs["updates"] = updates
    g.meta["optimizer"] = {"kind": kind, **h}
    return g  # (verified by run_pipeline)


def _clip_grad_norm(g: Graph, params: list[Node], grads: list[str],
                    max_norm: float) -> list[str]:
    """The gradients scaled by min(1, max_norm / (their global 2-norm + 1e-6)), as
    torch.nn.utils.clip_grad_norm_ scales them before the step: the squares of every
    gradient summed over the devices (`per_device_total` of `grad_sumsq`), then per
    device the factor (`clip_factor`) and a `mul` per gradient (each original freed as
    its scaled copy is made: one gradient more at a time)."""
    by_device: dict[int | None, list[tuple[Node, str]]] = {}
    for p, gp in zip(params, grads, strict=True):
        by_device.setdefault(p.device, []).append((p, gp))
    total = per_device_total(g, params, grads, "grad_sumsq", "optimizer.grad_sumsq")
    scaled: dict[str, str] = {}
    for d, pg in by_device.items():
        factor = g.fresh_name(f"optimizer.clip_factor{'' if d is None else f'@d{d}'}")
        g.add(make_node(g, factor, "clip_factor", [total[d]], {"max_norm": max_norm},
                        like=pg[0][0], meta={"phase": "optimizer"}))
        for p, gp in pg:
            name = g.fresh_name(f"{p.name}.grad_clipped")
            g.add(make_node(g, name, "mul", [gp, factor], {}, like=p,
                            meta={"phase": "optimizer", "clip_of": gp}))
            scaled[gp] = name
    return [scaled[gp] for gp in grads]


def per_device_total(g: Graph, params: list[Node], grads: list[str], op: str,
                     base: str) -> dict[int | None, str]:
    """A scalar over every gradient, on each device that holds parameters: per device
    `op` (a sum: `grad_sumsq`, `found_inf`) of the gradients it owns (each parameter, or
    shard of one, is owned by the first device that holds it: a split's replicas hold
    the same summed gradient by now; a device that owns none has a 0), the devices'
    values added by an all_reduce over them. Returns {device: the node holding it}."""
    by_device: dict[int | None, Node] = {}
    owned: dict[int | None, list[str]] = {}
    owners: set[str] = set()
    for p, gp in zip(params, grads, strict=True):
        by_device.setdefault(p.device, p)
        key = replica_key(p)
        if key not in owners:
            owners.add(key)
            owned.setdefault(p.device, []).append(gp)
    partial: dict[int | None, str] = {}
    for d, p in by_device.items():
        at = "" if d is None else f"@d{d}"
        name = partial[d] = g.fresh_name(f"{base}{at}")
        if owned.get(d):
            g.add(make_node(g, name, op, owned[d], {}, like=p, meta={"phase": "optimizer"}))
        else:  # every parameter here is owned by another device
            dtype = registry.OPS[op].shape([g[x].type for x in grads[:1]], {}).dtype
            g.add(make_node(g, name, "fill", [], {"shape": (), "value": 0.0, "dtype": dtype},
                            like=p, meta={"phase": "optimizer"}))
    if len(by_device) == 1:
        return partial
    group = tuple(sorted(by_device))  # (a split: every device holds parameters)
    names = [g.fresh_name(f"{base}.all_reduce@d{d}") for d in group]
    for j, (d, name) in enumerate(zip(group, names, strict=True)):
        g.add(make_node(g, name, "all_reduce", [partial[x] for x in group],
                        {"group": group, "index": j}, like=by_device[d],
                        meta={"phase": "optimizer", "members": tuple(names)}))
    return dict(zip(group, names, strict=True))


@register_pass("group_updates")
def group_updates(g: Graph) -> Graph:
    """A copy of `g` whose runs of consecutive updates (source nodes aside) are one group
    node per (op, hyper-parameters, shared inputs, dtype, device), at the place of the
    group's last member. Within a run only updates run, each writing its own parameter
    and state, so their order does not matter; an update whose value something reads (an
    optimizer state's write-back) stays as it is."""
    readers = g.consumers()
    read = {i for i, rs in readers.items() if rs}
    wanted = {x for role, names in g.outputs.items() if role != "updates" for x in names}
    runs: list[list[Node]] = [[]]
    for n in g.nodes:
        if n.op in GROUP_SHARED and n.name not in read and n.name not in wanted:
            runs[-1].append(n)
        elif not n.is_source:
            runs.append([])
    groups: dict[str, list[Node]] = {}  # the last member's name -> the members
    for run in runs:
        by_key: dict[tuple, list[Node]] = {}
        for n in run:
            key = (n.op, tuple(sorted(n.attrs.items())), tuple(n.inputs[i] for i in
                   GROUP_SHARED[n.op]), len(n.inputs), n.type.dtype, n.device,
                   n.meta.get("gate"))
            by_key.setdefault(key, []).append(n)
        for members in by_key.values():
            if len(members) > 1:
                groups[members[-1].name] = members
    if not groups:
        return g
    g = g.copy()
    gone = {m.name for ms in groups.values() for m in ms}
    made: dict[str, str] = {}  # member -> its group
    nodes = []
    for n in list(g.nodes):  # (each group is added to g as it is made, for fresh_name)
        if n.name not in gone:
            nodes.append(n)
            continue
        members = groups.get(n.name)
        if members is None:
            continue
        first = members[0]
        shared = [first.inputs[i] for i in GROUP_SHARED[first.op]]
        own, rows = [], []
        for m in members:
            ins = member_inputs(first.op, m.inputs)
            ins[1], row = _statistics_row(g, ins[1], m.name, readers)
            own += ins
            rows.append(row)
        name = g.fresh_name(f"optimizer.{first.op}_group")
        node = make_node(g, name, group_op(first.op), shared + own,
                         {**first.attrs, "arity": len(first.inputs) - len(shared),
                          "grad_rows": tuple(rows) if max(rows) >= 0 else ()},
                         like=first, meta={"phase": "optimizer", "members": len(members),
                                           **({"gate": first.meta["gate"]}
                                              if "gate" in first.meta else {})})
        nodes.append(g.add(node))
        made.update((m.name, name) for m in members)
    g.nodes = nodes
    if "updates" in g.outputs:  # each group once, where its first member was listed
        g.outputs["updates"] = list(dict.fromkeys(made.get(u, u)
                                                  for u in g.outputs["updates"]))
    return g  # (verified by run_pipeline)


def _statistics_row(g: Graph, grad: str, update: str, readers) -> tuple[str, int]:
    """(what a group member reads as its gradient, the row it takes of it or -1).
    batchnorm's weight and bias gradients are rows of its backward statistics, which
    `batchnorm_grad_affine` copies out; where the update is the copy's only reader, the
    group reads the row itself: a GPU step saves a launch and a node a copy (ResNet-164:
    326 a step). The copy stays in the graph for runs that ask for the gradients."""
    n = g[grad]
    if n.op == "batchnorm_grad_affine" and readers[grad] == [update]:
        return n.inputs[0], n.attrs["row"]
    return grad, -1
