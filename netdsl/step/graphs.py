"""The graphs of a step, built here and nowhere else: the training step on one device
(`training_graph`), with its gradients accumulated over micro-batches
(`accumulating_step`), split over devices (`split_training_step`), and the forward graph
that evaluation runs (`eval_graph`).

A training step is the forward graph bound to the batch, then passes: `fuse` (batchnorm
and relu as one op, and the like), `autodiff`, `fuse_grads` (gradient sums into the
kernels that make them), `join_slice_grads` (q/k/v-style slices' gradients as one
concat), the optimizer's updates, and `device` (the kernels' variants for a GPU).
"""
from __future__ import annotations

from netdsl.config import ParallelConfig, TrainConfig
from netdsl.errors import NetdslError
from netdsl.ir.graph import Graph, Node
from netdsl.ir.precision import kernels_of
from netdsl.parallel.split import SplitSpec, split_step
from netdsl.passes.fuse import fuse_options
from netdsl.passes.pipeline import run_pipeline

# what a training step computes; a split or a projection adds its own roles
TRAINING_ROLES = ("loss", "output", "updates")
# the roles a storage plan keeps to the end of the step, in this order
_KEPT_ROLES = (*TRAINING_ROLES, "logits", "found_inf", "state_updates", "comm")


def require_loss(forward: Graph) -> None:
    if "loss" not in forward.outputs:
        raise NetdslError(f"network `{forward.name}` declares no `loss`, so it cannot be "
                          "trained; add e.g. `loss softmax_cross_entropy(logits, y)`")


def training_graph(forward: Graph, cfg: TrainConfig, device: str = "cpu") -> Graph:
    """The training step of bound `forward` on one device ("cpu" or "gpu": the fusions
    and kernel variants of that device; NETDSL_FUSE=0 leaves the graph as written), at
    the config's mixed precision (the `precision` pass first; f16 scales its loss)."""
    require_loss(forward)
    opt = cfg.optimizer.model_dump()
    kind = opt.pop("kind")
    fusing = fuse_options(device)
    scale = ["loss_scale"] if cfg.precision == "f16" else []
    precise = {"dtype": cfg.precision, "device": kernels_of(device)}
    return run_pipeline(forward, [("precision", precise),
                                  ("fuse", fusing), "autodiff",
                                  ("fuse_grads", {"enabled": fusing["enabled"]}),
                                  "join_slice_grads", *scale,
                                  ("optimizer", {"kind": kind, **opt}),
                                  ("device", {"kind": device})])


def accumulating_step(forward: Graph, batch: int, cfg: TrainConfig, microbatches: int,
                      schedule: str = "1f1b", gather: tuple[str, ...] = (),
                      device: str = "cpu") -> Graph:
    """The training step of unbound `forward` at `batch` on one device with its gradients
    accumulated over `microbatches` parts of the batch: a split onto one device, whose
    `1f1b` order runs each part's forward then its backward, so that one part's
    activations are alive at a time (`gpipe`: every forward first; the same numbers and
    no saving). The loss is the rows-weighted sum of the parts' losses, so the gradients
    are the whole batch's, except through batchnorm, which normalises each part with its
    own statistics (the running statistics are updated once, from every part's
    combined). `gather`: outputs made whole (the trainer's logits)."""
    require_loss(forward)
    return split_step(forward, batch, SplitSpec(microbatches=microbatches,
                                                 schedule=schedule),
                      cfg.optimizer.model_dump(), gather, device=device,
                      precision=cfg.precision)


def split_training_step(forward: Graph, batch: int, spec: SplitSpec, optimizer: dict,
                        gather: tuple[str, ...] = (), device: str = "cpu",
                        precision: str = "f32") -> Graph:
    """The training step of unbound `forward` split as `spec` says (the equivalence gate's
    reference and candidate; `netdsl.parallel.choose` builds the candidates it weighs)."""
    require_loss(forward)
    return split_step(forward, batch, spec, optimizer, gather, device=device,
                      precision=precision)


def accumulation(forward: Graph, microbatches: int | None, schedule: str | None,
                 devices: int = 1) -> tuple[int, str]:
    """The micro-batches a one-device step accumulates its gradients over, and their
    order: `microbatches` (--microbatches), else the file's `parallel { microbatches }`
    declared alone (1: none). A split over devices takes them as its own."""
    declared = dict(forward.parallel)
    if devices > 1:
        return 1, "1f1b"
    alone = ParallelConfig(**declared).devices == 1
    m = microbatches if microbatches is not None else (
        declared.get("microbatches", 1) if alone else 1)
    return m, schedule or (declared.get("schedule") if alone else None) or "1f1b"


def roles_of(step: Graph) -> tuple[str, ...]:
    """The outputs a training step computes, which its storage plan keeps to its end."""
    return tuple(r for r in _KEPT_ROLES if r in step.outputs)


def eval_graph(forward: Graph, batch: int, logits: str | None, precision: str = "f32",
               kernels: str = "cpu") -> Graph:
    """The forward graph at `batch` as evaluation runs it, with the loss's logits as an
    output where accuracy reads them, at mixed `precision` (as the step trains it) for
    `kernels` (netdsl.ir.precision.kernels_of_backend)."""
    g = forward.bind(batch)
    if logits:
        g.outputs["logits"] = [logits]
    if precision != "f32":
        g = run_pipeline(g, [("precision", {"dtype": precision, "device": kernels})])
    return g


def eval_roles(forward: Graph, logits: str | None) -> tuple[str, ...]:
    return tuple(r for r in ("output", "loss", "logits")
                 if r in forward.outputs or (r == "logits" and logits))


# -- which node is the logits, and which input the labels --------------------------------

# ops that only rearrange a tensor: labels reshaped to [N*T] are still the input's labels
_SHAPE_ONLY = ("reshape", "flatten")


def source_input(g: Graph, name: str) -> str | None:
    """The input node a value is a reshaping of, or None."""
    while g[name].op in _SHAPE_ONLY:
        name = g[name].inputs[0]
    return name if g[name].op == "input" else None


def class_axis(g: Graph, ce: Node) -> int:
    return ce.attrs.get("axis", 1) % g[ce.inputs[0]].type.rank


def loss_labels(g: Graph) -> tuple[str, str, int] | None:
    """(logits node, labels input, class axis) when the loss is a softmax cross-entropy
    whose labels are an input (perhaps reshaped): the labels input is what synthetic data
    makes learnable, and accuracy compares the argmax of the loss's own logits with it,
    per sample, per pixel or per token."""
    for name in g.outputs.get("loss", []):
        n = g[name]
        if n.op == "softmax_cross_entropy":
            src = source_input(g, n.inputs[1])
            if src is not None:
                return n.inputs[0], src, class_axis(g, n)
    return None
