"""The original package's import paths (``deel.lipdp.layers``, ``.model``, ``.losses``,
``.dynamic``, ``.pipeline``, ``.sensitivity``, ``.utils``) still work, name the same objects
as the modules that define them, and hold nothing else."""

import ast
import importlib
from pathlib import Path

import pytest

import lipdp.data
import lipdp.data.images
import lipdp.data.input_bounds
import lipdp.data.sampling
import lipdp.data.sources
import lipdp.data.tabular
import lipdp.foundation.metadata
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
    "DatasetMetadata": lipdp.foundation.metadata,
    "SAMPLING_MODES": lipdp.foundation.metadata,
    "default_delta_value": lipdp.foundation.metadata,
}


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

    assert DatasetMetadata is lipdp.foundation.metadata.DatasetMetadata
    assert load_and_prepare_data is load_and_prepare_images_data


def test_every_pipeline_name_is_the_moved_object():
    for name, home in PIPELINE_HOMES.items():
        assert getattr(lipdp.pipeline, name) is getattr(home, name), name
    assert sorted(lipdp.pipeline.__all__) == sorted(PIPELINE_HOMES)


def test_data_package_reexports_its_modules():
    modules = ["sources", "input_bounds", "sampling", "images", "tabular"]
    exported = set()
    for module in modules:
        module = importlib.import_module(f"lipdp.data.{module}")
        for name in module.__all__:
            assert getattr(lipdp.data, name) is getattr(module, name), name
        exported |= set(module.__all__)
    assert set(lipdp.data.__all__) == exported


#: Original module -> (the module defining its names, names it re-exports from elsewhere).
ORIGINAL_PATHS = {
    "lipdp.layers": ("lipdp.clipless.layers", {}),
    "lipdp.losses": ("lipdp.clipless.losses", {}),
    "lipdp.dynamic": ("lipdp.clipless.dynamic", {}),
    "lipdp.model": (
        "lipdp.clipless.model",
        {"DP_Accountant": "lipdp.core.callbacks", "get_eps_delta": "lipdp.accounting.budget"},
    ),
    "lipdp.sensitivity": ("lipdp.accounting.budget", {}),
}


@pytest.mark.parametrize("original", sorted(ORIGINAL_PATHS))
def test_original_paths_name_the_defining_modules_objects(original):
    home, elsewhere = ORIGINAL_PATHS[original]
    module, defining = importlib.import_module(original), importlib.import_module(home)
    assert module.__all__
    for name in module.__all__:
        source = importlib.import_module(elsewhere[name]) if name in elsewhere else defining
        assert getattr(module, name) is getattr(source, name), (original, name)


THIN = ["layers", "losses", "dynamic", "model", "pipeline", "sensitivity", "utils"]

#: Former paths of lipdp's own modules -> the module that holds their names now.
FORMER = {"entry": "lipdp.privatize"}


@pytest.mark.parametrize("name", sorted(FORMER))
def test_former_paths_name_the_same_objects(name):
    module, home = importlib.import_module(f"lipdp.{name}"), importlib.import_module(FORMER[name])
    assert module.__all__ == home.__all__
    for exported in home.__all__:
        assert getattr(module, exported) is getattr(home, exported), (name, exported)


@pytest.mark.parametrize("name", THIN + sorted(FORMER))
def test_original_paths_are_thin_re_exports(name):
    """Only a docstring, imports and ``__all__``: no code lives at the top of the package."""
    tree = ast.parse((Path(lipdp.__path__[0]) / f"{name}.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        targets = getattr(node, "targets", [])
        assert isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in targets] == [
            "__all__"
        ], f"lipdp/{name}.py holds more than re-exports: {ast.dump(node)[:80]}"


#: The sub-packages of the layout (DESIGN.md section 5), the command's included.
PACKAGES = [
    "accounting",
    "cli",
    "clipless",
    "clipped",
    "core",
    "data",
    "evaluation",
    "foundation",
    "recipes",
]


def test_the_top_of_the_package_is_the_entry_point_and_the_original_paths():
    """At the top: the package, ``make_private``'s module (and its former path) and the
    original paths; all else lives in the layout's sub-packages (the ``lipdp`` command in
    ``lipdp/cli/``)."""
    root = Path(lipdp.__path__[0])
    top = sorted(p.stem for p in root.glob("*.py"))
    assert top == sorted(["__init__", "privatize", *FORMER, *THIN])
    assert sorted(p.parent.name for p in root.glob("*/__init__.py")) == PACKAGES


def test_the_console_script_is_the_cli_package_s_main():
    """``lipdp = lipdp.cli:main`` (setup.cfg) and ``python -m lipdp.cli`` name the same
    function."""
    import configparser

    import lipdp.cli
    import lipdp.cli.commands

    config = configparser.ConfigParser()
    config.read(Path(lipdp.__path__[0]).parent / "setup.cfg", encoding="utf-8")
    scripts = config["options.entry_points"]["console_scripts"].split("\n")
    assert "lipdp = lipdp.cli:main" in [line.strip() for line in scripts]
    assert lipdp.cli.main is lipdp.cli.commands.main
    main_module = (Path(lipdp.cli.__path__[0]) / "__main__.py").read_text(encoding="utf-8")
    assert "from lipdp.cli import main" in main_module
