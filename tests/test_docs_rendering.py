"""Docstrings render as Markdown on the API pages (``docs/griffe_rst.py``, run by
mkdocstrings at ``make docs``; plain Python, tested here without MkDocs)."""

from __future__ import annotations

import importlib.util
import pkgutil
from pathlib import Path

import pytest

import lipdp

pytest.importorskip(
    "griffe", reason="the documentation tools (mkdocstrings' griffe) are on the main stack"
)

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("griffe_rst", ROOT / "docs" / "griffe_rst.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


griffe_rst = _load()


def test_a_code_block_directive_becomes_a_fenced_block():
    text = (
        "Intro:\n\n.. code-block:: python\n\n    model = f(\n        x)\n\n    y = 2\n\n"
        "After.\n\n  .. code-block::\n\n      a\n"
    )
    assert griffe_rst._code_blocks_to_fences(text) == (
        "Intro:\n\n```python\nmodel = f(\n    x)\n\ny = 2\n```\n\nAfter.\n\n  ```\n  a\n  ```\n"
    )


def test_no_docstring_of_lipdp_keeps_a_directive_markdown_shows_as_text():
    """Every ``.. code-block::`` of lipdp's modules is converted (none is left)."""
    sources = [
        Path(module.module_finder.path) / (module.name.rsplit(".", 1)[-1] + ".py")
        for module in pkgutil.walk_packages(lipdp.__path__, "lipdp.")
        if not module.ispkg
    ]
    with_directive = [p for p in sources if ".. code-block::" in p.read_text()]
    assert with_directive  # lipdp/privatize.py has one: the test is not empty
    for path in with_directive:
        converted = griffe_rst._code_blocks_to_fences(path.read_text())
        assert ".. code-block::" not in converted, path
