"""What `netdsl run` is asked to do: the command-line options (`RunOptions`), the
training configuration they override (`resolve_config`), the checks made before any work
(`check_options`, `preflight`) and the backend and GPU they pick (`backend_for`)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from netdsl.backends import get_backend
from netdsl.config import TrainConfig
from netdsl.errors import NetdslError, NoSuchGpu
from netdsl.frontend.train import pydantic_message
from netdsl.runtime import checkpoint


@dataclass
class RunOptions:
    """Command-line overrides; None keeps the file's `train` section (or its default)."""

    steps: int | None = None
    epochs: int | None = None
    batch: int | None = None
    lr: float | None = None
    clip_grad_norm: float | None = None  # the optimizer's (scale gradients to this norm)
    seed: int | None = None
    backend: str = "numpy"
    # the GPU (CuPy): None = GPU 0, or over MPI each rank its own, its place among the
    # ranks on its machine (as ChainerMN's intra_rank); a number puts every rank on it
    device: int | None = None
    dtype: str = "f32"
    log: str | None = None
    checkpoint: str | None = None
    checkpoint_every: int | None = None
    resume: bool = False
    overwrite: bool = False  # start over in a --checkpoint folder that holds one
    eval_every: int | None = None
    check_numerics: bool = False
    # held-out samples each evaluation uses: None = all of real data, one batch of
    # synthetic data (random labels say little, and a full pass was a third of a run);
    # 0 skips evaluation
    eval_samples: int | None = None
    # memory planning (`run --mem`): a budget for the device ("300MB", bytes), the device
    # profile the planner predicts time with (None: "cpu" on NumPy, "h200" on CuPy) and
    # the strategy (auto | none | checkpoint-sqrt | offload-all | recompute-all)
    mem: int | str | None = None
    profile: str | None = None
    strategy: str = "auto"
    offload_state: bool = False  # let the plan keep optimizer state on the host
    # splitting the step over logical devices in this process (`run --devices`): the
    # scheme (auto | data | pipeline | hybrid) and the micro-batches of a pipeline
    devices: int = 1
    split: str | None = None  # None: the file's `parallel { }`, else auto
    microbatches: int | None = None
    schedule: str | None = None  # a pipeline's order: gpipe | 1f1b (None: the file's)
    # batchnorm over a split batch: sync (statistics of the whole batch: the single-device
    # step) or local (each device its rows', as PyTorch's DistributedDataParallel does)
    bn: str = "sync"
    # one process per device under `mpiexec` (the MPI world's size is the device count);
    # rank 0 logs, evaluates and writes checkpoints
    distributed: bool = False
    # processes that build and predict auto's candidates with --devices (None: choose's
    # default, one a core where the network is big enough; --distributed: the ranks)
    jobs: int | None = None


def resolve_config(cfg: TrainConfig | None, opts: RunOptions) -> TrainConfig:
    cfg = cfg or TrainConfig()
    update: dict[str, Any] = {}
    for k in ("batch", "seed", "eval_every"):
        if getattr(opts, k) is not None:
            update[k] = getattr(opts, k)
    if opts.steps is not None:
        update.update(steps=opts.steps, epochs=None)
    elif opts.epochs is not None:
        update.update(epochs=opts.epochs, steps=None)
    optimizer = {k: getattr(opts, k) for k in ("lr", "clip_grad_norm")
                 if getattr(opts, k) is not None}
    if optimizer:
        update["optimizer"] = cfg.optimizer.model_copy(update=optimizer)
    out = cfg.model_copy(update=update)
    # re-validate: model_copy does not run validators. A bad value can only come from a
    # command-line option here (the file's section was checked when it was loaded), so the
    # error names the option, in the words the file's checks use.
    try:
        return TrainConfig.model_validate(out.model_dump())
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][-1]) if err["loc"] else ""
        flag = f"--{field.replace('_', '-')}" if field else ""
        raise NetdslError(f"invalid option: {pydantic_message(err, flag)}") from None


