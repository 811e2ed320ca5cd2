"""Splitting a training step across devices: `split_step` turns the unbound forward graph
into one training-step graph whose nodes are placed on devices.

The schemes, each a rewrite of the forward graph before autodiff (so the backward pass,
with its communication, comes from the gradient rules):
- **data** (`data=D`): D copies, each on its own device with its share of the batch and a
  replica of the state; batchnorm synchronised over the copies (`bn="sync"`, the
  default: the step equals the single-device step) or per device (`bn="local"`).
- **pipeline** (`pipeline=P, microbatches=M`): the layer sequence cut into P stages of
  balanced predicted time (`@stage(k)` pins a node), each on its own device, the batch cut
  into M micro-batches that flow through the stages; the state of a stage stays on it.
  GPipe order (every device runs its micro-batches' forward parts in order, then their
  backward parts in reverse order), 1F1B (`schedule="1f1b"`) or ZB-H1 (`"zb-h1"`):
  `order.order_micro_batches`. With `virtual_stages=V` (interleaved 1F1B) the layers are
  cut into P x V chunks, chunk c on stage c % P.
- hybrids: `data=D, pipeline=P` uses D x P devices, replica r's stage s on r * P + s.
- **tensor** (`tensor=T`, `tensor.py`): linear and conv2d layers split by output channels,
  alone or in each replica, stage and micro-batch of a data x pipeline split (3-D).
- devices are numbered in Megatron-LM's order (`device_index`): replica r's stage s,
  tensor rank t on (r * P + s) * T + t.
- **spatial** (`spatial=S`, `spatial.py`): the image height split into S strips, with halo
  exchange for convolutions and pooling; the head runs on device 0.
- **shard** (`shard=1|2|3`, with data replicas: alone, or those of each stage and tensor
  rank): ZeRO's sharded state, the optimizer state (1), and the gradients (2, `zero.py`),
  and the parameters (3, `zero_params.py`), over the devices holding a parameter's copies.

After autodiff, the gradients of replicated parameters are all-reduced
(`gradsync.sync_gradients`), then the optimizer adds each device's updates. `check.check`
verifies the structure (every forward node once per part, every gradient reaches its
update, no value read on another device without communication).
"""
from __future__ import annotations

from dataclasses import dataclass

import netdsl.parallel.gradsync  # noqa: F401  (registers the "sync_gradients" pass)
import netdsl.parallel.zero  # noqa: F401  (registers the sharded state's passes)
from netdsl.config import MICROBATCHES_APPLY
from netdsl.errors import SplitError
from netdsl.ir import registry
from netdsl.ir.graph import Graph, Node
from netdsl.ir.placement import copy_name, even_parts
from netdsl.ir.precision import kernels_of
from netdsl.memory.profiles import Profile
from netdsl.parallel.check import check
from netdsl.parallel.order import order_micro_batches
from netdsl.parallel.predict import node_time
from netdsl.parallel.replicate import Part, batch_rows, combine, connect, copy_forward
from netdsl.parallel.schedules import SCHEDULES
from netdsl.parallel.syncbn import NORMS, defer_running_stats, sync_batchnorms
from netdsl.parallel.zero_params import shard_parameters
from netdsl.passes.device import for_device
from netdsl.passes.fuse import fuse_grads, fuse_options, join_slice_grads
from netdsl.passes.pipeline import run_pipeline

STRATEGIES = ("data", "pipeline", "hybrid", "tensor", "spatial", "none")
SHARD_STAGES = (1, 2, 3)  # ZeRO's: optimizer state, and gradients, and parameters


