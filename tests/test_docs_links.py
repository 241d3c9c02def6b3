"""The documentation site links every rule citation (S1 ... S13) to its definition.

``docs/rule_links.py`` rewrites rendered pages (``docs/hooks.py`` calls it for every
page, API pages from docstrings included); it is plain Python, tested here without
MkDocs.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _load():
    spec = importlib.util.spec_from_file_location("rule_links", DOCS / "rule_links.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rule_links = _load()
BASE = "../soundness/"


def link(number: int, base: str = BASE) -> str:
    return f'<a href="{base}#s{number}">S{number}</a>'


def test_plain_citations_become_links():
    html = "<p>Checked by rule S2 and by S9).</p>"
    assert (
        rule_links.link_rules(html, BASE) == f"<p>Checked by rule {link(2)} and by {link(9)}).</p>"
    )


def test_s10_to_s13_are_not_read_as_s1():
    html = "<p>rules S10, S1, S13 and S11.</p>"
    assert rule_links.link_rules(html, BASE) == (
        f"<p>rules {link(10)}, {link(1)}, {link(13)} and {link(11)}.</p>"
    )


def test_ranges_and_punctuation():
    html = "<li>(S5) S1–S7; S12.</li>"
    assert rule_links.link_rules(html, BASE) == (
        f"<li>({link(5)}) {link(1)}–{link(7)}; {link(12)}.</li>"
    )


@pytest.mark.parametrize("text", ["S14", "S0", "PS2", "S2a", "S2_x", "x_S2", "S20", "s2"])
def test_only_word_bounded_rule_numbers(text):
    html = f"<p>{text}</p>"
    assert rule_links.link_rules(html, BASE) == html


@pytest.mark.parametrize(
    "html",
    [
        "<p>see <code>S2</code></p>",
        '<div class="highlight"><pre><span></span><code>x = S2  # S9\n</code></pre></div>',
        '<p><a href="../soundness/#s2">rule S2</a></p>',
        '<p><a href="x.md"><em>S3</em> here</a></p>',
        '<h2 id="s2-again">Rule S2</h2>',
        '<p><span class="arithmatex">\\(S_2 + S2\\)</span></p>',
        "<script>var S2 = 1;</script>",
    ],
)
def test_code_links_headings_math_are_left_alone(html):
    assert rule_links.link_rules(html, BASE) == html


def test_text_after_a_skipped_element_is_linked_again():
    html = "<p><code>S2</code> and S2 <a href='#'>S3</a> S3</p>"
    assert rule_links.link_rules(html, BASE) == (
        f"<p><code>S2</code> and {link(2)} <a href='#'>S3</a> {link(3)}</p>"
    )


def test_definition_is_not_linked_to_itself():
    html = (
        '<p><strong id="s4">S4 — projections land.</strong> Unlike S3, see S4.</p>'
        '<p><strong id="s10">S10 — <em>the state</em> (S10).</strong> S1</p>'
    )
    assert rule_links.link_rules(html, "") == (
        f'<p><strong id="s4">S4 — projections land.</strong> Unlike {link(3, "")}, '
        f"see {link(4, '')}.</p>"
        f'<p><strong id="s10">S10 — <em>the state</em> (S10).</strong> {link(1, "")}</p>'
    )


def test_void_elements_and_comments_do_not_open_a_skipped_region():
    html = '<p>a<br>S2<img src="S3.png"/> <!-- S4 --> S5</p>'
    assert rule_links.link_rules(html, BASE) == (
        f'<p>a<br>{link(2)}<img src="S3.png"/> <!-- S4 --> {link(5)}</p>'
    )


def test_every_cited_rule_is_defined_with_its_anchor():
    """soundness.md gives each rule S1 ... S13 its anchor; no page or docstring cites
    a rule it does not define."""
    soundness = (DOCS / "soundness.md").read_text(encoding="utf-8")
    defined = {int(n) for n in re.findall(r"^\*\*S(\d+) — [^*]+\*\*\{#s\1\}", soundness, re.M)}
    assert defined == set(range(1, rule_links.LAST_RULE + 1))
    cited = set()
    sources = list(DOCS.glob("**/*.md")) + list((ROOT / "lipdp").glob("**/*.py"))
    for path in sources:
        cited |= {int(n) for n in re.findall(r"(?<![\w])S(\d+)(?![\w])", path.read_text("utf-8"))}
    assert cited <= defined, f"rules cited but not defined: {sorted(cited - defined)}"


# --- Citations of benchmarks/README.md sections --------------------------------------
#
# Pages and docstrings cite a benchmark section by its name, in quotes after the file
# name (`benchmarks/README.md`, "Large logical batches") or in brackets in the tables of
# docs/which_method.md; the sections are not linked (the site does not publish
# benchmarks/README.md), so this test is what keeps the names in step with the headings.

BENCHMARKS_README = ROOT / "benchmarks" / "README.md"
_QUOTED = re.compile(r"benchmarks/README\.md`{0,2}\)?[,\s(]*(?:section\s+)?\"([^\"]+)\"")
_BRACKETED = re.compile(r"\[([^\]\[]+)\](?!\()")


def _headings() -> list[str]:
    text = BENCHMARKS_README.read_text("utf-8")
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return [m.strip().replace("`", "") for m in re.findall(r"^#{2,6} (.+)$", text, re.M)]


def _flat(text: str) -> str:
    """One line: comment markers and indentation of wrapped lines removed."""
    return re.sub(r"\s*\n\s*(?:#:?\s*)?", " ", text)


def _cited_sections() -> list[tuple[str, str]]:
    sources = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *DOCS.glob("**/*.md")]
    sources += [*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "lipdp").glob("**/*.py")]
    cited = []
    for path in sources:
        text = _flat(path.read_text("utf-8"))
        cited += [(path.name, name) for name in _QUOTED.findall(text)]
    which = (DOCS / "which_method.md").read_text("utf-8")
    for cell in _BRACKETED.findall(which):
        cited += [("which_method.md", name.strip()) for name in cell.split(";")]
    return cited


def test_the_citation_patterns_find_the_known_citations():
    cited = {name for _, name in _cited_sections()}
    assert {
        "Large logical batches",
        "Calibration of clipped DP-SGD",
        "The default commands",
    } <= cited
    assert len(cited) >= 15


def test_every_cited_benchmark_section_exists():
    headings = [h.lower() for h in _headings()]
    missing = sorted(
        {
            f"{where}: {name!r}"
            for where, name in _cited_sections()
            if not any(h.startswith(name.lower().replace("`", "")) for h in headings)
        }
    )
    assert not missing, f"benchmark sections cited but not found in benchmarks/README.md: {missing}"


def test_benchmark_headings_carry_no_issue_number():
    numbered = [h for h in _headings() if re.search(r"\bissues? ?#?\d", h, re.I)]
    assert not numbered, f"headings named after issues (name them by topic): {numbered}"
