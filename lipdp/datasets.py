"""Raw data sets available offline, as numpy arrays (no download is ever attempted).

* ``digits``: scikit-learn's 8x8 digits (1 797 images, ships with scikit-learn);
* ``fashion_mnist``: IDX files from an explicit ``data_dir`` or from the Debian
  package ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist/``).

Images are returned as float32 in ``[0, 1]`` with a channel axis, labels as int64.
"""

from __future__ import annotations

import gzip
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")

FASHION_MNIST_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]  # fmt: skip


@dataclass
class ArrayDataset:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    class_names: list

    @property
    def nb_classes(self) -> int:
        return len(self.class_names)


def load_digits(test_size: int = 261, seed: int = 0) -> ArrayDataset:
    """scikit-learn's digits, split (stratified) into train and test sets.

    The default ``test_size`` leaves 1 536 training images, a multiple of 256, 512
    and 768 (no partial batch for those batch sizes).
    """
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    data = sklearn_digits()
    x = (data.images[..., None] / 16.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(
        x,
        data.target.astype("int64"),
        test_size=test_size,
        random_state=seed,
        stratify=data.target,
    )
    return ArrayDataset(x_train, y_train, x_test, y_test, [str(i) for i in range(10)])


def read_idx(path) -> np.ndarray:
    """Read an IDX file (optionally gzip-compressed), the MNIST family's format."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if raw[:2] != b"\x00\x00" or raw[2] != 0x08:
        raise ValueError(f"{path} is not an IDX file of unsigned bytes.")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _find_idx(directory: Path, stem: str) -> Path | None:
    for name in (f"{stem}.gz", stem):
        if (directory / name).exists():
            return directory / name
    return None


def load_fashion_mnist(data_dir=None) -> ArrayDataset:
    """Fashion-MNIST from IDX files (``data_dir``, ``$LIPDP_DATA_DIR``, then Debian's)."""
    candidates = [Path(d) for d in (data_dir, os.environ.get("LIPDP_DATA_DIR")) if d]
    candidates.append(DEBIAN_FASHION_MNIST)
    stems = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]  # fmt: skip
    for directory in candidates:
        files = [_find_idx(directory, stem) for stem in stems]
        if all(files):
            x_train, y_train, x_test, y_test = (read_idx(f) for f in files)
            return ArrayDataset(
                (x_train[..., None] / 255.0).astype("float32"),
                y_train.astype("int64"),
                (x_test[..., None] / 255.0).astype("float32"),
                y_test.astype("int64"),
                list(FASHION_MNIST_CLASSES),
            )
    looked = ", ".join(str(d) for d in candidates)
    raise FileNotFoundError(
        f"Fashion-MNIST IDX files ({', '.join(stems)}, optionally .gz) not found in: {looked}. "
        "Install the Debian package dataset-fashion-mnist, or pass data_dir= (or set "
        "LIPDP_DATA_DIR) to a directory holding them. Nothing is downloaded."
    )
