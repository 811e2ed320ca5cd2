"""The options a user gives a command, each declared once: its name, default and help.

`StepOptions` says how a training step is built (batch, backend, memory budget, split);
`RunOptions` adds how `netdsl run` trains it (steps, logs, checkpoints, evaluation). The
library takes them as plain dataclasses; the CLI turns every field into a command-line
option (`netdsl_cli.options`), so a default or a help text lives here and nowhere else.

`conflicts(opts)` checks the options together, once: a combination that cannot mean
what was asked is refused by name; one where an option does nothing is a warning.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from netdsl.errors import NetdslError

BACKENDS = ("numpy", "cupy")
DTYPES = ("f32", "f64")
PRECISIONS = ("f32", "bf16", "f16")
MEMORY_STRATEGIES = ("auto", "none", "checkpoint-sqrt", "offload-all", "recompute-all")
SPLITS = ("auto", "data", "pipeline", "hybrid", "tensor", "spatial")
SCHEDULES = ("gpipe", "1f1b", "zb-h1")
SHARD_STAGES = (0, 1, 2, 3)  # ZeRO's: none, optimizer state, and gradients, and parameters
BN_MODES = ("sync", "local")
INTERCONNECTS = ("shm", "pcie3", "nvlink4", "ib-hdr", "10gbe")
BAD_IMAGES = ("stop", "skip")


@dataclass(frozen=True)
class Flag:
    """How a field is given on the command line."""

    help: str
    flags: tuple[str, ...] = ()  # () : --the-field-name
    min: int | float | None = None
    cli_type: Any = None  # the type the CLI parses into, where it differs (a path)


def option(default: Any, help: str, *, flags: tuple[str, ...] = (), min: float | None = None,
           cli_type: Any = None) -> Any:
    return field(default=default,
                 metadata={"flag": Flag(help, flags, min, cli_type)})


def flag_of(model: type, name: str) -> Flag:
    return next(f for f in fields(model) if f.name == name).metadata["flag"]


def cli_name(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class StepOptions:
    """How a training step is built; None keeps the file's choice (or its default)."""

    batch: int | None = option(
        None, "batch size to bind N to (default: the train section's)",
        flags=("--batch", "-b"), min=1)
    backend: str = option("numpy", "numpy (the CPU) or cupy (a GPU)")
    device: int | None = option(
        None, "GPU index for cupy (default 0; over MPI each rank its place among the ranks "
        "on its machine)", min=0)
    dtype: str = option("f32", "f32 or f64")
    precision: str | None = option(
        None, "mixed precision: bf16 or f16 activations and gradients (half the bytes) with "
        "f32 master weights and optimizer state, f16 with a dynamic loss scale; or f32 "
        "(default: the train section's `precision`, else f32)")
    mem: int | str | None = option(
        None, "memory budget per device (12GB, 300MB, 1.5GiB; KB/MB/GB decimal, KiB/MiB/GiB "
        "binary): the step is planned to fit, recomputing or offloading what does not",
        cli_type=str)
    profile: str | None = option(
        None, "device profile that time and memory are predicted for: k40-12gb, v100-16gb, "
        "a100-40gb, h100-80gb, h200, cpu, or a JSON file from `netdsl calibrate -o` "
        "(default: the device the step runs on, cpu with numpy, the GPU's with cupy)")
    strategy: str = option(
        "auto", "how a step is planned into --mem: auto, none, checkpoint-sqrt, offload-all "
        "or recompute-all")
    offload_state: bool = option(
        False, "with --mem: the plan may keep optimizer state in host memory, streamed in for "
        "each update (with --shard over --devices N: each device's pieces, ZeRO-Offload)",
        flags=("--offload-state",))
    devices: int = option(
        1, "split the step over this many devices (logical devices in this process, or one "
        "MPI rank each with --distributed)", flags=("--devices", "-n"), min=1)
    split: str | None = option(
        None, "how to split over --devices: auto, data, pipeline, hybrid, tensor or spatial, "
        "or the sizes as `parallel { }` gives them: data=2,pipeline=2,tensor=2 (3-D; also "
        "microbatches=M; default: the file's `parallel { }`, else auto)")
    microbatches: int | None = option(
        None, "micro-batches per step: a pipeline's, or the parts of the batch each device "
        "accumulates gradients over, one after the other (batchnorm normalises each part "
        "alone; default: the file's `parallel { }`)", flags=("--microbatches", "-m"), min=1)
    schedule: str | None = option(
        None, "the micro-batches' order: gpipe, 1f1b or zb-h1 (zero bubble: each backward "
        "split into input and weight gradients, the latter deferred into the bubble; "
        "default: the file's, else 1f1b where auto chooses and gradients are accumulated, "
        "else gpipe)")
    virtual_stages: int | None = option(
        None, "model chunks per pipeline stage (interleaved 1F1B: the layers cut into "
        "pipeline x V chunks, chunk c on stage c % pipeline, the bubble divided by V); "
        "in 1f1b order (the default with it) with micro-batches a multiple of the stages "
        "(default: the file's `parallel { }`, else 1)", min=1)
    shard: int | None = option(
        None, "shard the data replicas' state (ZeRO): 1 the optimizer state, 2 the gradients "
        "too, 3 the parameters too (gathered layer by layer); each replica then updates and "
        "holds 1/N of it (a data split, or the data replicas of a 3-D one; default: the "
        "file's `parallel { }`, else none, or what auto chooses)", min=0)
    bn: str = option(
        "sync", "batchnorm over a split batch: sync (the whole batch's statistics: the "
        "single-device step) or local (each device its own rows', fewer collectives)")
    interconnect: str = option(
        "pcie3", "the link between devices that `split` predicts with: shm, pcie3, nvlink4, "
        "ib-hdr or 10gbe (`run` splits over logical devices in one process: shm)")
    distributed: bool = option(
        False, "one process per device under `mpiexec -n N` (the `mpi` extra): each rank "
        "runs its part of the split step; rank 0 reports", flags=("--distributed",))
    jobs: int | None = option(
        None, "processes that build and predict the candidate splits (default: one a core, "
        "up to 8 and as many as the free memory holds, where the network is big enough to "
        "pay for starting them; 1: this process alone)", flags=("--jobs", "-j"), min=1)


