"""Writes the saved Hugging Face datasets that tests/test_data_hf.py reads, with the
`datasets` package itself (not a test dependency: run this by hand to remake them).

    pip install datasets pillow && python tests/data/hf/make.py
"""
from pathlib import Path

import datasets
import numpy as np
from PIL import Image

HERE = Path(__file__).parent


def main() -> None:
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8))
              for _ in range(9)]
    features = datasets.Features({"picture": datasets.Image(),
                                  "kind": datasets.ClassLabel(names=["emu", "cat", "dog"])})
    train = datasets.Dataset.from_dict({"picture": images[:6], "kind": [2, 0, 1, 1, 2, 0]},
                                       features=features)
    test = datasets.Dataset.from_dict({"picture": images[6:], "kind": [0, 2, 1]},
                                      features=features)
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(HERE / "pictures")
    arrays = datasets.Features({"x": datasets.Array3D((3, 16, 16), "float32"),
                                "label": datasets.Value("int64")})
    x = rng.standard_normal((5, 3, 16, 16)).astype(np.float32)
    datasets.Dataset.from_dict({"x": x, "label": [0, 1, 2, 1, 0]},
                               features=arrays).save_to_disk(HERE / "tensors")


if __name__ == "__main__":
    main()