@dataclass(frozen=True)
class SplitSpec:
    """How to split: `data` replicas x `pipeline` stages, `microbatches` per step."""

    data: int = 1
    pipeline: int = 1
    microbatches: int = 1
    bn: str = "sync"  # sync | local
    tensor: int = 1  # output-channel splits of linear and conv2d layers
    schedule: str = "gpipe"  # gpipe | 1f1b: the order of a pipeline's micro-batches
    spatial: int = 1  # strips of the image height (alone)
    shard: int = 0  # ZeRO stage of the data replicas' state (0: replicated; `zero.py`)
    virtual_stages: int = 1  # model chunks per pipeline stage (interleaved 1F1B)

    @property
    def devices(self) -> int:
        return self.data * self.pipeline * self.tensor * self.spatial

    @property
    def name(self) -> str:
        if self.devices == 1:
            return "none"
        if self.tensor > 1:
            return "tensor" if self.data == self.pipeline == 1 else "hybrid"
        if self.spatial > 1:
            return "spatial" if self.data == 1 else "hybrid"
        if self.pipeline == 1:
            return "data"
        return "pipeline" if self.data == 1 else "hybrid"

    def describe(self) -> str:
        parts = []
        if self.data > 1:
            parts.append(f"data={self.data}" + (f", shard={self.shard}" if self.shard else ""))
        if self.pipeline > 1:
            parts.append(f"pipeline={self.pipeline}, microbatches={self.microbatches}"
                         + (f", {self.schedule}" if self.schedule != "gpipe" else "")
                         + (f", virtual_stages={self.virtual_stages}"
                            if self.virtual_stages > 1 else ""))
        if self.tensor > 1:
            parts.append(f"tensor={self.tensor}")
        if self.spatial > 1:
            parts.append(f"spatial={self.spatial}")
        if self.pipeline == 1 and self.microbatches > 1:  # gradients accumulated
            parts.append(f"microbatches={self.microbatches}"
                         + (", gpipe" if self.schedule == "gpipe" else ""))
        return ", ".join(parts) or "one device"