@dataclass
class RunOptions(StepOptions):
    """`netdsl run`: the step options and how the loop trains it."""

    seed: int | None = option(None, "random seed (default: the train section's)", min=0)

    steps: int | None = option(None, "total steps (also when resuming)", min=1)
    epochs: int | None = option(None, "epochs instead of steps", min=1)
    lr: float | None = option(None, "base learning rate", min=0.0)
    clip_grad_norm: float | None = option(
        None, "scale the gradients to this global 2-norm at most before each update",
        flags=("--clip-grad-norm",))
    log: str | None = option(None, "write one JSON line per step here", cli_type="path")
    checkpoint: str | None = option(None, "checkpoint directory", cli_type="path")
    checkpoint_every: int | None = option(None, "save a checkpoint every K steps", min=1)
    resume: bool = option(False, "continue from --checkpoint")
    overwrite: bool = option(
        False, "start over, replacing the checkpoint in --checkpoint (refused without it)")
    eval_every: int | None = option(None, "evaluate every K steps", min=1)
    # None: all of real data, one batch of synthetic data (random labels say little, and a
    # full pass would be a large part of a short run)
    eval_samples: int | None = option(
        None, "held-out samples per evaluation (0: none; default: all of real data, one "
        "batch of synthetic data)", min=0)
    check_numerics: bool = option(False, "stop at the first NaN/Inf, naming the node")
    workers: int | None = option(
        None, "processes that read and augment images(), arrays() and shards() data in the "
        "background (0: in this process; default: one with --backend numpy, whose step takes "
        "every core, else one a core, at most 8)", min=0)
    bad_images: str = option(
        "stop", "a sample that cannot be read (a corrupt image): stop (the run stops, naming "
        "it, its checkpoint saved) or skip (replaced by the next sample, counted and named)")


# (option, when it means something given the others and whether the step is planned into a
# budget anyway, why it does not otherwise): a warning names the option
_IDLE = (
    ("device", lambda o, budgeted: o.backend == "cupy" or o.device in (None, 0),
     "has no effect with the NumPy backend (it picks a GPU for --backend cupy)"),
    ("split", lambda o, budgeted: o.split is None or o.devices > 1 or o.distributed,
     "has no effect on one device (give --devices N)"),
    ("jobs", lambda o, budgeted: o.jobs is None or o.devices > 1 or o.distributed,
     "has no effect on one device (it builds the candidate splits of --devices N)"),
    ("bn", lambda o, budgeted: o.bn == "sync" or o.devices > 1 or o.distributed
     or (o.microbatches or 1) > 1,
     "has no effect without --devices, --distributed or --microbatches (nothing splits the "
     "batch)"),
    ("offload_state", lambda o, budgeted: not o.offload_state or o.mem is not None
     or budgeted,
     "has no effect without --mem (the plan of a budget may offload the optimizer state)"),
)


