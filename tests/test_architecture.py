"""Arrows point one way: each low-level module imports only the modules it may build on.

Checked statically on the import statements of the source (no import side effects), so a
new upward import fails here with the module and the import named.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lipdp"

#: module (or package prefix) -> lipdp modules it may import (prefixes).
ALLOWED = {
    "lipdp.compat": (),
    "lipdp.config": (),
    "lipdp.metadata": ("lipdp.config",),
    "lipdp.validation": (),
    "lipdp.records": (),
    "lipdp.projections": ("lipdp.validation",),
    "lipdp.wavelets": ("lipdp.validation",),
    "lipdp.layers": (
        "lipdp.layers",
        "lipdp.validation",
        "lipdp.projections",
        "lipdp.records",
        "lipdp.wavelets",
    ),
    "lipdp.bounds": (),
    "lipdp.distribute": (),
    "lipdp.noise": ("lipdp.validation", "lipdp.distribute"),
    "lipdp.ledger": ("lipdp.accounting", "lipdp.layer_walk"),
    "lipdp.layer_walk": (),
    "lipdp.batch_independence": ("lipdp.layer_walk",),
    "lipdp.layer_support": ("lipdp.layer_walk",),
    "lipdp.accounting": ("lipdp.accounting", "lipdp.validation", "lipdp.metadata", "lipdp.config"),
    "lipdp.data": ("lipdp.data", "lipdp.validation", "lipdp.metadata"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _lipdp_imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            names = names[:1] if node.module != "lipdp" else names[1:]
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
