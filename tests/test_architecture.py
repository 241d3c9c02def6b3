"""Arrows point one way: each low-level module imports only the modules it may build on.

Checked statically on the import statements of the source (no import side effects), so a
new upward import fails here with the module and the import named.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lipdp"

#: module (or package prefix) -> lipdp modules it may import (prefixes). The first matching
#: prefix applies, so a module listed alone comes before its package.
ALLOWED = {
    # the foundation, below the accountants: imports no other part of lipdp
    "lipdp.foundation.compat": (),
    "lipdp.foundation.variables": ("lipdp.foundation.compat",),
    "lipdp.foundation.config": (),
    "lipdp.foundation.validation": (),
    "lipdp.foundation.layer_walk": (),
    "lipdp.foundation.tf_notices": (),
    "lipdp.foundation.native_logs": (),
    "lipdp.foundation.metadata": ("lipdp.foundation.config",),
    "lipdp.foundation": (),
    # what both families share, bottom first
    "lipdp.core.records": ("lipdp.foundation.compat",),
    "lipdp.core.distribute": ("lipdp.foundation.compat",),
    "lipdp.core.noise": ("lipdp.foundation.validation", "lipdp.core.distribute"),
    "lipdp.core.coupling": ("lipdp.foundation.layer_walk", "lipdp.foundation.compat"),
    "lipdp.core.coupling_fix": (
        "lipdp.core.coupling",
        "lipdp.foundation.layer_walk",
        "lipdp.foundation.compat",
    ),
    "lipdp.core.batch_independence": (
        "lipdp.core.coupling",
        "lipdp.core.coupling_fix",
        "lipdp.foundation.layer_walk",
        "lipdp.foundation.compat",
        "lipdp.foundation.variables",
    ),
    "lipdp.accounting": (
        "lipdp.accounting",
        "lipdp.foundation.validation",
        "lipdp.foundation.metadata",
        "lipdp.foundation.config",
    ),
    "lipdp.data": ("lipdp.data", "lipdp.foundation.validation", "lipdp.foundation.metadata"),
    "lipdp.core.ledger": (
        "lipdp.accounting",
        "lipdp.foundation.layer_walk",
        "lipdp.foundation.variables",
    ),
    # the privacy surface of every backend's model (TensorFlow's PrivateModel, the JAX
    # DPSGD_JaxModel): below both families, above the foundation it reads
    "lipdp.core.private_base": (
        "lipdp.accounting",
        "lipdp.foundation.compat",
        "lipdp.foundation.layer_walk",
        "lipdp.core.ledger",
        "lipdp.foundation.metadata",
        "lipdp.core.noise",
        "lipdp.core.parameters",
    ),
    # the JAX trainer of both families (keys, ledger words, row isolation, Poisson batches,
    # the step skeleton): the shared base only, never a family
    "lipdp.core.jax": ("lipdp.core", "lipdp.foundation", "lipdp.accounting"),
    # (and the Poisson sampler of lipdp.data, below it: fit draws the batches of arrays)
    "lipdp.core": ("lipdp.foundation", "lipdp.core", "lipdp.accounting", "lipdp.data.sampling"),
    # the clipless family's JAX trainer (lipdp.clipless.jax.trainer): the family's layers,
    # losses and bounds (written once for every backend) and the JAX step skeleton; never
    # the TensorFlow step (lipdp.clipless.model, lipdp.core.private_model)
    "lipdp.clipless.jax": (
        "lipdp.clipless.jax",
        "lipdp.clipless.layers",
        "lipdp.clipless.losses",
        "lipdp.clipless.bounds",
        "lipdp.clipless.projections",
        "lipdp.clipless.dynamic",
        "lipdp.foundation",
        "lipdp.core.jax",
        "lipdp.core.noise",
        "lipdp.core.private_base",
        "lipdp.accounting",
    ),
    # the two families build on the shared base, never on each other
    "lipdp.clipless": ("lipdp.clipless", "lipdp.foundation", "lipdp.core", "lipdp.accounting"),
    # the clipped family's JAX step: the shared base, the clipping rule, the layer checks,
    # the ghost-rule registry with its rules and the row scaling; never the TensorFlow
    # step (lipdp.clipped.model, lipdp.clipped.per_example.engine)
    "lipdp.clipped.jax": (
        "lipdp.clipped.jax",
        "lipdp.clipped.clipping",
        "lipdp.clipped.layer_support",
        "lipdp.clipped.per_example.registry",
        "lipdp.clipped.per_example.scale",
        "lipdp.clipped.per_example.dense",
        "lipdp.clipped.per_example.convolution",
        "lipdp.foundation",
        "lipdp.core",
        "lipdp.accounting",
    ),
    "lipdp.clipped": ("lipdp.clipped", "lipdp.foundation", "lipdp.core", "lipdp.accounting"),
    # above both families
    "lipdp.evaluation": (
        "lipdp.evaluation",
        "lipdp.foundation",
        "lipdp.core",
        "lipdp.accounting",
        "lipdp.clipless",
        "lipdp.data",
    ),
    # make_private; lipdp.entry, its former path, re-exports it
    "lipdp.privatize": (
        "lipdp.foundation",
        "lipdp.core",
        "lipdp.accounting",
        "lipdp.data",
        "lipdp.clipless",
        "lipdp.clipped",
    ),
    "lipdp.entry": ("lipdp.privatize",),
    # a run's configuration, below the model it builds and the run that trains it (the
    # command line reads the first two without TensorFlow)
    "lipdp.recipes.defaults": (),
    "lipdp.recipes.method_settings": ("lipdp.recipes.defaults",),
    "lipdp.recipes.recipe_config": (
        "lipdp.recipes.defaults",
        "lipdp.recipes.method_settings",
        "lipdp.foundation.config",
        "lipdp.foundation.validation",
    ),
    "lipdp.recipes.model_factory": (
        "lipdp.recipes.defaults",
        "lipdp.recipes.recipe_config",
        "lipdp.recipes.zoo",
        "lipdp.foundation",
        "lipdp.core",
        "lipdp.clipless",
        "lipdp.clipped",
    ),
    "lipdp.recipes": (
        "lipdp.recipes",
        "lipdp.foundation",
        "lipdp.core",
        "lipdp.accounting",
        "lipdp.data",
        "lipdp.clipless",
        "lipdp.clipped",
        "lipdp.evaluation",
    ),
    # the command: arguments -> recipe -> printing. It builds, trains and measures
    # nothing itself (the recipes do), so it reads only the recipes and the shared base
    # (the privacy report, the distribution strategy of --mirrored), and TensorFlow's
    # native start-up lines kept off its terminal (lipdp.foundation.native_logs).
    "lipdp.cli": ("lipdp.cli", "lipdp.recipes", "lipdp.core", "lipdp.foundation.native_logs"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _lipdp_imports(path: Path):
    """Every lipdp module ``path`` imports, at module level or inside a function:
    ``from lipdp.core import noise`` imports ``lipdp.core.noise`` (not the package)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [n for n in submodules if _is_module(n)] or [node.module]
            if len(names) < len(submodules) and names != [node.module]:
                names.append(node.module)  # names defined in the package's __init__ too
        else:
            continue
        yield from (n for n in names if n == "lipdp" or n.startswith("lipdp."))