def _value(opts: StepOptions, name: str) -> str:
    v = getattr(opts, name)
    return cli_name(name) if isinstance(v, bool) else f"{cli_name(name)} {v}"


def conflicts(opts: StepOptions, budgeted: bool = False) -> list[str]:
    """Check `opts` together: raise NetdslError for a combination that cannot mean what was
    asked, return a warning for each option that does nothing with the others.
    `budgeted`: the step is planned into a budget even without --mem (`plan`)."""
    _choice(opts.backend, BACKENDS, "--backend")
    _choice(opts.dtype, DTYPES, "--dtype")
    if opts.precision is not None:
        _choice(opts.precision, PRECISIONS, "--precision")
    check_precision(opts.precision or "f32", opts.dtype)
    _choice(opts.bn, BN_MODES, "--bn")
    # (ZeRO-Offload: a sharded data split's optimizer state in its hosts' memory, over
    # --devices in one process; other splits, and MPI ranks, are not verified so)
    if opts.offload_state and (opts.devices > 1 or opts.distributed) \
            and not (opts.shard and not opts.distributed):
        raise NetdslError("--offload-state with --devices or --distributed is not supported "
                          "yet, but for a sharded data split (--shard 1|2|3) over --devices N "
                          "in one process (ZeRO-Offload); other split steps are planned by "
                          "recomputing and offloading activations")
    sizes = split_sizes(opts.split)
    if sizes is not None:
        _sizes_conflicts(opts, sizes)
    if opts.shard is not None:
        _shard_conflicts(opts, sizes)
    if opts.schedule is not None:
        _choice(opts.schedule, SCHEDULES, "--schedule")
    if (opts.virtual_stages or 1) > 1:
        _virtual_conflicts(opts)
    if isinstance(opts, RunOptions):
        _run_conflicts(opts)
    return [f"{_value(opts, name)} {why}" for name, used, why in _IDLE
            if not used(opts, budgeted)]


SPLIT_SIZES = ("data", "pipeline", "tensor", "spatial", "microbatches")


def split_sizes(split: str | None) -> dict[str, int] | None:
    """`--split data=2,pipeline=2,tensor=2`: the sizes it gives, as a file's `parallel { }`
    declares them; None for a scheme's name (auto, data ...) or no --split."""
    if split is None or "=" not in split:
        return None
    out: dict[str, int] = {}
    for item in split.split(","):
        key, _, value = (x.strip() for x in item.partition("="))
        if key not in SPLIT_SIZES or key in out or not value.isdigit() or int(value) < 1:
            why = (f"`{key}` is given twice" if key in out else
                   f"`{key}` is not one of {', '.join(SPLIT_SIZES)}" if key not in SPLIT_SIZES
                   else f"`{key}` must be a whole number of 1 or more, not {value!r}")
            raise NetdslError(f"--split {split}: {why}; give the sizes as "
                              "data=D,pipeline=P,tensor=T (each 1 or more, the devices their "
                              "product), or a scheme: auto, data, pipeline, hybrid, tensor or "
                              "spatial")
        out[key] = int(value)
    return out


def _sizes_conflicts(opts: StepOptions, sizes: dict[str, int]) -> None:
    from pydantic import ValidationError

    from netdsl.config import ParallelConfig  # (the file's `parallel { }` rules)
    if "microbatches" in sizes and opts.microbatches is not None:
        raise NetdslError(f"--split {opts.split} gives microbatches, and --microbatches "
                          f"{opts.microbatches} gives them again; give them once")
    try:
        devices = ParallelConfig(**sizes).devices
    except ValidationError as e:
        why = e.errors()[0]["msg"].removeprefix("Value error, ")
        raise NetdslError(f"--split {opts.split}: {why}") from None
    if not opts.distributed and devices != opts.devices:
        raise NetdslError(f"--split {opts.split} splits the step over {devices} devices, but "
                          f"--devices is {opts.devices}; give --devices {devices} (under "
                          f"mpiexec with --distributed: -n {devices})")


