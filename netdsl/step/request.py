"""What a command asks of a training step, parsed once at the boundary.

`request_for(opts, cfg, backend)` turns the user's options (`netdsl.options`) into a
`StepRequest`: the budget in bytes, a resolved device `Profile`, the devices and split,
and whether the step is built to run here. Everything after it reads typed values.

The profile rule is the same for every command: the device the step would run on (the
`cpu` profile with NumPy, the detected GPU's with CuPy), unless `--profile` names one.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from netdsl.config import TrainConfig
from netdsl.errors import NetdslError
from netdsl.frontend.train import pydantic_message
from netdsl.memory.profiles import PROFILES, Profile, get_profile
from netdsl.options import StepOptions, check_precision
from netdsl.sizes import parse_size

# GPU names (as the driver reports them) and the built-in profile of each
_GPU_FAMILIES = (("H200", "h200"), ("H100", "h100-80gb"), ("A100", "a100-40gb"),
                 ("V100", "v100-16gb"), ("K40", "k40-12gb"))
# the rates an unknown GPU is predicted with (its memory is its own)
_UNKNOWN_GPU_RATES = "h200"


@dataclass(frozen=True)
class World:
    """The MPI ranks a distributed step is built by, one device each: this rank's number,
    their count, and `allgather` (every rank's object, in rank order)."""

    rank: int
    size: int
    allgather: Callable[[Any], list]


@dataclass(frozen=True)
class StepRequest:
    """Everything a training step is built from, each value parsed and resolved."""

    batch: int
    profile: Profile
    profile_given: bool = False  # --profile, rather than the device's own
    device_kind: str = "cpu"  # whose fusions and kernel variants: "cpu" or "gpu"
    dtype: str = "f32"
    precision: str = "f32"  # mixed precision: "bf16" or "f16" (netdsl.passes.precision)
    budget_bytes: int | None = None  # --mem
    strategy: str = "auto"  # how a step is planned into the budget
    offload_state: bool = False
    devices: int = 1
    split: str | None = None  # None: the file's `parallel { }`, else auto
    microbatches: int | None = None  # None: the file's
    schedule: str | None = None
    bn: str = "sync"
    shard: int | None = None  # None: the file's, else none (or auto's choice)
    virtual_stages: int | None = None  # None: the file's, else 1 (or auto's choice)
    interconnect: str = "shm"
    over_mpi: bool = False  # one process a device: MPI holds each message until received
    jobs: int | None = None
    weigh_splits: bool = False  # choose among candidate splits even on one device (`split`)
    fetch_logits: bool = True  # the loss's logits as an output, made whole (accuracy)
    # built to run in this process: unplanned, its updates are grouped into one node per
    # kind; with no budget on one device, a step that needs more than `free_bytes` is
    # planned into nine tenths of it
    runs: bool = False
    free_bytes: int | None = None
    prefetch: int | None = None  # the planner's offload prefetch distance (None: its own)
    verify_plan: bool = True  # apply a plan's decisions and check the rewritten step

    @property
    def split_devices(self) -> bool:
        """Whether the step is a split's (chosen by `netdsl.parallel.choose`)."""
        return self.devices > 1 or self.over_mpi or self.weigh_splits


def resolve_config(cfg: TrainConfig | None, opts: StepOptions) -> TrainConfig:
    """The file's `train` section (or its defaults) with the options' overrides, checked."""
    cfg = cfg or TrainConfig()
    update: dict[str, Any] = {}
    for k in ("batch", "seed", "eval_every", "precision"):
        if getattr(opts, k, None) is not None:
            update[k] = getattr(opts, k)
    if getattr(opts, "steps", None) is not None:
        update.update(steps=opts.steps, epochs=None)
    elif getattr(opts, "epochs", None) is not None:
        update.update(epochs=opts.epochs, steps=None)
    optimizer = {k: getattr(opts, k) for k in ("lr", "clip_grad_norm")
                 if getattr(opts, k, None) is not None}
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


def request_for(opts: StepOptions, cfg: TrainConfig, backend=None, *, runs: bool = False,
                mem_default: bool = False, **overrides) -> StepRequest:
    """The request `opts` makes for a step of `cfg` (already resolved against the options)
    on `backend` (a Backend, or None for NumPy). `runs`: the step is run here, so its
    kernels are the backend's; else (`plan`, `split`) they are the profile's device's.
    `mem_default`: with no --mem, the profile's capacity is the budget (`plan`)."""
    profile = resolve_profile(opts.profile, backend)
    budget = parse_size(opts.mem, "--mem") if opts.mem is not None else None
    if budget is None and mem_default:
        budget = profile.capacity_bytes
    on_gpu = getattr(backend, "name", "numpy") == "cupy"
    kind = ("gpu" if on_gpu else "cpu") if runs else ("cpu" if profile.unified else "gpu")
    check_precision(cfg.precision, opts.dtype,
                    "--precision" if opts.precision else "the train section's precision")
    if runs and backend is not None and cfg.precision != "f32":
        backend.check_precision(cfg.precision)
    return replace(StepRequest(
        batch=cfg.batch, profile=profile, profile_given=opts.profile is not None,
        device_kind=kind, dtype=opts.dtype, precision=cfg.precision,
        budget_bytes=budget, strategy=opts.strategy, offload_state=opts.offload_state,
        devices=opts.devices, split=opts.split, microbatches=opts.microbatches,
        schedule=opts.schedule, bn=opts.bn, shard=opts.shard,
        virtual_stages=opts.virtual_stages,
        interconnect="shm" if runs else opts.interconnect, over_mpi=opts.distributed,
        jobs=opts.jobs, runs=runs), **overrides)


def resolve_profile(name: str | Profile | None, backend=None) -> Profile:
    """`--profile` if given, else the profile of the device `backend` runs on."""
    if name is not None:
        return get_profile(name)
    if getattr(backend, "name", "numpy") != "cupy":
        return PROFILES["cpu"]
    props = backend.xp.cuda.runtime.getDeviceProperties(backend.device)
    total = int(backend.xp.cuda.Device(backend.device).mem_info[1])
    return gpu_profile(_text(props.get("name", "")), total)


def gpu_profile(gpu_name: str, total_bytes: int) -> Profile:
    """The profile of a GPU the driver calls `gpu_name`, with `total_bytes` of memory: its
    family's built-in rates and the card's own memory (cards are sold by GiB: an "80 GB"
    H100 has 85.5e9 bytes; an A100 with 80 GB is not the 40 GB one, and is named so); a
    GPU of no known family takes the newest family's rates and says so."""
    family = next((p for key, p in _GPU_FAMILIES if key in gpu_name.upper()), None)
    base = PROFILES[family or _UNKNOWN_GPU_RATES]
    gib = round(total_bytes / 2**30)
    sold = re.search(r"(\d+)\s*GB", gpu_name.upper())  # "A100-SXM4-80GB"
    size = int(sold.group(1)) if sold else gib
    if family is None:
        slug = re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-") or "gpu"
        return replace(base, name=f"{slug}-{size}gb" if not sold else slug,
                       capacity_bytes=total_bytes,
                       source=f"{gpu_name} (no built-in profile): {base.name}'s rates, its "
                              f"own {gib} GiB; `netdsl calibrate` measures it")
    if abs(size - base.capacity_bytes / 1e9) > 0.1 * size:  # another size of the family
        name = f"{family.split('-')[0]}-{size}gb"
    else:
        name = base.name
    return replace(base, name=name, capacity_bytes=total_bytes,
                   source=f"{gpu_name}, {gib} GiB: {base.source}")


def _text(v) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)
