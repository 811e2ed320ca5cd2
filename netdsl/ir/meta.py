"""The declared `meta` keys: what passes tell each other about a node or a graph.

`Node.meta` and `Graph.meta` are open dicts that survive copies, so a pass can leave a note
for the passes, the runtime and the tools after it ("this node belongs to the backward
pass", "this copy computes rows [0, 8) of the batch") without a field on every node. The
keys are a protocol between layers, and this module is where it is written down: one
`MetaKey` per key, with the types its value may have, what it means, and the modules that
set and read it (JAX types an equation's fields for the same reason). `verify` checks
every node's and the graph's meta against `NODE_META` and `GRAPH_META`, so a misspelt
key, a note nobody declared or a value of the wrong type is caught at the pass that wrote
it, not where a later layer misreads it.

A new key is declared here before a pass sets it. Only the value's own type is checked
(a dict lookup and one isinstance a key: verify runs on every pass's result, over graphs
of hundreds of thousands of nodes); what is inside a tuple or dict is the meaning's to say.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MetaKey:
    name: str
    types: type | tuple[type, ...]  # what isinstance accepts for the value
    meaning: str
    # the modules that write and read the key, dotted under netdsl ("passes.autodiff");
    # "tests" where only tests do, netdsl_cli's by their full name; no reader: a note for
    # people reading a dump, and for tests
    set_by: tuple[str, ...]
    read_by: tuple[str, ...] = ()


def _table(*keys: MetaKey) -> dict[str, MetaKey]:
    return {k.name: k for k in keys}


# the graph meta key that marks a split step run one process per device over MPI
PER_PROCESS = "one_process_per_device"

NODE_META: dict[str, MetaKey] = _table(
    # -- autodiff and the optimizer ---------------------------------------------------
    MetaKey("phase", str,
            'the part of the step a node belongs to: "backward", "optimizer", "recompute" '
            '(a memory rewrite\'s replay or prefetch) or "forward" (absent: forward)',
            set_by=("passes.autodiff", "passes.optimizer", "parallel.gradsync",
                    "memory.strategies"),
            read_by=("passes.autodiff", "memory.simulate", "memory.strategies",
                     "parallel.check", "parallel.order", "parallel.predict", "parallel.split",
                     "runtime.executor", "runtime.gate")),
    MetaKey("forward", str,
            "the forward node a backward, recomputed or prefetched node stands for",
            set_by=("passes.autodiff", "memory.strategies"), read_by=("passes.fuse",)),
    MetaKey("backward_part", str,
            'a ZB-H1 pipeline\'s backward node: "B" (on the way to an input\'s gradient, '
            'which the stage before waits for) or "W" (to parameter gradients alone: '
            "deferred to fill the bubble)",
            set_by=("parallel.order",), read_by=("parallel.order", "runtime.timeline")),
    MetaKey("chunk", int,
            "a forward copy's model chunk in a pipeline with virtual stages (chunk c of "
            "pipeline x virtual_stages on stage c % pipeline)",
            set_by=("parallel.split",), read_by=("parallel.order",)),
    MetaKey("sums_gradient_of", str,
            "on an `add` of autodiff's sum of a value's gradient contributions: that value",
            set_by=("passes.autodiff",),
            read_by=("passes.fuse", "passes.fuse_attention", "parallel.order")),
    MetaKey("lowered_from", str,
            'the op a node was lowered from ("dropout": the `mul` by its explicit mask)',
            set_by=("passes.autodiff",)),
    MetaKey("rng_key", str,
            "the name a random node's numbers are keyed by (absent: its own), so a copy "
            "(a recompute, a split's part, dropout's mask) draws what the original drew",
            set_by=("passes.autodiff", "ir.rewrite", "parallel.replicate", "parallel.spatial"),
            read_by=("runtime.executor",)),
    MetaKey("rng_rows", tuple,
            "(lo, hi, batch): a split's part of a random node draws rows [lo, hi) of the "
            "whole batch's numbers",
            set_by=("parallel.replicate", "parallel.spatial"),
            read_by=("ir.ops.activation",)),
    MetaKey("members", (tuple, int),
            "a collective's members, side by side: the names of all of them (tuple); on an "
            "optimizer `*_update_group` node, how many updates it merges (int)",
            set_by=("passes.autodiff", "passes.optimizer", "parallel.gradsync",
                    "parallel.syncbn", "parallel.tensor"),
            read_by=("ir.ops.comm", "parallel.check", "parallel.predict",
                     "parallel.replicate", "runtime.comm")),
    MetaKey("gate", str,
            "an optimizer update of an f16 step: the loss scale's found_inf flag, where set "
            "the executor skips the update (the step's gradients held inf or NaN)",
            set_by=("passes.optimizer",), read_by=("passes.optimizer", "runtime.executor")),
    MetaKey("clip_of", str,
            "a gradient scaled by clip_grad_norm: the gradient it scales",
            set_by=("passes.optimizer",), read_by=("parallel.check",)),
    MetaKey("unchecked", bool,
            "verify does not run the node's shape rule (hand-built graphs in tests)",
            set_by=("tests",), read_by=("ir.verify",)),
    # -- fusion -------------------------------------------------------------------------
    MetaKey("fused", tuple,
            "a fused node: the names of the nodes it replaces, in order",
            set_by=("passes.fuse", "passes.fuse_attention")),
    MetaKey("joined", bool,
            "a concat that joins the parts of a value (a spatial split's strips, the "
            "slices' gradients join_slice_grads puts together): no computation of its own",
            set_by=("passes.fuse", "parallel.spatial")),
    # -- splitting across devices -------------------------------------------------------
    MetaKey("origin", str,
            "the node of the unsplit graph that a split step's node computes (a part of)",
            set_by=("parallel.replicate", "parallel.spatial"),
            read_by=("parallel.check", "parallel.replicate", "runtime.gate")),
    MetaKey("rows", tuple,
            "(lo, hi): the rows of the batch a split's copy computes",
            set_by=("parallel.replicate", "parallel.spatial"),
            read_by=("memory.plan", "runtime.executor", "runtime.gate")),
    MetaKey("hrows", tuple,
            "(lo, hi): the rows of the image height a spatial split's strip computes",
            set_by=("parallel.spatial",), read_by=("runtime.gate",)),
    MetaKey("feed_of", str,
            "a split's copy of an `input`: the input whose rows it is fed",
            set_by=("parallel.replicate",), read_by=("memory.plan", "runtime.executor")),
    MetaKey("mirror", bool,
            "a copy that computes what another part computes (tensor parallelism runs the "
            "whole batch on every device): its results are not combined",
            set_by=("parallel.replicate",), read_by=("runtime.gate",)),
    MetaKey("combined", bool,
            "made by `combine`: the single-device graph's results out of the parts'",
            set_by=("parallel.replicate",),
            read_by=("parallel.check", "parallel.order", "parallel.split", "runtime.gate")),
    MetaKey("halo", bool,
            "a spatial split's exchange of rows between strips (slices, the uncropped "
            "transposed convolution)",
            set_by=("parallel.spatial",)),
    MetaKey("shard", tuple,
            "(axis, lo, hi, full shape): a state node holding slice [lo, hi) of the "
            "original along axis (netdsl.ir.placement.Shard)",
            set_by=("parallel.tensor", "parallel.zero", "passes.optimizer"),
            read_by=("ir.placement", "parallel.tensor", "passes.optimizer")),
    MetaKey("tensor_shard", str,
            "a tensor-parallel shard of a layer: the layer's name",
            set_by=("parallel.tensor",), read_by=("runtime.gate",)),
    MetaKey("grad_sync", str,
            'a node of data parallelism\'s gradient all-reduce (or reduce-scatter): its '
            'bucket ("bucket3")',
            set_by=("parallel.gradsync", "parallel.zero"),
            read_by=("parallel.gradsync", "parallel.zero")),
    MetaKey("sync_bn", str,
            "a node of synchronised batchnorm: the batchnorm copy it serves",
            set_by=("parallel.syncbn",), read_by=("parallel.check", "runtime.gate")),
    MetaKey("sync_group", tuple,
            "a sync_batchnorm: the names of the copies normalised together",
            set_by=("parallel.syncbn",), read_by=("ir.ops.norm_sync",)),
    MetaKey("sync_count", int,
            "a sync_batchnorm: the rows a channel's statistics are over (the whole batch)",
            set_by=("parallel.syncbn",), read_by=("ir.ops.norm_sync",)),
    MetaKey("held_to", str,
            'a send over MPI: the node (or "end") until which MPI holds its message',
            set_by=("parallel.project",),
            read_by=("memory.liveness", "memory.simulate", "runtime.mpi")),
    MetaKey("part_sizes", tuple,
            "an all_gather on one rank: every member's size along the gathered axis",
            set_by=("parallel.project",), read_by=("runtime.mpi",)),
    # -- memory planning ----------------------------------------------------------------
    MetaKey("space", str,
            'a state node\'s memory space: "host" for optimizer state streamed from the '
            'host pool (absent: "device")',
            set_by=("memory.strategies",), read_by=("ir.placement",)),
    MetaKey("state_of", str,
            "a prefetch or write-back of host-streamed optimizer state: the state buffer",
            set_by=("memory.strategies",)),
    MetaKey("offload_of", str,
            "a copy to the host pool: the value offloaded",
            set_by=("memory.strategies",)),
)

GRAPH_META: dict[str, MetaKey] = _table(
    MetaKey("source", str, "the .net file the graph was elaborated from",
            set_by=("frontend.elaborate",)),
    MetaKey("grad_of", dict, '{gradient node: parameter node} for outputs["grads"]',
            set_by=("passes.autodiff", "parallel.gradsync"), read_by=("parallel.gradsync",)),
    MetaKey("optimizer", dict, "the optimizer's kind and hyper-parameters",
            set_by=("passes.optimizer",)),
    MetaKey("precision", dict,
            '{"dtype": "bf16" | "f16", "device": "cpu" | "numba" | "gpu"}: a mixed-'
            "precision step, and the kind of kernels whose conversions of 2-byte values its "
            "plan counts",
            set_by=("passes.precision",), read_by=("ir.precision", "runtime.loss_scale")),
    MetaKey("update_targets", list,
            'what each of outputs["grads"] updates: a parameter, or the piece of one a data '
            "replica updates (sharded state)",
            set_by=("parallel.zero",), read_by=("passes.optimizer", "runtime.gate")),
    MetaKey("zero", dict,
            "sharded data parallelism: its stage and (stages 1-2) each bucket's replicas, "
            "offsets, parameters and pieces, or (stage 3) each unit's parameters, replicas "
            "and gathered values",
            set_by=("parallel.zero", "parallel.zero_params"),
            read_by=("parallel.zero", "parallel.zero_params")),
    MetaKey("memory_decisions", dict,
            '{value: "recompute" | "offload"}: what the memory plan did',
            set_by=("memory.strategies",)),
    MetaKey("split", dict,
            "a split step's scheme: data, pipeline, microbatches, tensor, spatial, "
            "strategy, stages, schedule ...",
            set_by=("parallel.split", "parallel.choose", "parallel.memplan", "parallel.order"),
            read_by=("parallel.check", "parallel.order", "parallel.predict", "parallel.split",
                     "netdsl_cli.split_cmd")),
    MetaKey("tensor_layers", list, "the layers tensor parallelism split",
            set_by=("parallel.tensor",), read_by=("parallel.split",)),
    MetaKey("tensor_pairs", list, "[a, b] layer pairs split by output then input channels",
            set_by=("parallel.tensor",)),
    MetaKey("spatial_layers", list, "the layers a spatial split cut into strips",
            set_by=("parallel.spatial",), read_by=("parallel.check", "parallel.split")),
    MetaKey("p2p_tags", dict,
            "the message tags used so far per (sender, receiver), so pairs never share one",
            set_by=("parallel.replicate",), read_by=("parallel.replicate",)),
    MetaKey("rank", int, "the rank whose part of a split step the graph is",
            set_by=("parallel.project",)),
    MetaKey(PER_PROCESS, bool,
            "the split step runs one process per device over MPI (its sends held)",
            set_by=("parallel.project",), read_by=("memory.plan",)),
)

# what verify checks of every node, key by key: the types the value may have
NODE_META_TYPES = {k: m.types for k, m in NODE_META.items()}


def meta_problem(meta: dict, table: dict[str, MetaKey]) -> str | None:
    """What is wrong with `meta` against `table` (the first key in error), or None."""
    for key, value in meta.items():
        spec = table.get(key)
        if spec is None:
            return (f"meta key {key!r} is not declared (netdsl.ir.meta: "
                    f"{'NODE_META' if table is NODE_META else 'GRAPH_META'})")
        if not isinstance(value, spec.types):
            want = spec.types if isinstance(spec.types, tuple) else (spec.types,)
            return (f"meta[{key!r}] is a {type(value).__name__}, declared "
                    f"{' or '.join(t.__name__ for t in want)} ({value!r:.60})")
    return None
