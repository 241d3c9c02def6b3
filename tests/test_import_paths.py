"""The import paths of before the ``lipdp.data`` package still work, and name the same objects."""

import ast
import importlib
from pathlib import Path

import lipdp.data
import lipdp.data.images
import lipdp.data.input_bounds
import lipdp.data.sampling
import lipdp.data.sources
import lipdp.data.tabular
import lipdp.datasets
import lipdp.metadata
import lipdp.pipeline

#: Where each name of ``lipdp.pipeline`` lives now.
PIPELINE_HOMES = {
    "AUGMENTATIONS": lipdp.data.images,
    "CIFAR10_PUBLISHED_MEAN": lipdp.data.images,
    "CIFAR10_PUBLISHED_STD": lipdp.data.images,
    "COLORSPACES": lipdp.data.images,
    "IMAGENET_MEAN": lipdp.data.images,
    "IMAGENET_STD": lipdp.data.images,
    "augment_images": lipdp.data.images,
    "colorspace_max_norm": lipdp.data.images,
    "colorspace_output_shape": lipdp.data.images,
    "convert_colorspace": lipdp.data.images,
    "load_and_prepare_data": lipdp.data.images,
    "load_and_prepare_images_data": lipdp.data.images,
    "ROUNDING_MARGIN": lipdp.data.input_bounds,
    "bound_clip_value": lipdp.data.input_bounds,
    "bound_normalize": lipdp.data.input_bounds,
    "distributed_poisson_batches": lipdp.data.sampling,
    "poisson_batches": lipdp.data.sampling,
    "poisson_indices": lipdp.data.sampling,
    "TABULAR_SCALINGS": lipdp.data.tabular,
    "prepare_tabular_data": lipdp.data.tabular,
    "load_adbench_data": lipdp.data.sources,
    "DatasetMetadata": lipdp.metadata,
    "SAMPLING_MODES": lipdp.metadata,
    "default_delta_value": lipdp.metadata,
}

#: The public names ``lipdp.datasets`` defined before it became a re-export, and the
#: breast-cancer loader added since (issue 12).
DATASETS_NAMES = [
    "BREAST_CANCER_RANGES",
    "load_breast_cancer",
    "CIFAR10_CLASSES",
    "DEBIAN_FASHION_MNIST",
    "FASHION_MNIST_CLASSES",
    "IDX_STEMS",
    "IMAGE_DATASETS",
    "MNIST_CLASSES",
    "PACKAGED_DATA_DIR",
    "ArrayDataset",
    "adbench_dirs",
    "canonical_name",
    "keras_cache_dirs",
    "load_adbench_data",
    "load_cifar10",
    "load_digits",
    "load_fashion_mnist",
    "load_images",
    "load_mnist",
    "read_idx",
]


def test_old_pipeline_imports():
    from lipdp.pipeline import (  # noqa: F401  (the import itself is the test)
        COLORSPACES,
        SAMPLING_MODES,
        DatasetMetadata,
        bound_clip_value,
        bound_normalize,
        colorspace_max_norm,
        convert_colorspace,
        default_delta_value,
        load_adbench_data,
        load_and_prepare_data,
        load_and_prepare_images_data,
        poisson_batches,
        prepare_tabular_data,
    )

    assert DatasetMetadata is lipdp.metadata.DatasetMetadata
    assert load_and_prepare_data is load_and_prepare_images_data


def test_every_pipeline_name_is_the_moved_object():
    for name, home in PIPELINE_HOMES.items():
        assert getattr(lipdp.pipeline, name) is getattr(home, name), name
    assert sorted(lipdp.pipeline.__all__) == sorted(PIPELINE_HOMES)


def test_old_datasets_imports():
    from lipdp.datasets import load_digits, load_fashion_mnist  # noqa: F401

    for name in DATASETS_NAMES:
        assert getattr(lipdp.datasets, name) is getattr(lipdp.data.sources, name), name
    assert sorted(lipdp.datasets.__all__) == sorted(DATASETS_NAMES)


def test_data_package_reexports_its_modules():
    modules = ["sources", "input_bounds", "sampling", "images", "tabular"]
    exported = set()
    for module in modules:
        module = importlib.import_module(f"lipdp.data.{module}")
        for name in module.__all__:
            assert getattr(lipdp.data, name) is getattr(module, name), name
        exported |= set(module.__all__)
    assert set(lipdp.data.__all__) == exported


def _imported_modules(path):
    """Every module a source file imports (``from lipdp import x`` counts as ``lipdp.x``)."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def test_data_modules_import_no_model_code():
    """Arrows point one way: the data modules never import the model, layers or accountant."""
    forbidden = ("model", "accounting", "layers", "pipeline", "datasets")
    files = sorted(Path(lipdp.data.__path__[0]).glob("*.py"))
    assert len(files) == 6
    for path in files:
        lipdp_imports = {m for m in _imported_modules(path) if m.startswith("lipdp.")}
        for module in lipdp_imports:
            assert module.split(".")[1] not in forbidden, (path.name, module)