def _rule(module: str):
    for prefix, allowed in ALLOWED.items():
        if module == prefix or module.startswith(prefix + "."):
            return allowed
    return None


CHECKED = sorted(
    (path for path in PACKAGE.rglob("*.py") if _rule(_module_name(path)) is not None),
    key=str,
)


def test_every_rule_covers_a_module():
    covered = {prefix for prefix in ALLOWED for p in CHECKED if _module_name(p).startswith(prefix)}
    assert covered == set(ALLOWED)


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: _module_name(p))
def test_imports_point_down(path):
    module = _module_name(path)
    allowed = _rule(module)
    upward = [
        name
        for name in _lipdp_imports(path)
        if not any(name == a or name.startswith(a + ".") for a in allowed)
    ]
    assert not upward, f"{module} imports {upward}; it may import only {allowed or 'nothing'}"


def test_the_recipes_never_import_the_cli():
    """The arrow between the command and the recipes points one way: a benchmark, a test
    or a tutorial reproduces ``lipdp train`` from the recipes, with no argparse."""
    recipes = sorted((PACKAGE / "recipes").rglob("*.py"), key=str)
    assert recipes
    for path in recipes:
        cli = [n for n in _lipdp_imports(path) if n == "lipdp.cli" or n.startswith("lipdp.cli.")]
        assert not cli, f"{_module_name(path)} imports {cli}"
    assert "lipdp.cli" not in ALLOWED["lipdp.recipes"]


