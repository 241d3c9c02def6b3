"""Raw data sets as numpy arrays, from local files only: nothing is ever downloaded.

Image data sets (:func:`load_images`):

* ``"digits"``: scikit-learn's 8x8 digits (1 797 images, ships with scikit-learn);
* ``"mnist"``, ``"fashion_mnist"``, ``"cifar10"``: looked for, in this order, in

  1. an explicit ``data_dir`` (a directory, or directly an ``.npz`` file / CIFAR-10
     tarball), then ``$LIPDP_DATA_DIR``;
  2. the Keras cache, where ``keras.datasets.<name>.load_data()`` stores its
     downloads (``$KERAS_HOME/datasets`` when set, ``~/.keras/datasets``, and
     ``/tmp/.keras/datasets`` when ``~/.keras`` is not writable, as Keras does);
  3. TensorFlow Datasets, when the package is installed and the data set is
     already prepared in its data directory (``download=False``);
  4. for Fashion-MNIST, the Debian package ``dataset-fashion-mnist``
     (``/usr/share/datasets/fashion-mnist/``).

  Accepted file formats in a directory: the four IDX files of the MNIST family
  (``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
  ``t10k-labels-idx1-ubyte``, optionally ``.gz``), an ``.npz`` archive with arrays
  ``x_train``, ``y_train``, ``x_test``, ``y_test`` (Keras' ``mnist.npz`` is one), and for
  CIFAR-10 the python version (directory ``cifar-10-batches-py`` or its tarball
  ``cifar-10-python.tar.gz``). CIFAR-10 batches are Python pickles: only point the
  loader at files you trust.

  A missing data set raises :class:`FileNotFoundError` at once, listing every place
  looked at and how to provide the files.

Images are returned as float32 in ``[0, 1]`` with a channel axis, labels as int64.

Tabular anomaly-detection data in the ADBench ``.npz`` format (arrays ``x`` and
``y``, ``y = 1`` for an anomaly): :func:`load_adbench_data`.

This module was ``lipdp.data.sources``, which still re-exports it. It reads files and
returns arrays; :mod:`lipdp.data.images` and :mod:`lipdp.data.tabular` turn them into
batched ``tf.data`` pipelines.
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import pickle
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")

#: Small public data sets shipped inside the package (ADBench "shuttle", 330 kB): every
#: install has them, nothing is looked for outside the package and the user's directories.
PACKAGED_DATA_DIR = Path(__file__).resolve().parent / "files"

FASHION_MNIST_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]  # fmt: skip

CIFAR10_CLASSES = [
    "airplane", "automobile", "bird", "cat", "deer",
    "dog", "frog", "horse", "ship", "truck",
]  # fmt: skip

MNIST_CLASSES = [str(i) for i in range(10)]

IDX_STEMS = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)

#: Canonical names of the image data sets, and accepted aliases.
IMAGE_DATASETS = ("mnist", "fashion_mnist", "cifar10", "digits")
_ALIASES = {
    "fashion-mnist": "fashion_mnist",
    "fashionmnist": "fashion_mnist",
    "cifar-10": "cifar10",
}


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


def canonical_name(name: str) -> str:
    """``"Fashion-MNIST"`` -> ``"fashion_mnist"``; unknown names raise ``ValueError``."""
    key = str(name).lower()
    key = _ALIASES.get(key, key)
    if key not in IMAGE_DATASETS:
        raise ValueError(
            f"Unknown image data set {name!r}; supported: {', '.join(IMAGE_DATASETS)}."
        )
    return key


def load_images(name: str, data_dir=None) -> ArrayDataset:
    """One of :data:`IMAGE_DATASETS` (see the module docstring for where files are found)."""
    name = canonical_name(name)
    if name == "digits":
        return load_digits()
    if name == "mnist":
        return load_mnist(data_dir)
    if name == "fashion_mnist":
        return load_fashion_mnist(data_dir)
    return load_cifar10(data_dir)


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


#: Public ranges of the 30 features of the Wisconsin diagnostic breast-cancer set
#: (mean, standard error and worst value of 10 measurements), taken from the Min/Max
#: table of the set's published description (scikit-learn's ``DESCR``, from UCI) and
#: widened outwards to round values. They are treated as public, like the label set;
#: strictly, the publishers computed them from the same records (a user who needs a
#: guarantee covering them should supply ranges from domain knowledge).
BREAST_CANCER_RANGES = (
    # radius, texture, perimeter, area, smoothness, compactness, concavity,
    # concave points, symmetry, fractal dimension
    (  # mean
        (0.0, 30.0),
        (0.0, 40.0),
        (0.0, 200.0),
        (0.0, 2600.0),
        (0.0, 0.2),
        (0.0, 0.4),
        (0.0, 0.5),
        (0.0, 0.25),
        (0.0, 0.35),
        (0.0, 0.1),
    ),
    (  # standard error
        (0.0, 3.0),
        (0.0, 5.0),
        (0.0, 25.0),
        (0.0, 600.0),
        (0.0, 0.035),
        (0.0, 0.15),
        (0.0, 0.4),
        (0.0, 0.06),
        (0.0, 0.08),
        (0.0, 0.03),
    ),
    (  # worst
        (0.0, 40.0),
        (0.0, 50.0),
        (0.0, 260.0),
        (0.0, 4300.0),
        (0.0, 0.25),
        (0.0, 1.1),
        (0.0, 1.3),
        (0.0, 0.3),
        (0.0, 0.7),
        (0.0, 0.21),
    ),
)


def load_breast_cancer(test_size=0.2, seed: int = 0) -> ArrayDataset:
    """scikit-learn's Wisconsin diagnostic breast-cancer set (569 x 30, bundled), split
    (stratified, ``random_state=seed``) into train and test sets.

    Every feature is clipped to its public range (:data:`BREAST_CANCER_RANGES`) and
    mapped affinely to ``[-1, 1]``: no statistic of the private rows is used, and every
    row has norm at most ``sqrt(30)``. Classes: ``0`` malignant, ``1`` benign.
    """
    from sklearn.datasets import load_breast_cancer as sklearn_breast_cancer
    from sklearn.model_selection import train_test_split

    data = sklearn_breast_cancer()
    low, high = np.array([r for block in BREAST_CANCER_RANGES for r in block], "float64").T
    x = np.clip(data.data, low, high)
    x = (2.0 * (x - low) / (high - low) - 1.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(
        x,
        data.target.astype("int64"),
        test_size=test_size,
        random_state=seed,
        stratify=data.target,
    )
    return ArrayDataset(x_train, y_train, x_test, y_test, ["malignant", "benign"])


def load_mnist(data_dir=None) -> ArrayDataset:
    """MNIST (60 000 / 10 000 28x28 images) from local files."""
    return _load_from_sources("mnist", data_dir)


def load_fashion_mnist(data_dir=None, *, data_dir_name="data_dir") -> ArrayDataset:
    """Fashion-MNIST (60 000 / 10 000 28x28 images) from local files; the Debian
    package ``dataset-fashion-mnist`` is the last place looked at. ``data_dir_name``: how
    the error message names ``data_dir`` (the CLI: ``--data-dir``)."""
    return _load_from_sources("fashion_mnist", data_dir, data_dir_name)


def load_cifar10(data_dir=None) -> ArrayDataset:
    """CIFAR-10 (50 000 / 10 000 32x32x3 images) from local files."""
    return _load_from_sources("cifar10", data_dir)


# --------------------------------------------------------------------- formats
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
        if (directory / name).is_file():
            return directory / name
    return None


def _images_to_unit(x, source) -> np.ndarray:
    """uint8 pixels -> float32 in [0, 1]; float pixels must already be in [0, 1]."""
    x = np.asarray(x)
    if x.ndim == 3:
        x = x[..., None]
    if x.ndim != 4:
        raise ValueError(f"{source}: images must have shape (N, H, W[, C]), got {x.shape}.")
    if x.dtype == np.uint8:
        return (x / 255.0).astype("float32")
    x = x.astype("float32")
    if x.size and (x.min() < 0.0 or x.max() > 1.0):
        raise ValueError(
            f"{source}: float images must lie in [0, 1] (uint8 images are divided by 255); "
            f"got values in [{x.min()}, {x.max()}]."
        )
    return x


def _labels(y) -> np.ndarray:
    return np.asarray(y).reshape(-1).astype("int64")


def _read_idx_dir(directory: Path):
    files = [_find_idx(directory, stem) for stem in IDX_STEMS]
    if not all(files):
        return None
    x_train, y_train, x_test, y_test = (read_idx(f) for f in files)
    return x_train, y_train, x_test, y_test, str(directory)


def _read_npz(path: Path):
    with np.load(path, allow_pickle=False) as data:
        missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in data]
        if missing:
            raise ValueError(f"{path} has no arrays {missing} (x_train, y_train, x_test, y_test).")
        return data["x_train"], data["y_train"], data["x_test"], data["y_test"], str(path)


def _unpickle(fileobj) -> dict:
    return pickle.load(fileobj, encoding="bytes")


def _cifar_batches(batches: dict, source: str):
    """``batches``: file name -> unpickled dict of the CIFAR-10 python version."""
    train = [batches.get(f"data_batch_{i}") for i in range(1, 6)]
    test = batches.get("test_batch")
    if any(b is None for b in train) or test is None:
        return None

    def images(batch):
        return (
            np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        )

    x_train = np.concatenate([images(b) for b in train])
    y_train = np.concatenate([np.asarray(b[b"labels"]) for b in train])
    return x_train, y_train, images(test), np.asarray(test[b"labels"]), source


def _read_cifar_dir(directory: Path):
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    if not all((directory / n).is_file() for n in names):
        return None
    batches = {}
    for n in names:
        with open(directory / n, "rb") as f:
            batches[n] = _unpickle(f)
    return _cifar_batches(batches, str(directory))


def _read_cifar_tar(path: Path):
    batches = {}
    with tarfile.open(path, "r:gz") as tar:
        for member in tar.getmembers():
            base = member.name.rsplit("/", 1)[-1]
            if member.isfile() and (base.startswith("data_batch_") or base == "test_batch"):
                batches[base] = _unpickle(tar.extractfile(member))
    return _cifar_batches(batches, str(path))


# ------------------------------------------------------------ where to look
_NPZ_NAMES = {
    "mnist": ("mnist.npz",),
    "fashion_mnist": ("fashion_mnist.npz", "fashion-mnist.npz"),
    "cifar10": ("cifar10.npz", "cifar-10.npz"),
}
_IDX_SUBDIRS = {"mnist": ("mnist",), "fashion_mnist": ("fashion-mnist", "fashion_mnist")}
_CIFAR_TARBALLS = ("cifar-10-python.tar.gz", "cifar-10-batches-py.tar.gz")

_WHAT = {
    "mnist": "the 4 IDX files (train-images-idx3-ubyte[.gz], ...) or mnist.npz",
    "fashion_mnist": "the 4 IDX files (train-images-idx3-ubyte[.gz], ...) or fashion_mnist.npz",
    "cifar10": "cifar-10-batches-py/ (data_batch_1..5, test_batch), cifar-10-python.tar.gz "
    "or cifar10.npz",
}

_HOW = {
    "mnist": "On a machine with network run keras.datasets.mnist.load_data() and copy "
    "~/.keras/datasets/mnist.npz here (into ~/.keras/datasets/ or a directory passed as "
    "data_dir= / $LIPDP_DATA_DIR), or put the 4 IDX files of MNIST in such a directory.",
    "fashion_mnist": "Install the Debian package dataset-fashion-mnist, or pass data_dir= "
    "(or set LIPDP_DATA_DIR) to a directory holding the 4 IDX files (or "
    "fashion_mnist.npz), or copy ~/.keras/datasets/fashion-mnist/ from a machine where "
    "keras.datasets.fashion_mnist.load_data() ran.",
    "cifar10": "On a machine with network run keras.datasets.cifar10.load_data() and copy "
    "~/.keras/datasets/cifar-10-batches-py/ here (into ~/.keras/datasets/ or a directory "
    "passed as data_dir= / $LIPDP_DATA_DIR), or put cifar-10-python.tar.gz from "
    "https://www.cs.toronto.edu/~kriz/cifar.html in such a directory.",
}


def keras_cache_dirs() -> list[Path]:
    """Where ``keras.datasets`` keeps its downloads (``<cache>/datasets``)."""
    dirs = []
    if os.environ.get("KERAS_HOME"):
        dirs.append(Path(os.environ["KERAS_HOME"]).expanduser() / "datasets")
    home = Path(os.path.expanduser("~")) / ".keras"
    dirs.append(home / "datasets")
    if not os.access(home, os.W_OK):  # Keras 2 falls back to /tmp/.keras then
        dirs.append(Path("/tmp/.keras/datasets"))
    unique = []
    for d in dirs:
        if d not in unique:
            unique.append(d)
    return unique


def _search_path(path: Path, name: str):
    """Data set ``name`` in ``path`` (a directory, or an .npz / CIFAR tarball file)."""
    if path.is_file():
        if path.suffix == ".npz":
            return _read_npz(path)
        if name == "cifar10" and path.name.endswith(".tar.gz"):
            return _read_cifar_tar(path)
        return None
    if not path.is_dir():
        return None
    if name in _IDX_SUBDIRS:
        for directory in (path, *(path / s for s in _IDX_SUBDIRS[name])):
            found = _read_idx_dir(directory)
            if found is not None:
                return found
    for npz in _NPZ_NAMES[name]:
        if (path / npz).is_file():
            return _read_npz(path / npz)
    if name == "cifar10":
        for directory in (path, path / "cifar-10-batches-py"):
            found = _read_cifar_dir(directory)
            if found is not None:
                return found
        for tarball in _CIFAR_TARBALLS:
            if (path / tarball).is_file():
                found = _read_cifar_tar(path / tarball)
                if found is not None:
                    return found
    return None


def _search_tfds(name: str):
    """``(arrays, None)`` if TFDS has the data prepared locally, else ``(None, why)``."""
    if importlib.util.find_spec("tensorflow_datasets") is None:
        return None, "tensorflow_datasets is not installed"
    import tensorflow_datasets as tfds

    data_dir = os.environ.get("TFDS_DATA_DIR") or str(Path("~/tensorflow_datasets").expanduser())
    try:
        train, test = tfds.load(
            name,
            split=["train", "test"],
            data_dir=data_dir,
            download=False,
            batch_size=-1,
            as_supervised=True,
        )
    except Exception as error:  # noqa: BLE001 - any failure means "not available here"
        text = str(error).strip()
        first_line = text.splitlines()[0] if text else type(error).__name__
        return None, f"not prepared in {data_dir} ({first_line})"
    (x_train, y_train), (x_test, y_test) = tfds.as_numpy(train), tfds.as_numpy(test)
    return (x_train, y_train, x_test, y_test, f"TFDS {name} in {data_dir}"), None


def holds_dataset(directory, name: str) -> bool:
    """Whether ``directory`` holds the files of data set ``name`` (checked by name, not
    read): what an explicit directory must hold for the loader to use it rather than
    fall back to the other places it looks in."""
    path = Path(directory).expanduser()
    if not path.is_dir():
        return False
    if name in _IDX_SUBDIRS:
        for candidate in (path, *(path / s for s in _IDX_SUBDIRS[name])):
            if all(_find_idx(candidate, stem) for stem in IDX_STEMS):
                return True
    if any((path / npz).is_file() for npz in _NPZ_NAMES[name]):
        return True
    if name == "cifar10":
        names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        for candidate in (path, path / "cifar-10-batches-py"):
            if all((candidate / n).is_file() for n in names):
                return True
        return any((path / tarball).is_file() for tarball in _CIFAR_TARBALLS)
    return False


def dataset_files(name: str) -> str:
    """The files data set ``name`` is read from (for messages)."""
    return _WHAT[name]


def _load_from_sources(name: str, data_dir=None, data_dir_name="data_dir") -> ArrayDataset:
    classes = {"mnist": MNIST_CLASSES, "fashion_mnist": FASHION_MNIST_CLASSES}.get(
        name, CIFAR10_CLASSES
    )
    places: list[tuple[str, Path]] = []
    if data_dir is not None:
        places.append((data_dir_name, Path(data_dir).expanduser()))
    if os.environ.get("LIPDP_DATA_DIR"):
        places.append(("$LIPDP_DATA_DIR", Path(os.environ["LIPDP_DATA_DIR"]).expanduser()))
    places += [("Keras cache", d) for d in keras_cache_dirs()]

    looked = []
    found = None
    for label, path in places:
        found = _search_path(path, name)
        if found is not None:
            break
        looked.append(f"{label} {path}: {_WHAT[name]}")
    if found is None:
        found, why = _search_tfds(name)
        if found is None:
            looked.append(f"TensorFlow Datasets: {why}")
    if found is None and name == "fashion_mnist":
        found = _read_idx_dir(DEBIAN_FASHION_MNIST) if DEBIAN_FASHION_MNIST.is_dir() else None
        if found is None:
            looked.append(f"Debian package dataset-fashion-mnist: {DEBIAN_FASHION_MNIST}")
    if found is None:
        how = _HOW[name]
        if data_dir_name != "data_dir":
            how = how.replace("data_dir=", data_dir_name)
        raise FileNotFoundError(
            f"Data set {name!r} not found locally. Looked in:\n  - "
            + "\n  - ".join(looked)
            + f"\n{how} Nothing is downloaded."
        )
    x_train, y_train, x_test, y_test, source = found
    return ArrayDataset(
        _images_to_unit(x_train, source),
        _labels(y_train),
        _images_to_unit(x_test, source),
        _labels(y_test),
        list(classes),
    )


# ----------------------------------------------------------------- tabular
def adbench_dirs(data_dir=None) -> list[Path]:
    """Directories searched by :func:`load_adbench_data`, in order."""
    dirs = [Path(d).expanduser() for d in (data_dir, os.environ.get("LIPDP_DATA_DIR")) if d]
    dirs.append(PACKAGED_DATA_DIR)
    return dirs


def load_adbench_data(name: str, data_dir=None) -> tuple[np.ndarray, np.ndarray]:
    """An ADBench-format ``.npz`` file (arrays ``x``, ``y``; ``y = 1`` marks an anomaly).

    ``name`` is a path to an ``.npz`` file, or a data set name such as ``"shuttle"``,
    looked for as ``<name>.npz``, ``adbench_<name>.npz`` or ADBench's numbered
    ``<k>_<name>.npz`` in ``data_dir``, ``$LIPDP_DATA_DIR`` and the data shipped with
    lipdp (:data:`PACKAGED_DATA_DIR`: ``shuttle``).

    Returns ``(x, y)``: ``x`` float32 of shape ``(n, d)``, ``y`` int64 of shape ``(n,)``.
    """
    path = Path(str(name)).expanduser()
    candidates = [path] if path.suffix == ".npz" else []
    dirs = adbench_dirs(data_dir)
    if not candidates:
        for directory in dirs:
            candidates += [directory / f"{name}.npz", directory / f"adbench_{name}.npz"]
            if directory.is_dir():
                candidates += sorted(directory.glob(f"[0-9]*_{name}.npz"))
    for candidate in candidates:
        if candidate.is_file():
            with np.load(candidate, allow_pickle=False) as data:
                if "x" not in data or "y" not in data:
                    raise ValueError(f"{candidate} is not in ADBench format (arrays x and y).")
                x, y = data["x"], data["y"]
            x = np.asarray(x, dtype="float32")
            if x.ndim != 2:
                raise ValueError(f"{candidate}: x must be a 2-D array, got shape {x.shape}.")
            y = _labels(y)
            if len(y) != len(x):
                raise ValueError(f"{candidate}: {len(x)} rows in x but {len(y)} labels in y.")
            return x, y
    looked = ", ".join(str(c) for c in candidates) if candidates else ", ".join(map(str, dirs))
    raise FileNotFoundError(
        f"ADBench data set {name!r} not found; looked for: {looked}. Put the ADBench .npz "
        "file (arrays x and y) in one of these directories, pass data_dir=, or set "
        "LIPDP_DATA_DIR. Nothing is downloaded."
    )


__all__ = [
    "CIFAR10_CLASSES",
    "DEBIAN_FASHION_MNIST",
    "FASHION_MNIST_CLASSES",
    "IDX_STEMS",
    "IMAGE_DATASETS",
    "MNIST_CLASSES",
    "PACKAGED_DATA_DIR",
    "ArrayDataset",
    "BREAST_CANCER_RANGES",
    "adbench_dirs",
    "canonical_name",
    "keras_cache_dirs",
    "load_adbench_data",
    "load_breast_cancer",
    "load_cifar10",
    "load_digits",
    "load_fashion_mnist",
    "load_images",
    "load_mnist",
    "read_idx",
]