def check_options(opts: RunOptions) -> list[str]:
    """Options that do nothing in the combination given: an error where the user surely
    meant something else, else a warning (returned, for the caller to show)."""
    if opts.checkpoint_every is not None and not opts.checkpoint:
        raise NetdslError("--checkpoint-every needs --checkpoint DIR (where to write them)")
    if opts.resume and not opts.checkpoint:
        raise NetdslError("--resume needs --checkpoint DIR")
    if opts.overwrite and not opts.checkpoint:
        raise NetdslError("--overwrite needs --checkpoint DIR (the checkpoint to replace)")
    if opts.overwrite and opts.resume:
        raise NetdslError("give --resume (go on from the checkpoint) or --overwrite (start "
                          "over and replace it), not both")
    if opts.eval_samples is not None and opts.eval_samples < 0:
        raise NetdslError(f"--eval-samples must be 0 (no evaluation) or more, not "
                          f"{opts.eval_samples}")
    if opts.offload_state and (opts.devices > 1 or opts.distributed):
        raise NetdslError("--offload-state with --devices or --distributed is not supported "
                          "yet; a split step is planned by recomputing and offloading "
                          "activations")
    if opts.bn not in ("sync", "local"):
        raise NetdslError(f"--bn must be sync or local, not {opts.bn!r}")
    if opts.dtype not in ("f32", "f64"):
        raise NetdslError(f"--dtype must be f32 or f64, not {opts.dtype!r}")
    warnings = []
    if opts.backend == "numpy" and opts.device not in (None, 0):
        warnings.append(f"--device {opts.device} has no effect with the NumPy backend (it "
                        "picks a GPU for --backend cupy)")
    return warnings


def preflight(opts: RunOptions) -> None:
    """Check the paths a run writes before it starts: a checkpoint folder that cannot be
    made or written, or a log that cannot be opened, used to fail after the last step."""
    if opts.checkpoint:
        d = Path(opts.checkpoint)
        if d.exists() and not d.is_dir():
            raise NetdslError(f"--checkpoint {d} is a file, not a directory; give a "
                              "directory to hold checkpoint.npz")
        try:
            d.mkdir(parents=True, exist_ok=True)
            # one probe per process: the ranks of an MPI run check the same folder at once
            probe = d / f".netdsl-write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise NetdslError(f"--checkpoint {d} is not writable: "
                              f"{e.strerror or e}") from None
        if not (opts.resume or opts.overwrite) and checkpoint.path_in(d).exists():
            # a run that forgot --resume would replace days of training at its first save
            try:
                held = checkpoint.load(d)[1]
                what = f" (network `{held.get('network')}`, step {held.get('step')})"
            except NetdslError:
                what = ""
            raise NetdslError(f"--checkpoint {d} already holds a checkpoint{what}; give "
                              "--resume to go on from it, --overwrite to start over and "
                              "replace it, or another directory")
    if opts.log:
        p = Path(opts.log)
        if p.is_dir():
            raise NetdslError(f"--log {p} is a directory; give a file name")
        try:
            with open(p, "a"):  # creates it if needed, truncates nothing
                pass
        except OSError as e:
            raise NetdslError(f"--log {p} cannot be written: {e.strerror or e}") from None


def gpu_of(opts: RunOptions) -> int:
    """The GPU this process uses: --device, else over MPI with CuPy the rank's place among
    the ranks on its machine (two ranks on a two-GPU machine both took GPU 0), else 0."""
    if opts.device is not None:
        return opts.device
    if not (opts.distributed and opts.backend == "cupy"):
        return 0
    from netdsl.runtime.mpi import world_on_this_machine
    return world_on_this_machine()[0]


def backend_for(opts: RunOptions):
    """The backend `opts` asks for, on its GPU (`gpu_of`); a missing GPU in words."""
    try:
        return get_backend(opts.backend, gpu_of(opts))
    except NoSuchGpu as e:
        if opts.device is not None or not opts.distributed:
            raise
        raise NoSuchGpu(f"{e.message} Over MPI each rank takes the GPU numbered as its "
                          "place among the ranks on its machine: start at most as many ranks "
                          "on a machine as it has GPUs, or give --device N to put them all "
                          "on GPU N.") from None
