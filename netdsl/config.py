"""Validated configuration: the `train { }` section and the `parallel { }` declaration.

The front end turns `train { optimizer = sgd(lr=0.1) }` into plain dicts
(`{"kind": "sgd", "lr": 0.1}`); these Pydantic models check them and give defaults.
Command-line options override fields with `TrainConfig.model_copy(update=...)`.
"""
from __future__ import annotations

import os
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# every count (batch, steps, seed...) is a 64-bit integer; every float finite
INT_MAX = 2 ** 63 - 1


# NETDSL_FUSED_KERNELS=0 runs the NumPy reference kernels even where Numba is installed
# (the NumPy backend reads it; so does the mixed-precision rule of which kernels read
# 2-byte values themselves, netdsl.ir.precision)
FUSED_ENV = "NETDSL_FUSED_KERNELS"


def env_switch(name: str, default: bool | None) -> bool | None:
    """An on/off environment variable (NETDSL_FUSED_KERNELS, NETDSL_CUDA_GRAPH...): off
    for 0, false, no or off (any case), on for any other value, `default` when unset or
    empty."""
    v = os.environ.get(name, "").strip().lower()
    if not v:
        return default
    return v not in ("0", "false", "no", "off")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class SGD(_Strict):
    kind: Literal["sgd"] = "sgd"
    lr: float = Field(0.1, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    nesterov: bool = False
    weight_decay: float = Field(0.0, ge=0)
    # the gradients scaled so that their global 2-norm is at most this before the update
    # (torch.nn.utils.clip_grad_norm_; Chainer's GradientClipping); None: not clipped
    clip_grad_norm: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self):
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov momentum requires momentum > 0")
        return self


class Adam(_Strict):
    kind: Literal["adam"] = "adam"
    lr: float = Field(1e-3, gt=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.999, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    clip_grad_norm: float | None = Field(None, gt=0)  # (as SGD's)


class AdamW(Adam):
    kind: Literal["adamw"] = "adamw"  # type: ignore[assignment]
    weight_decay: float = Field(0.01, ge=0)


Optimizer = Annotated[SGD | Adam | AdamW, Field(discriminator="kind")]


class Constant(_Strict):
    kind: Literal["constant"] = "constant"
    warmup: int = Field(0, ge=0, le=INT_MAX)


class Step(_Strict):
    kind: Literal["step"] = "step"
    step_size: int = Field(gt=0, le=INT_MAX)
    gamma: float = Field(0.1, gt=0, le=1)
    warmup: int = Field(0, ge=0, le=INT_MAX)


class Cosine(_Strict):
    kind: Literal["cosine"] = "cosine"
    warmup: int = Field(0, ge=0, le=INT_MAX)
    min_lr: float = Field(0.0, ge=0)
    # the decay horizon; None: the run's total steps. Fix it to make a run that is cut
    # short and resumed follow the same curve as one that is not.
    steps: int | None = Field(None, gt=0, le=INT_MAX)


Schedule = Annotated[Constant | Step | Cosine, Field(discriminator="kind")]


class Synthetic(_Strict):
    kind: Literal["synthetic"] = "synthetic"
    classes: int | None = Field(None, gt=0, le=INT_MAX)
    samples: int = Field(1024, gt=0, le=INT_MAX)
    test_samples: int = Field(256, ge=0, le=INT_MAX)


class Digits(_Strict):
    """The 8x8 handwritten digits that scikit-learn ships (no download)."""

    kind: Literal["digits"] = "digits"
    test_fraction: float = Field(0.2, gt=0, lt=1)
    image: bool = True  # [N, 1, 8, 8] for a CNN; False gives [N, 64] for an MLP


class Npz(_Strict):
    """A user's `.npz` with arrays `x` and `y` (and optionally `x_test`, `y_test`)."""

    kind: Literal["npz"] = "npz"
    path: str
    test_fraction: float = Field(0.0, ge=0, lt=1)


class Images(_Strict):
    """An image folder, one sub-folder per class (torchvision's ImageFolder layout):
    JPEG, PNG and WebP decoded with Pillow (the `images` extra)."""

    kind: Literal["images"] = "images"
    path: str
    test_fraction: float = Field(0.0, ge=0, lt=1)


class Arrays(_Strict):
    """Memory-mapped `.npy` files, x and optionally y: only what a batch needs is read."""

    kind: Literal["arrays"] = "arrays"
    x: str
    y: str | None = None
    test_fraction: float = Field(0.0, ge=0, lt=1)


class Shards(_Strict):
    """WebDataset-layout tar shards (`key.jpg` + `key.cls` records), read in the stream's
    order through a shuffle buffer; `path` may name a range, `train-{0000..0127}.tar`."""

    kind: Literal["shards"] = "shards"
    path: str
    shuffle_buffer: int = Field(1000, ge=1, le=INT_MAX)


class HF(_Strict):
    """A Hugging Face dataset saved with `save_to_disk` (memory-mapped Arrow, the `hf`
    extra): `split` picks one of a DatasetDict's; `image` and `label` name the columns
    (by default the first Image or array feature, and the first ClassLabel)."""

    kind: Literal["hf"] = "hf"
    path: str
    split: str | None = None
    image: str | None = None
    label: str | None = None
    test_fraction: float = Field(0.0, ge=0, lt=1)


Dataset = Annotated[Synthetic | Digits | Npz | Images | Arrays | Shards | HF,
                    Field(discriminator="kind")]
# the data sets whose path fields name files, relative to the .net file that names them
DATA_PATHS = {"npz": ("path",), "images": ("path",), "arrays": ("x", "y"),
              "shards": ("path",), "hf": ("path",)}


class RandomResizedCrop(_Strict):
    kind: Literal["random_resized_crop"] = "random_resized_crop"
    size: int = Field(gt=0, le=65535)
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)

    @model_validator(mode="after")
    def _ordered(self):
        if not (0 < self.scale[0] <= self.scale[1] <= 1 and 0 < self.ratio[0] <= self.ratio[1]):
            raise ValueError("random_resized_crop needs 0 < scale[0] <= scale[1] <= 1 and "
                             "0 < ratio[0] <= ratio[1]")
        return self