def split_forward(fwd: Graph, batch: int, spec: SplitSpec, gather: tuple[str, ...] = (),
                  stage_of: dict[str, int] | None = None,
                  profile: Profile | None = None) -> Graph:
    """The split forward graph (module docstring); `fwd` is unbound (batch `N`)."""
    if spec.bn not in ("sync", "local"):
        raise SplitError(f"--bn must be sync or local, not {spec.bn!r}")
    if "loss" not in fwd.outputs:
        raise SplitError(f"network `{fwd.name}` declares no loss; only a training step "
                         "is split")
    loss = fwd[fwd.outputs["loss"][0]]
    if loss.attrs.get("reduction") == "none":
        raise SplitError(f"the loss %{loss.name} is not reduced (reduction=\"none\"); a "
                         "split needs a scalar loss", )
    _check_devices(fwd, spec)  # (a tensor or spatial split ignored the pins)
    _check_virtual(fwd, spec)
    if spec.tensor > 1:
        return _tensor_forward(fwd, batch, spec, gather, stage_of, profile)
    if spec.spatial > 1:
        return _spatial_forward(fwd, batch, spec, gather)
    stages, virtual = spec.pipeline, spec.virtual_stages
    if stages > 1:
        stage_of = stage_of or assign_stages(
            fwd, stages * virtual, profile, max(1, batch // (spec.data * spec.microbatches)))
    micro = spec.microbatches
    synced = spec.bn == "sync" and spec.data > 1
    rows = _part_rows(batch, spec.data, micro, by_micro=synced)
    parts = []
    for r in range(spec.data):
        for m in range(micro):
            lo, hi = rows[r][m]
            # copies are named by replica (`@dR`) and micro-batch (`@mM`) so that every
            # copy differs from its original, whose name the combined result takes
            parts.append(Part(r if spec.data > 1 or stages == 1 else None,
                              m if stages > 1 or micro > 1 else None, lo, hi))

    def device_of(n: Node, p: Part) -> int:
        return device_index(spec, p.device or 0,
                            stage_of[n.name] % stages if stages > 1 else 0, 0)

    def state_name(n: Node, p: Part) -> str:
        return n.name if not p.device else copy_name(n.name, p.device)

    g, copies = copy_forward(fwd, parts, batch, state_name, device_of)
    if virtual > 1:
        for orig, names in copies.items():
            for x in names:
                g[x].meta["chunk"] = stage_of[orig]
    if micro > 1 and spec.bn == "sync":
        _normalise_micro_batches(g, copies, fwd, rows, spec.data, micro)
    elif synced:
        sync_batchnorms(g, copies, fwd, batch)
    else:
        running_stats_once(g, copies)
    # the results are made whole on device 0 (rank 0 logs and checkpoints); for a
    # pipeline that moves the parts' scalar losses and outputs from the last stage
    combine(g, fwd, parts, copies, batch, 0, gather)
    connect(g)
    g.meta["split"] = {"data": spec.data, "pipeline": spec.pipeline,
                       "microbatches": micro, "bn": spec.bn, "devices": spec.devices,
                       "strategy": spec.name}
    if stage_of:
        g.meta["split"]["stages"] = stages_summary(fwd, stage_of, stages * virtual)
    if virtual > 1:
        g.meta["split"]["virtual_stages"] = virtual
    return g


def _normalise_micro_batches(g: Graph, copies: dict[str, list[str]], fwd: Graph,
                             rows: list[list[tuple]], data: int, micro: int) -> None:
    """Batchnorm over micro-batches (`--bn sync`): micro-batch m of every replica together
    (rows by micro-batch: _part_rows) normalises with their joint statistics, a single
    replica's micro-batch with its own; each replica's running statistics are updated once
    from all its micro-batches' (defer_running_stats): the unsplit step's update."""
    done = {}
    for m in range(micro):
        if data > 1:
            group = {o: names[m::micro] for o, names in copies.items()}
            done |= sync_batchnorms(g, group, fwd, rows[-1][m][1] - rows[0][m][0],
                                    update=False)
        else:
            lo, hi = rows[0][m]
            done |= sync_batchnorms(g, {o: [names[m]] for o, names in copies.items()}, fwd,
                                    hi - lo, update=False, alone=True)
    defer_running_stats(g, [names[r * micro:(r + 1) * micro] for names in copies.values()
                            for r in range(data)], done)


def _part_rows(batch: int, data: int, micro: int, by_micro: bool) -> list[list[tuple]]:
    """rows[r][m]: the batch rows of replica r's micro-batch m, contiguous ranges of sizes
    differing by at most one. Replica by replica (replica r's micro-batches in turn), or,
    `by_micro` (synchronised batchnorm), micro-batch by micro-batch: micro-batch m of every
    replica together is the one device's micro-batch m of `--microbatches M`, rows
    even_parts(batch, M)[m], whose statistics the replicas' copies then share."""
    flat = batch_rows(batch, data * micro, "parts (devices x micro-batches)")
    if not by_micro or micro == 1:
        return [flat[r * micro:(r + 1) * micro] for r in range(data)]
    blocks = [[(lo + a, lo + b) for a, b in even_parts(hi - lo, data)]
              for lo, hi in even_parts(batch, micro)]
    return [[blocks[m][r] for m in range(micro)] for r in range(data)]


def _tensor_forward(fwd: Graph, batch: int, spec: SplitSpec, gather: tuple[str, ...],
                   stage_of: dict[str, int] | None = None,
                   profile: Profile | None = None) -> Graph:
    """Every tensor rank a copy of its part's rows; the chosen layers split by channels over
    the `tensor` ranks of each replica, stage and micro-batch. Devices in Megatron's order
    (`device_index`): replica r's stage s, tensor rank t on r * P * T + s * T + t."""
    from netdsl.parallel.tensor import split_layers
    ways, replicas, stages, micro = spec.tensor, spec.data, spec.pipeline, spec.microbatches
    if micro > 1 and stages == 1:
        raise SplitError(f"microbatches={micro}: {MICROBATCHES_APPLY}")
    if stages > 1:
        stage_of = stage_of or assign_stages(fwd, stages, profile,
                                             max(1, batch // (replicas * micro)))
    synced = spec.bn == "sync" and replicas > 1
    rows = _part_rows(batch, replicas, micro, by_micro=synced)
    # a part's `device` is its column r * T + t (it names the copies and the state); the
    # devices are placed by stage
    parts = [Part(r * ways + t, m if stages > 1 else None, lo, hi, mirror=t > 0)
             for r in range(replicas) for m, (lo, hi) in enumerate(rows[r])
             for t in range(ways)]

    def device_of(n: Node, p: Part) -> int:
        r, t = divmod(p.device, ways)
        return device_index(spec, r, stage_of[n.name] if stages > 1 else 0, t)

    g, copies = copy_forward(
        fwd, parts, batch, lambda n, p: n.name if not p.device else copy_name(n.name, p.device),
        device_of)
    # each tensor rank's batchnorm copies are normalised as the data x pipeline split's
    # (the mirrors of one part see the same rows and must not count them twice)
    for t in range(ways):
        mine = {o: names[t::ways] for o, names in copies.items()}
        if micro > 1 and spec.bn == "sync":
            _normalise_micro_batches(g, mine, fwd, rows, replicas, micro)
        elif synced:
            sync_batchnorms(g, mine, fwd, batch)
        else:
            running_stats_once(g, mine)  # every device's batchnorm sees its part's rows
    # sharded state's pieces are ranges of a parameter's rows (`flat_piece_shard`), which a
    # pair's input-channel shards are not: with shards every layer is gathered
    split_layers(g, copies, fwd, ways, replicas * micro, pair=not spec.shard)
    combine(g, fwd, parts, copies, batch, 0, gather)
    connect(g)
    g.meta["split"] = {"data": replicas, "pipeline": stages, "microbatches": micro,
                       "tensor": ways, "bn": spec.bn, "devices": spec.devices,
                       "strategy": spec.name, "layers": len(g.meta.get("tensor_layers", []))}
    if stages > 1:
        g.meta["split"]["stages"] = stages_summary(fwd, stage_of, stages)
    return g


def device_index(spec: SplitSpec, replica: int, stage: int, rank: int) -> int:
    """The device of data replica `replica`'s pipeline stage `stage`, tensor rank `rank`:
    Megatron-LM's order, tensor ranks fastest, then stages, then replicas (the devices of
    one tensor group side by side, where the interconnect is fastest; the inverse is
    `placement.position_of`)."""
    return (replica * spec.pipeline + stage) * spec.tensor + rank


def _spatial_forward(fwd: Graph, batch: int, spec: SplitSpec, gather: tuple[str, ...]) -> Graph:
    """Every device a strip of its replica's images through the trunk; each replica's
    head on its first device (replica r's strip k on device r * spatial + k)."""
    from netdsl.parallel.spatial import spatial_forward
    if spec.pipeline > 1 or spec.tensor > 1:
        raise SplitError("a spatial split does not combine with pipeline or tensor splits "
                         "yet")
    if spec.bn != "sync":
        raise SplitError("a spatial split always synchronises batchnorm over the strips "
                         "(statistics per strip would depend on where the image is cut); "
                         "drop --bn local")
    g, strips, reps = spatial_forward(fwd, batch, spec.spatial, gather, spec.data)
    sync_batchnorms(g, strips, fwd, batch)  # over every replica's strips: the whole batch
    if spec.data > 1:
        parts = [Part(s.base, None, s.lo, s.hi) for s in reps]
        heads = {x: [s.whole[x] for s in reps] for x in reps[0].whole}
        combine(g, fwd, parts, heads, batch, 0, gather)
    connect(g)
    g.meta["split"] = {"data": spec.data, "pipeline": 1, "microbatches": 1,
                       "spatial": spec.spatial, "bn": spec.bn, "devices": spec.devices,
                       "strategy": spec.name, "layers": len(g.meta["spatial_layers"])}
    return g


def defer_results(g: Graph) -> Graph:
    """Move the nodes that only make the step's results whole on device 0 (the parts'
    losses and outputs sent there and joined) to the end of the step: the backward pass
    does not read them (its seed is a constant), and run where autodiff left them they
    would make device 0 wait for the last part's forward before it sends any gradient."""
    late = [n for n in g.nodes if n.meta.get("combined") and n.meta.get("phase") is None]
    if late:
        names = {n.name for n in late}
        g.nodes = [n for n in g.nodes if n.name not in names] + late
    return g


def running_stats_once(g: Graph, copies: dict[str, list[str]]) -> None:
    """Batchnorm copies normalising their own part share one device's running statistics
    with the other parts there: only the first part's copy updates them (from its own
    statistics); the others are replays that neither read nor write them. The step then
    updates the statistics once, as one device does, and the copies stay in order for
    the in-place rule of `verify`."""
    for names in copies.values():
        first: set[int | None] = set()
        for x in names:
            n = g[x]
            if n.op not in NORMS:
                break
            if n.device in first:
                n.inputs = n.inputs[:len(n.inputs) - 2]
                n.attrs["replay"] = True
            first.add(n.device)


def split_step(fwd: Graph, batch: int, spec: SplitSpec, optimizer: dict,
               gather: tuple[str, ...] = (), stage_of: dict[str, int] | None = None,
               profile: Profile | None = None, device: str = "cpu",
               recheck_shapes: bool = True, precision: str = "f32") -> Graph:
    """The split training step: split forward, autodiff, gradient all-reduce, optimizer,
    then the structural check. `profile` prices nodes for balancing pipeline stages.
    Data and pipeline splits fuse as the single-device step on `device` ("cpu" or
    "gpu") does (`_fusing`), and every split's kernels take that device's variants (the
    `device` pass: a GPU's convolutions as columns and one batched GEMM). `precision`
    ("bf16", "f16"): the forward graph is made mixed-precision first, and f16's
    gradients are scaled (netdsl.passes.precision). `recheck_shapes` False: the final
    verify leaves out the shape rules (a candidate of `choose`, which verifies wholly the
    one it chooses)."""
    if precision != "f32":
        if spec.shard:
            raise SplitError(f"--precision {precision} does not combine with --shard yet "
                             "(the sharded update and gathers are built for f32 steps); "
                             "train sharded in f32, or at a precision without --shard")
        if spec.tensor > 1 or spec.spatial > 1:
            raise SplitError(f"--precision {precision} does not combine with a "
                             f"{spec.name} split yet (it cuts the layers whose weights "
                             "the step casts); use a data or pipeline split, or f32")
        fwd = run_pipeline(fwd, [("precision", {"dtype": precision,
                                                "device": kernels_of(device)})],
                           verify="structure")
    fusing = _fusing(fwd, spec, device)
    if fusing is not None:
        fwd = run_pipeline(fwd, [("fuse", fusing)], verify="structure")
    g = split_forward(fwd, batch, spec, gather, stage_of, profile)
    opt = dict(optimizer)
    kind = opt.pop("kind")
    stage = _shardable(spec) if spec.shard else 0
    if stage == 3:  # the parameters sharded, each unit gathered for its layers
        g = shard_parameters(g)
    scale = ["loss_scale"] if precision == "f16" else []
    sync = {0: ["sync_gradients", *scale], 3: ["gather_for_backward"]}.get(
        stage, [("shard_gradients", {"stage": stage})])
    g = run_pipeline(g, ["autodiff", *sync, ("optimizer", {"kind": kind, **opt}),
                         *(["gather_parameters"] if stage in (1, 2) else [])],
                     verify="structure")
    if spec.shard:
        g.meta["split"]["shard"] = spec.shard
    if spec.schedule not in SCHEDULES:
        raise SplitError(f"--schedule must be {', '.join(SCHEDULES[:-1])} or {SCHEDULES[-1]}, "
                         f"not {spec.schedule!r}")
    g = order_micro_batches(defer_results(g), spec.schedule)
    # after the reordering, which re-chains gradient sums by part: gradient sums of one
    # device into the kernels that make them (fuse_grads), q/k/v's into a concat
    if fusing is not None:
        g = fuse_grads(g, enabled=True)
    g = join_slice_grads(g)
    if device != "cpu":  # the kernels' variants for the device, as a single device's step
        g = for_device(g, device)
    # one verify for the reorderings, fusions and marks, every shape rule once (the shape
    # rules are most of a verify's time on a large step)
    g = g.verify(recheck_shapes=recheck_shapes)
    g.meta["split"].setdefault("schedule", spec.schedule)
    check(g, fwd)
    return g


def _check_virtual(fwd: Graph, spec: SplitSpec) -> None:
    """Interleaved 1F1B's conditions (Megatron-LM's): a pipeline in 1F1B order whose
    micro-batches go in groups of `pipeline`, no stage pinned (a pin names a stage, and
    a stage holds several chunks)."""
    v, p = spec.virtual_stages, spec.pipeline
    if v == 1:
        return
    if v < 1:
        raise SplitError(f"virtual_stages must be 1 or more, not {v}")
    if p < 2 or spec.schedule != "1f1b" or spec.microbatches % p:
        raise SplitError(
            f"virtual_stages={v} interleaves a pipeline's stages (interleaved 1F1B), and "
            "needs a pipeline of 2 or more stages in 1f1b order with micro-batches a "
            f"multiple of the stages; {spec.describe()} has "
            + ("no pipeline" if p < 2 else f"schedule {spec.schedule}"
               if spec.schedule != "1f1b" else f"{spec.microbatches} micro-batches"))
    if spec.tensor > 1:
        raise SplitError(f"virtual_stages={v} does not combine with tensor splits yet "
                         f"({spec.describe()}); give virtual_stages=1, or no tensor split")
    layers = sum(not n.is_source for n in fwd.nodes)
    if layers < p * v:
        raise SplitError(f"virtual_stages={v} cuts network `{fwd.name}` into {p} x {v} = "
                         f"{p * v} chunks, but it has {layers} operators; use at most "
                         f"{layers // p} virtual stages on {p} stages")
    pinned = next((n for n in fwd.nodes if "stage" in n.annotations
                   or "device" in n.annotations), None)
    if pinned is not None:
        raise SplitError(f"%{pinned.name}{f' ({pinned.loc})' if pinned.loc else ''} is pinned "
                         f"to a stage, which virtual_stages={v} does not combine with (a "
                         "stage holds several chunks of the layers); drop the @stage/@device "
                         "annotations or the virtual stages")


def _shardable(spec: SplitSpec) -> int:
    """The ZeRO stage of `spec`, which shards the state over data replicas: alone, or the
    replicas of each (tensor rank, stage) position of a 3-D split."""
    if spec.shard not in SHARD_STAGES:
        raise SplitError(f"shard must be {', '.join(map(str, SHARD_STAGES))}, not "
                         f"{spec.shard}")
    if spec.data < 2 or spec.spatial > 1:
        raise SplitError(f"shard={spec.shard} shards the state of data-parallel replicas; "
                         f"{spec.describe()} has "
                         + ("no data split" if spec.data < 2 else
                            "a spatial split besides, which it does not combine with yet"))
    return spec.shard


def _fusing(fwd: Graph, spec: SplitSpec, device: str) -> dict | None:
    """The `fuse` pass's options for the forward graph of a split, those of a single
    device's step (`fuse_options`), or None: fusion off, or a tensor split, which rewrites
    the products itself. A spatial split, which cuts the windows, takes the activation
    fusions (batchnorm + relu, add + relu: row by row) and not the products'."""
    options = fuse_options(device)
    if spec.tensor > 1 or not options["enabled"]:
        return None
    if spec.spatial > 1:
        return {**options, "residuals": False, "attention": False}
    return options


def _check_devices(fwd: Graph, spec: SplitSpec) -> None:
    """`@device(k)` places a layer on device k, which only a pipeline of one replica and
    no tensor ranks does (there device k is stage k); every other scheme runs each layer on
    several devices. One
    device (the single-device step `auto` measures its speed-ups against) runs them all."""
    if spec.devices == 1:
        return
    for n in fwd.nodes:
        k = n.annotations.get("device")
        if k is None:
            continue
        where = f" ({n.loc})" if n.loc else ""
        if spec.pipeline == 1 or spec.data > 1 or spec.tensor > 1:
            where_all = ("every device" if spec.pipeline == 1 else
                         "each replica" if spec.data > 1 else "each tensor rank of a stage")
            raise SplitError(f"@device({k}) on %{n.name}{where} places it on one device, "
                             f"but a {spec.name} split runs every layer on {where_all}; "
                             "use a pipeline over the devices, or @stage(k)")
        if k >= spec.pipeline:
            raise SplitError(f"@device({k}) on %{n.name}{where}: the split has only "
                             f"{spec.pipeline} devices")


def assign_stages(fwd: Graph, stages: int, profile: Profile | None = None,
                  batch: int = 1) -> dict[str, int]:
    """A stage for every forward node: the node sequence cut into `stages` contiguous runs
    of about equal predicted time (the roofline of `predict.node_time` under `profile`,
    per-node overhead included, at the micro-batch size `batch`; without a profile, FLOPs
    plus 10 x bytes touched), `@stage(k)` and `@device(k)` pinned. Sources go with their first
    reader."""
    ops = registry.load_all()
    bound = fwd.bind(batch)
    compute = [n for n in bound.nodes if not n.is_source]
    if stages > len(compute):
        raise SplitError(f"cannot cut network `{fwd.name}` into {stages} pipeline stages: it "
                         f"has {len(compute)} operators; use at most {len(compute)} stages")
    cost = []
    for n in compute:
        if profile is not None:
            cost.append(node_time(bound, n, profile)[0])
            continue
        op = ops[n.op]
        ins = [bound[i].type for i in n.inputs[:op.n_tensor_inputs(len(n.inputs))]]
        moved = n.type.nbytes() + sum(t.nbytes() for t in ins)
        cost.append(int(op.flops(ins, n.type, n.attrs)) + 10 * moved)
    cuts = _balanced_cuts(cost, stages)
    stage: dict[str, int] = {}
    s = 0
    for k, n in enumerate(compute):
        while s < stages - 1 and k >= cuts[s]:
            s += 1
        pinned = n.annotations.get("stage", n.annotations.get("device"))
        if pinned is not None and pinned >= stages:
            raise SplitError(f"@stage({pinned}) on %{n.name}"
                             f"{f' ({n.loc})' if n.loc else ''}: the pipeline has only "
                             f"{stages} stages")
        stage[n.name] = int(pinned) if pinned is not None else s
    readers: dict[str, int] = {}
    for n in compute:
        for i in n.inputs:
            readers.setdefault(i, stage[n.name])
    for n in bound.nodes:
        if n.is_source:
            stage[n.name] = readers.get(n.name, 0)
    used = sorted(set(stage[n.name] for n in compute))
    if len(used) < stages:
        raise SplitError(f"the @stage annotations of network `{fwd.name}` leave stage(s) "
                         f"{sorted(set(range(stages)) - set(used))} empty")
    return stage


def _balanced_cuts(cost: list[float], k: int) -> list[int]:
    """Indices where stages 1..k-1 start, minimising the largest stage's cost (binary
    search on the bottleneck, greedy fill: the classic linear-partition solution)."""
    scale = 1e12 / max(sum(cost), 1e-300)  # integer costs for an exact search
    cost = [max(1, round(c * scale)) for c in cost]
    lo, hi = max(cost), sum(cost)

    def cuts_for(limit: int) -> list[int] | None:
        out, acc = [], 0
        for i, c in enumerate(cost):
            if acc + c > limit and acc > 0:
                out.append(i)
                acc = 0
            acc += c
        return out if len(out) <= k - 1 else None

    while lo < hi:
        mid = (lo + hi) // 2
        if cuts_for(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    cuts = cuts_for(lo)
    # every stage gets at least one node: split the longest runs further if needed
    n = len(cost)
    while len(cuts) < k - 1:
        bounds = [0] + cuts + [n]
        runs = [(bounds[i + 1] - bounds[i], i) for i in range(len(bounds) - 1)]
        length, i = max(runs)
        cuts = sorted(cuts + [bounds[i] + length // 2])
    return cuts


def stages_summary(fwd: Graph, stage_of: dict[str, int], stages: int) -> list[dict]:
    """Per stage: its first and last forward nodes (with source lines) and node count."""
    out = []
    for s in range(stages):
        nodes = [n for n in fwd.nodes if not n.is_source and stage_of.get(n.name) == s]
        first, last = nodes[0], nodes[-1]
        out.append({"stage": s, "nodes": len(nodes), "first": first.name,
                    "last": last.name, "first_loc": str(first.loc) if first.loc else None})
    return out
