"""MkDocs hooks: tutorial notebooks, MathJax served by the site, links to the rules.

**Notebooks.**
The notebooks live in ``examples/`` (outside ``docs/``), so that they can be run
from the repository as they are. At build time every ``examples/*.ipynb`` is

* added to the site as the page ``examples/<name>/`` (mkdocs-jupyter renders it,
  without executing it; the notebook itself is offered for download there);
* appended, in file-name order, to the ``Tutorials`` section of ``nav``;
* listed on ``tutorials/index.md`` in place of the ``<!-- tutorials -->`` marker.

Adding, renaming or removing a notebook therefore needs no change here or in
``mkdocs.yml``; a build with no notebook at all is still complete (and strict).

**Math.** Formulas are written ``$...$`` / ``$$...$$`` (``pymdownx.arithmatex``,
generic mode) and typeset in the browser by MathJax 3, served by the site itself so
that it renders offline: the files are copied at build time from the pip package
``django-static-mathjax`` (MathJax 3.2.2, Apache-2.0; the docs extra installs it) to
``assets/mathjax/``, with MathJax's ``LICENSE``. Only what the ``tex-chtml`` component
loads is copied: the component, its CHTML fonts, the TeX extensions it autoloads, and
the menu and accessibility modules it loads on demand.

**Rule links.** Every citation of a soundness rule (``S1`` ... ``S13``) in a rendered
page, docstrings included, becomes a link to its definition on ``soundness.md``
(``docs/rule_links.py``).
"""

from __future__ import annotations

import importlib.util
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

SOUNDNESS = "soundness.md"
MATHJAX_DEST = "assets/mathjax"
#: What the ``tex-chtml`` component may load, relative to MathJax's ``es5/`` directory.
MATHJAX_PARTS = (
    "tex-chtml.js",
    "output/chtml/fonts/woff-v2",
    "input/tex/extensions",
    "ui",
    "a11y",
    "sre",
)


def _load_rule_links():
    spec = importlib.util.spec_from_file_location(
        "lipdp_docs_rule_links", Path(__file__).with_name("rule_links.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rule_links = _load_rule_links()


def mathjax_root() -> Path | None:
    """MathJax's distribution as installed by ``django-static-mathjax``, if it is."""
    spec = importlib.util.find_spec("mathjax")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))) / "static" / "mathjax"
    return root if (root / "es5" / "tex-chtml.js").is_file() else None


def mathjax_files() -> list[tuple[str, Path]]:
    """``(site path, source file)`` of every MathJax file the site serves."""
    root = mathjax_root()
    if root is None:
        return []
    es5 = root / "es5"
    found = [(f"{MATHJAX_DEST}/LICENSE", root / "LICENSE")]
    for part in MATHJAX_PARTS:
        path = es5 / part
        paths = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        found += [(f"{MATHJAX_DEST}/{p.relative_to(es5).as_posix()}", p) for p in paths]
    return found


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
    assets = mathjax_files()
    if not assets:
        log.warning(
            "MathJax not found (pip package django-static-mathjax, in the docs extra): "
            "formulas will not be typeset."
        )
    for uri, path in assets:
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def on_page_content(html, page, config, files):
    """Rule citations (``S1`` ... ``S13``) become links to their definitions."""
    target = files.get_file_from_path(SOUNDNESS)
    if target is None:
        return html
    base = "" if page.file.src_uri == SOUNDNESS else target.url_relative_to(page.file)
    return rule_links.link_rules(html, base)


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