class RandomCrop(_Strict):
    kind: Literal["random_crop"] = "random_crop"
    size: int = Field(gt=0, le=65535)
    padding: int = Field(0, ge=0, le=65535)


class Flip(_Strict):
    kind: Literal["flip"] = "flip"
    p: float = Field(0.5, ge=0, le=1)  # the chance of a horizontal flip


class Resize(_Strict):
    kind: Literal["resize"] = "resize"
    size: int = Field(gt=0, le=65535)  # the shorter side, the aspect ratio kept


class CenterCrop(_Strict):
    kind: Literal["center_crop"] = "center_crop"
    size: int = Field(gt=0, le=65535)


class Normalize(_Strict):
    kind: Literal["normalize"] = "normalize"
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @model_validator(mode="after")
    def _per_channel(self):
        if len(self.mean) != len(self.std) or not self.mean or min(self.std) <= 0:
            raise ValueError("normalize needs as many means as stds, one per channel, "
                             "each std > 0")
        return self


Transform = Annotated[RandomResizedCrop | RandomCrop | Flip | Resize | CenterCrop | Normalize,
                      Field(discriminator="kind")]

# calls of the train section that take positional arguments, in this order
POSITIONAL = {"npz": ("path",), "images": ("path",), "arrays": ("x", "y"),
              "shards": ("path",), "hf": ("path",), "random_resized_crop": ("size",),
              "random_crop": ("size",), "resize": ("size",), "center_crop": ("size",),
              "normalize": ("mean", "std")}


