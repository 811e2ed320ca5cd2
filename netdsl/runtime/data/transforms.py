"""The augmentation pipelines declared in the train section (`train_transforms`,
`eval_transforms`), as torchvision's transforms of the same names do them.

A sample travels as a Pillow image (decoded images, and 8-bit arrays where a resize needs
Pillow) or as a channels-first array; the pipeline ends by writing it, as floats, into
its row of the batch: an 8-bit image in [0, 1] (torchvision's ToTensor), then normalized
as `normalize(mean, std)` says (the two folded into one multiply and add).

Every random choice of sample i in epoch e is drawn from its own stream, Philox keyed by
(seed, e) at counter i: a sample's augmentation depends on (seed, epoch, index) alone,
whichever process, worker or rank draws it, and in whatever order.
"""
from __future__ import annotations

import math

import numpy as np

from netdsl.errors import NetdslError


class SampleRng:
    """Sample i's generator in epoch e: one Philox bit generator whose counter is set in
    place (cheaper than a generator a sample)."""

    def __init__(self, seed: int):
        self.seed, self.epoch = seed, None
        self.bits = self.gen = self.state = None

    def at(self, epoch: int, index: int) -> np.random.Generator:
        if epoch != self.epoch:
            self.epoch = epoch
            self.bits = np.random.Philox(key=[self.seed, 1 << 32 | epoch])
            self.gen, self.state = np.random.Generator(self.bits), self.bits.state
        self.state["state"]["counter"] = np.array([0, int(index), 0, 0], dtype=np.uint64)
        self.state.update(buffer_pos=4, has_uint32=0, uinteger=0)
        self.bits.state = self.state
        return self.gen


def _size(img) -> tuple[int, int]:
    """(height, width)."""
    if isinstance(img, np.ndarray):
        return img.shape[-2], img.shape[-1]
    return img.size[1], img.size[0]


def _pil(img):
    """A channels-first 8-bit array as a Pillow image (a resize needs Pillow)."""
    if not isinstance(img, np.ndarray):
        return img
    if img.dtype != np.uint8 or img.shape[0] not in (1, 3):
        raise NetdslError(f"resizing needs 8-bit images of 1 or 3 channels, not {img.dtype} "
                          f"shaped {list(img.shape)}; crop, flip and normalize take any")
    from netdsl.runtime.data.sources import pillow
    return pillow().fromarray(img[0] if img.shape[0] == 1 else img.transpose(1, 2, 0))


def _bilinear():
    from netdsl.runtime.data.sources import pillow
    return pillow().Resampling.BILINEAR


