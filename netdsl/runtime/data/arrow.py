"""`hf("saved/")`: a Hugging Face dataset saved with `Dataset.save_to_disk` (or a
`DatasetDict`'s, one folder per split), read through pyarrow alone (the `hf` extra; the
`datasets` package is not needed).

Such a folder holds `state.json` (its Arrow files, in order), `dataset_info.json` (the
features: which column is an `Image`, which a `ClassLabel` and its names) and the Arrow
files in the IPC stream format. They are memory-mapped: a sample's bytes are read when a
batch takes it, the page cache holds them, and the process holds only the label column
and the offsets of each file's record batches. Like every source, it is pickled to the
workers without an open map (each process maps the files itself, on first use).
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from netdsl.errors import NetdslError
from netdsl.runtime.data.sources import BadSample, Source, decode, pillow

_IMAGE_TYPES = ("Image",)
_ARRAY_TYPES = ("Array2D", "Array3D", "Array4D", "Sequence", "List")


def pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.ipc  # noqa: F401  (the stream reader)
    except ImportError:
        raise NetdslError("hf() reads Arrow files with pyarrow: pip install 'netdsl[hf]' (or "
                          "pyarrow)") from None
    return pa


def _json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise NetdslError(f"hf dataset {path.parent}: cannot read its {what} {path.name} "
                          f"({e}); is it a folder written by save_to_disk?") from None


def split_folder(root: str, split: str | None) -> Path:
    """The folder of one split: `root` itself for a Dataset's, `root/SPLIT` for a
    DatasetDict's (`split` defaults to "train" there)."""
    path = Path(root)
    if not path.is_dir():
        what = "is not a folder" if path.exists() else "does not exist"
        raise NetdslError(f"hf dataset {root} {what}; hf() takes a folder written by "
                          "Dataset.save_to_disk or DatasetDict.save_to_disk")
    if (path / "dataset_dict.json").exists():
        splits = _json(path / "dataset_dict.json", "split list").get("splits", [])
        name = split or "train"
        if name not in splits:
            raise NetdslError(f"hf dataset {root} has splits {', '.join(splits) or 'none'}, "
                              f"not {name!r}: give hf(\"{root}\", split=\"...\")")
        path = path / name
    elif split is not None:
        raise NetdslError(f"hf dataset {root} is one Dataset, not a DatasetDict: it has no "
                          f"split {split!r} (leave split out)")
    if not (path / "state.json").exists():
        raise NetdslError(f"hf dataset {path} has no state.json: hf() takes a folder written "
                          "by save_to_disk")
    return path


def _pick(features: dict, asked: str | None, types: tuple[str, ...], role: str,
          where: Path) -> str | None:
    if asked is not None:
        if asked not in features:
            raise NetdslError(f"hf dataset {where} has no column {asked!r} for the {role}; "
                              f"its columns are {', '.join(features)}")
        return asked
    return next((c for c, f in features.items()
                 if isinstance(f, dict) and f.get("_type") in types), None)


class ArrowDataset(Source):
    """One split of a saved dataset: samples from its `image` column (an `Image` feature,
    decoded with Pillow, or a fixed-shape array feature), labels from its `label` column
    (a `ClassLabel`, whose names are the classes, or integers)."""

    def __init__(self, root: str, split: str | None = None, image: str | None = None,
                 label: str | None = None):
        pa = pyarrow()
        self.folder = split_folder(root, split)
        self.name = str(self.folder)
        state = _json(self.folder / "state.json", "state")
        info = _json(self.folder / "dataset_info.json", "features")
        features = info.get("features") or {}
        self.column = _pick(features, image, _IMAGE_TYPES + _ARRAY_TYPES, "samples",
                            self.folder)
        if self.column is None:
            raise NetdslError(f"hf dataset {self.folder} has no Image or array column among "
                              f"{', '.join(features) or 'its columns'}; name one: "
                              "hf(..., image=\"COLUMN\")")
        self.is_image = features[self.column].get("_type") in _IMAGE_TYPES
        label = _pick(features, label, ("ClassLabel",), "labels", self.folder)
        if label is None and "label" in features:
            label = "label"
        self.files = [str(self.folder / f["filename"]) for f in state.get("_data_files", [])]
        if not self.files:
            raise NetdslError(f"hf dataset {self.folder}: its state.json names no Arrow files")
        counts, labels = [], []
        for path in self.files:
            table = self._table(pa, path)
            counts.append(table.num_rows)
            if label is not None:
                labels.append(table.column(label).to_numpy())
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if label is not None:
            values = np.concatenate(labels) if labels else np.zeros(0)
            if not np.issubdtype(values.dtype, np.integer):
                raise NetdslError(f"hf dataset {self.folder}: column {label!r} holds "
                                  f"{values.dtype}, not one integer class a sample")
            self.labels = values.astype(np.int64)
            self.classes = features[label].get("names")
        self._tables: dict[int, object] = {}

    def _table(self, pa, path: str):
        try:
            return pa.ipc.open_stream(pa.memory_map(path, "r")).read_all()
        except (OSError, pa.ArrowInvalid) as e:
            raise NetdslError(f"hf dataset {self.folder}: cannot read Arrow file {path} ({e}); "
                              "the file is truncated or not written by save_to_disk") from None

    def __getstate__(self):
        return {**self.__dict__, "_tables": {}}  # (each process maps the files itself)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def where(self, i: int) -> str:
        k = int(np.searchsorted(self.starts, i, side="right") - 1)
        return f"{self.files[k]}, row {i - int(self.starts[k])} (sample {i})"

    def _value(self, i: int):
        k = int(np.searchsorted(self.starts, i, side="right") - 1)
        if k not in self._tables:
            self._tables[k] = self._table(pyarrow(), self.files[k]).column(self.column)
        return self._tables[k][i - int(self.starts[k])].as_py()

    def read(self, i: int):
        value = self._value(i)
        if value is None:
            raise BadSample(self.where(i), f"column {self.column!r} is empty")
        if not self.is_image:
            return np.asarray(value)
        data, path = value.get("bytes"), value.get("path")
        if data is not None:
            return decode(pillow(), io.BytesIO(data), self.where(i), self.mode)
        if path is None:
            raise BadSample(self.where(i), "the image has neither bytes nor a path")
        return decode(pillow(), self.folder / path, self.where(i), self.mode)