class TrainConfig(_Strict):
    data: Dataset = Field(default_factory=Synthetic)
    # held-out data of its own (else the data's own test split, where it has one)
    val: Dataset | None = None
    train_transforms: tuple[Transform, ...] = ()
    eval_transforms: tuple[Transform, ...] = ()
    optimizer: Optimizer = Field(default_factory=SGD)
    schedule: Schedule = Field(default_factory=Constant)
    # a batch larger than this cannot fit in any memory; an int32 index on every backend
    batch: int = Field(32, gt=0, le=2 ** 31 - 1)
    steps: int | None = Field(None, gt=0, le=INT_MAX)
    epochs: int | None = Field(None, gt=0, le=INT_MAX)
    seed: int = Field(0, ge=0, le=INT_MAX)
    eval_every: int | None = Field(None, gt=0, le=INT_MAX)
    # mixed precision: activations and gradients in bf16 or f16, the master weights and
    # optimizer state in f32 (netdsl.passes.precision); f16 with a dynamic loss scale
    precision: Literal["f32", "bf16", "f16"] = "f32"

    # the settings of how the step computes, which an unknown setting's message lists
    # apart from the loop's
    STEP_SETTINGS: ClassVar[tuple[str, ...]] = ("precision",)

    @field_validator("precision", mode="before")
    @classmethod
    def _a_name(cls, v):
        # `precision = bf16` reads as a name, which the front end gives as {"kind": "bf16"}
        return v["kind"] if isinstance(v, dict) and set(v) == {"kind"} else v

    @model_validator(mode="after")
    def _steps_or_epochs(self):
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give either steps or epochs, not both")
        return self


SHARD_APPLIES = ("shard applies to data-parallel replicas alone or with pipeline and tensor "
                 "splits (data = 2 or more: the replicas of each stage and tensor rank), not "
                 "to spatial splits")
SPATIAL_ALONE = ("spatial splits combine with data replicas only, not with pipeline or "
                 "tensor splits")
VIRTUAL_STAGES_APPLY = ("virtual_stages (interleaved 1F1B) needs a pipeline of 2 or more "
                        "stages in 1f1b order, with microbatches a multiple of pipeline")
MICROBATCHES_APPLY = ("microbatches apply to pipelines, to data-parallel replicas and to one "
                      "device (gradient accumulation), not to tensor or spatial splits")


class ParallelConfig(_Strict):
    """The network-level `parallel { }` declaration; devices = data x pipeline x tensor x
    spatial."""

    data: int = Field(1, ge=1, le=INT_MAX)
    pipeline: int = Field(1, ge=1, le=INT_MAX)
    microbatches: int = Field(1, ge=1, le=INT_MAX)
    tensor: int = Field(1, ge=1, le=INT_MAX)
    spatial: int = Field(1, ge=1, le=INT_MAX)
    # a pipeline's order; None: the scheme's own (GPipe for a declared pipeline, 1F1B for
    # micro-batches accumulated and for `auto`)
    schedule: Literal["gpipe", "1f1b", "zb-h1"] | None = None
    # the data replicas' state sharded (ZeRO): 1 optimizer state, 2 and gradients, 3 and
    # parameters
    shard: Literal[0, 1, 2, 3] = 0
    # model chunks per pipeline stage: interleaved 1F1B (Megatron-LM's virtual stages)
    virtual_stages: int = Field(1, ge=1, le=INT_MAX)

    @property
    def devices(self) -> int:
        return self.data * self.pipeline * self.tensor * self.spatial

    @model_validator(mode="after")
    def _microbatches(self):
        # without a pipeline, micro-batches accumulate the gradients (on one device, or
        # on each data-parallel replica)
        if self.microbatches != 1 and self.pipeline == 1 and self.tensor * self.spatial > 1:
            raise ValueError(MICROBATCHES_APPLY)
        if self.shard and (self.data == 1 or self.spatial > 1):
            raise ValueError(SHARD_APPLIES)
        if self.virtual_stages > 1 and (self.pipeline == 1 or self.schedule not in (None, "1f1b")
                                        or self.microbatches % self.pipeline):
            raise ValueError(VIRTUAL_STAGES_APPLY)
        if self.spatial > 1 and self.pipeline * self.tensor > 1:
            raise ValueError(SPATIAL_ALONE)
        return self