def _import_graph() -> dict:
    every = sorted(PACKAGE.rglob("*.py"), key=str)
    graph = {_module_name(p): set() for p in every}
    for path in every:
        module = _module_name(path)
        for name in _lipdp_imports(path):
            while name not in graph and "." in name:
                name = name.rpartition(".")[0]
            if name in graph and name != module and not module.startswith(name + "."):
                graph[module].add(name)
    return graph


def test_no_import_circle():
    """No module reaches itself through imports, counting the imports inside functions
    (which hide a circle from Python but not from a reader). A package's ``__init__``
    importing its own modules is not a circle."""
    graph = _import_graph()
    state, stack = {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for name in sorted(graph[module]):
            if state.get(name) == "open":
                circle = stack[stack.index(name) :] + [name]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if name not in state:
                visit(name)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)


#: The modules the JAX backend imports: no TensorFlow at module level (a function of
#: theirs that the TensorFlow models call may import it).
JAX_PATH = [
    "lipdp.core.jax",
    "lipdp.core.private_base",
    "lipdp.clipped.jax",
    "lipdp.clipless.jax",
    "lipdp.clipped.clipping",
    "lipdp.clipped.layer_support",
    "lipdp.core.coupling",
    "lipdp.core.coupling_fix",
    "lipdp.foundation.layer_walk",
    "lipdp.core.noise",
    "lipdp.core.ledger",
    "lipdp.core.callbacks",
    "lipdp.core.parameters",
    "lipdp.core.report",
    "lipdp.privatize",
    "lipdp.entry",
    "lipdp.accounting",
    "lipdp.foundation.metadata",
    "lipdp.foundation.compat",
    # the clipless family's modules written with compat.array_ops() (issue 38 item 5)
    "lipdp.clipless.jax",
    "lipdp.clipless.projections",
    "lipdp.clipless.losses",
    "lipdp.clipless.layers.base",
    "lipdp.clipless.layers.inputs",
    "lipdp.clipless.layers.dense",
    "lipdp.clipless.layers.constrained",
    "lipdp.clipless.layers.clipping",
]


def _module_level_imports(path: Path):
    """The modules ``path`` imports outside functions."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_the_jax_backend_s_modules_import_no_tensorflow():
    checked = [p for p in PACKAGE.rglob("*.py") if _rule(_module_name(p)) is not None]
    on_path = [p for p in checked if any(_module_name(p).startswith(m) for m in JAX_PATH)]
    assert len(on_path) > 10
    for path in on_path:
        tf = [n for n in _module_level_imports(path) if n.split(".")[0] == "tensorflow"]
        assert not tf, f"{_module_name(path)} imports {tf} at module level"


#: The bottom of the package, layer by layer: each imports only itself and what lies below
#: (no arrow back up between packages, not only between modules: issue 38).
PACKAGE_LAYERS = ["lipdp.foundation", "lipdp.accounting", "lipdp.core"]

#: The former paths of the foundation's modules: each a module that *is* its new one.
FORMER_PATHS = [
    f"lipdp.core.{name}"
    for name in ("config", "validation", "metadata", "compat", "variables", "layer_walk")
]


def _in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize("level", range(len(PACKAGE_LAYERS)), ids=PACKAGE_LAYERS)
def test_the_bottom_packages_import_only_downwards(level):
    package, above = PACKAGE_LAYERS[level], PACKAGE_LAYERS[level + 1 :]
    paths = sorted((PACKAGE / package.split(".")[1]).rglob("*.py"), key=str)
    assert paths
    for path in paths:
        if _module_name(path) in FORMER_PATHS:
            continue
        upward = [n for n in _lipdp_imports(path) if any(_in_package(n, a) for a in above)]
        assert not upward, f"{_module_name(path)} imports {upward} from a package above it"


def test_no_module_imports_a_former_path_and_former_paths_still_import():
    import importlib

    for path in sorted(PACKAGE.rglob("*.py"), key=str):
        if _module_name(path) in FORMER_PATHS:
            continue
        former = [n for n in _lipdp_imports(path) if n in FORMER_PATHS]
        assert not former, f"{_module_name(path)} imports {former}: use lipdp.foundation"
    for name in FORMER_PATHS:
        moved = importlib.import_module(name.replace("lipdp.core.", "lipdp.foundation."))
        assert importlib.import_module(name) is moved