def rrc_box(h: int, w: int, scale, ratio, rng) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params: (top, left, height, width)."""
    area = h * w
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(lo, hi))
        cw = int(round(math.sqrt(target * aspect)))
        ch = int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            return int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1)), ch, cw
    # the fallback: a centre crop of the ratio clamped into range
    r = w / h
    if r < ratio[0]:
        cw, ch = w, int(round(w / ratio[0]))
    elif r > ratio[1]:
        ch, cw = h, int(round(h * ratio[1]))
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def random_resized_crop(img, t, rng):
    h, w = _size(img)
    top, left, ch, cw = rrc_box(h, w, t.scale, t.ratio, rng)
    return _pil(img).resize((t.size, t.size), _bilinear(),
                            box=(left, top, left + cw, top + ch))


def _crop(img, top: int, left: int, size: int):
    """The size x size window at (top, left), zeros where it leaves the image."""
    h, w = _size(img)
    if not isinstance(img, np.ndarray):
        return img.crop((left, top, left + size, top + size))
    if 0 <= top and top + size <= h and 0 <= left and left + size <= w:
        return img[:, top:top + size, left:left + size]
    out = np.zeros(img.shape[:-2] + (size, size), dtype=img.dtype)
    t0, l0 = max(top, 0), max(left, 0)
    t1, l1 = min(top + size, h), min(left + size, w)
    if t1 > t0 and l1 > l0:
        out[:, t0 - top:t1 - top, l0 - left:l1 - left] = img[:, t0:t1, l0:l1]
    return out


def random_crop(img, t, rng):
    """torchvision's RandomCrop(size, padding): zero padding on every side, then a window
    drawn uniformly."""
    h, w = _size(img)
    p = t.padding
    if h + 2 * p < t.size or w + 2 * p < t.size:
        raise NetdslError(f"random_crop({t.size}, padding={p}) of an image of {h}x{w}: the "
                          "padded image is smaller than the crop")
    top = int(rng.integers(0, h + 2 * p - t.size + 1)) - p
    left = int(rng.integers(0, w + 2 * p - t.size + 1)) - p
    return _crop(img, top, left, t.size)


def flip(img, t, rng):
    """A horizontal flip with chance p (drawn whatever p is, so a sample's later draws do
    not depend on it)."""
    if rng.random() >= t.p:
        return img
    if isinstance(img, np.ndarray):
        return img[..., ::-1]
    from netdsl.runtime.data.sources import pillow
    return img.transpose(pillow().Transpose.FLIP_LEFT_RIGHT)


def resize(img, t, rng):
    """The shorter side to `size`, the aspect ratio kept (torchvision's Resize(int))."""
    h, w = _size(img)
    if h <= w:
        nh, nw = t.size, int(t.size * w / h)
    else:
        nh, nw = int(t.size * h / w), t.size
    if (nh, nw) == (h, w):
        return img
    return _pil(img).resize((nw, nh), _bilinear())


def center_crop(img, t, rng):
    h, w = _size(img)
    return _crop(img, int(round((h - t.size) / 2)), int(round((w - t.size) / 2)), t.size)


_STEPS = {"random_resized_crop": random_resized_crop, "random_crop": random_crop,
          "flip": flip, "resize": resize, "center_crop": center_crop}


class Pipeline:
    """A split's transforms, run on one sample and written into its row of a batch
    (`into`); `normalize` is folded into that write, wherever it is declared."""

    def __init__(self, transforms, seed: int):
        self.steps = [(_STEPS[t.kind], t) for t in transforms if t.kind != "normalize"]
        norm = [t for t in transforms if t.kind == "normalize"]
        self.mean = np.asarray(norm[-1].mean, dtype=np.float64) if norm else None
        self.std = np.asarray(norm[-1].std, dtype=np.float64) if norm else None
        self.rng = SampleRng(seed)
        self.random = any(t.kind in ("random_resized_crop", "random_crop", "flip")
                          for t in transforms)

    def shaped(self, img, epoch: int, index: int):
        """The sample after the geometric steps (a Pillow image or an array)."""
        rng = self.rng.at(epoch, index) if self.random else None
        for step, t in self.steps:
            img = step(img, t, rng)
        return img

    def into(self, img, out: np.ndarray, epoch: int, index: int) -> None:
        """Run the pipeline on `img` and write the result into `out` (channels first)."""
        img = self.shaped(img, epoch, index)
        a = np.asarray(img)
        if not isinstance(img, np.ndarray):  # a Pillow image: [H, W(, C)]
            a = a[None] if a.ndim == 2 else a.transpose(2, 0, 1)
        if a.shape != out.shape:
            raise ShapeMismatch(tuple(a.shape), tuple(out.shape))
        scale = 1 / 255 if a.dtype == np.uint8 and out.dtype.kind == "f" else 1.0
        if self.mean is None:
            if scale == 1.0:
                out[...] = a
            else:
                np.multiply(a, out.dtype.type(scale), out=out, casting="unsafe")
            return
        c = a.shape[0]
        if len(self.mean) not in (1, c):
            raise NetdslError(f"normalize has {len(self.mean)} means but the images have "
                              f"{c} channels")
        mul = (scale / self.std).astype(out.dtype).reshape(-1, 1, 1)
        add = (-self.mean / self.std).astype(out.dtype).reshape(-1, 1, 1)
        np.multiply(a, mul, out=out, casting="unsafe")
        out += add

    def unnormalize(self, batch: np.ndarray) -> np.ndarray:
        """A batch back into [0, 1] for pictures (`netdsl data --png`)."""
        if self.mean is None:
            return batch
        return batch * self.std.reshape(-1, 1, 1) + self.mean.reshape(-1, 1, 1)


class ShapeMismatch(Exception):
    def __init__(self, got: tuple, want: tuple):
        super().__init__(f"{got} vs {want}")
        self.got, self.want = got, want