def _shard_conflicts(opts: StepOptions, sizes: dict[str, int] | None = None) -> None:
    if opts.shard not in SHARD_STAGES:
        raise NetdslError(f"--shard must be 0 (state replicated), 1 (optimizer state "
                          f"sharded), 2 (gradients too) or 3 (parameters too), not "
                          f"{opts.shard}")
    if not opts.shard:
        return
    if opts.devices == 1 and not opts.distributed:
        raise NetdslError(f"--shard {opts.shard} shards the state of data-parallel replicas, "
                          "but the step runs on one device; give --devices N (or run under "
                          "mpiexec with --distributed)")
    if sizes is not None and (sizes.get("data", 1) < 2 or sizes.get("spatial", 1) > 1):
        raise NetdslError(f"--shard {opts.shard} shards the state of data-parallel replicas, "
                          f"alone or in each stage and tensor rank; --split {opts.split} has "
                          + ("no data replicas (give data=2 or more)" if sizes.get("data", 1) < 2
                             else "a spatial split, which it does not combine with yet"))
    if sizes is None and opts.split not in (None, "auto", "data"):
        raise NetdslError(f"--shard {opts.shard} shards the state of data-parallel replicas "
                          f"and does not combine with --split {opts.split} yet; give --split "
                          "data, or the sizes of a 3-D split (--split data=2,pipeline=2,"
                          "tensor=2), or leave --split out")
    if opts.precision not in (None, "f32"):
        raise NetdslError(f"--shard {opts.shard} does not combine with --precision "
                          f"{opts.precision} yet (the sharded update and gathers are built "
                          "for f32 steps); train sharded in f32, or leave --shard out")


def _virtual_conflicts(opts: StepOptions) -> None:
    """Interleaved 1F1B's conditions that the options alone decide (the pipeline's size
    and its layers are checked where the split is made)."""
    v = opts.virtual_stages
    if opts.split not in (None, "auto", "pipeline", "hybrid"):
        raise NetdslError(f"--virtual-stages {v} interleaves a pipeline's stages; --split "
                          f"{opts.split} has no pipeline (give --split pipeline or hybrid)")
    if opts.devices == 1 and not opts.distributed:
        raise NetdslError(f"--virtual-stages {v} interleaves a pipeline's stages, but the "
                          "step runs on one device; give --devices N (N >= 2)")
    if opts.schedule not in (None, "1f1b"):
        raise NetdslError(f"--virtual-stages {v} is interleaved 1F1B; it does not combine "
                          f"with --schedule {opts.schedule} (give --schedule 1f1b or leave "
                          "it out)")
    if opts.shard:
        raise NetdslError(f"--virtual-stages {v} needs a pipeline, and --shard {opts.shard} "
                          "shards data replicas alone; give one of them")


def _run_conflicts(opts: RunOptions) -> None:
    if opts.steps is not None and opts.epochs is not None:
        raise NetdslError("give --steps or --epochs, not both")
    if opts.checkpoint_every is not None and not opts.checkpoint:
        raise NetdslError("--checkpoint-every needs --checkpoint DIR (where to write them)")
    if opts.resume and not opts.checkpoint:
        raise NetdslError("--resume needs --checkpoint DIR")
    if opts.overwrite and not opts.checkpoint:
        raise NetdslError("--overwrite needs --checkpoint DIR (the checkpoint to replace)")
    if opts.overwrite and opts.resume:
        raise NetdslError("give --resume (go on from the checkpoint) or --overwrite (start "
                          "over and replace it), not both")
    _choice(opts.bad_images, BAD_IMAGES, "--bad-images")
    if opts.eval_samples is not None and opts.eval_samples < 0:
        raise NetdslError(f"--eval-samples must be 0 (no evaluation) or more, not "
                          f"{opts.eval_samples}")


def check_precision(precision: str, dtype: str, where: str = "--precision") -> None:
    """Mixed precision keeps f32 master weights: with --dtype f64 (f64 ones) it would mean
    two things at once, so the pair is refused. `where`: how the precision was given."""
    if precision != "f32" and dtype == "f64":
        raise NetdslError(f"{where} {precision} computes in {precision} from f32 master "
                          "weights, and --dtype f64 asks for f64 ones; give one of them "
                          "(--dtype f64 alone is the float64 reference run)")


def _choice(value: str, allowed: tuple[str, ...], flag: str) -> None:
    if value not in allowed:
        raise NetdslError(f"{flag} must be {', '.join(allowed[:-1])} or {allowed[-1]}, not "
                          f"{value!r}")
