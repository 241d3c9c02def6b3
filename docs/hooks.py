"""MkDocs hooks: publish the tutorial notebooks of ``examples/`` that exist.

The notebooks live in ``examples/`` (outside ``docs/``), so that they can be run
from the repository as they are. At build time every ``examples/*.ipynb`` is

* added to the site as the page ``examples/<name>/`` (mkdocs-jupyter renders it,
  without executing it; the notebook itself is offered for download there);
* appended, in file-name order, to the ``Tutorials`` section of ``nav``;
* listed on ``tutorials/index.md`` in place of the ``<!-- tutorials -->`` marker.

Adding, renaming or removing a notebook therefore needs no change here or in
``mkdocs.yml``; a build with no notebook at all is still complete (and strict).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.tutorials")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SECTION = "Tutorials"
MARKER = "<!-- tutorials -->"


def _uri(path: Path) -> str:
    """Where a notebook appears in the site's file tree (and in ``nav``)."""
    return f"{EXAMPLES.name}/{path.name}"


def notebooks() -> list[Path]:
    return sorted(EXAMPLES.glob("*.ipynb")) if EXAMPLES.is_dir() else []


def notebook_title(path: Path) -> str:
    """The first level-1 Markdown heading of the notebook, else its file name."""
    try:
        cells = json.loads(path.read_text(encoding="utf-8")).get("cells", [])
    except (OSError, ValueError):
        cells = []
    for cell in cells:
        if cell.get("cell_type") != "markdown":
            continue
        source = cell.get("source", "")
        source = "".join(source) if isinstance(source, list) else source
        for line in source.splitlines():
            if line.startswith("# "):
                return line[2:].strip()
    return path.stem.replace("_", " ")


def on_config(config):
    section = None
    for entry in config.nav or []:
        if isinstance(entry, dict) and SECTION in entry:
            section = entry[SECTION]
    if section is None:
        log.warning("mkdocs.yml has no '%s' section in nav: notebooks are not listed.", SECTION)
        return config
    for path in notebooks():
        uri = _uri(path)
        if uri not in section:
            section.append(uri)
    return config


@event_priority(100)  # before mkdocs-jupyter turns .ipynb files into pages
def on_files(files, config):
    # A real File rooted at the repository (not File.generated): mkdocs-jupyter's
    # wrapper recomputes abs_src_path from src_dir and src_uri.
    for path in notebooks():
        files.append(
            File(
                _uri(path),
                src_dir=str(ROOT),
                dest_dir=config.site_dir,
                use_directory_urls=config.use_directory_urls,
            )
        )
    return files


def on_page_markdown(markdown, page, config, files):
    if MARKER not in markdown:
        return markdown
    found = notebooks()
    if found:
        listing = "\n".join(
            f"1. [{notebook_title(path)}](../{_uri(path)}) — `{_uri(path)}`" for path in found
        )
    else:
        listing = "*No notebook has been added to `examples/` yet.*"
    return markdown.replace(MARKER, listing)
