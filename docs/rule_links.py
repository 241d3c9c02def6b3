"""Link every citation of a soundness rule (``S1`` ... ``S13``) to its definition.

The rules are defined on ``soundness.md``, each in a bold paragraph carrying the anchor
``#s1`` ... ``#s13``; pages and docstrings cite them as plain text ("rule S2", "S9)",
"rules S5, S9, S10"). :func:`link_rules` rewrites the HTML of a rendered page (so that
docstrings rendered by mkdocstrings need no edit): each word-bounded ``S<n>`` with
``1 <= n <= 13`` in a text node becomes ``<a href="<base>#s<n>">S<n></a>``, except

* inside ``code``, ``pre``, ``a`` (already a link), headings, ``script``, ``style``,
  ``textarea`` and typeset math (class ``arithmatex``);
* inside the definition itself (an element whose ``id`` is ``s<n>``).

Pure Python, no MkDocs import: ``docs/hooks.py`` calls it, ``tests/test_docs_links.py``
tests it.
"""

from __future__ import annotations

import re

#: Highest rule number defined on soundness.md.
LAST_RULE = 13

_TAG = re.compile(r"<!--.*?-->|<[^>]*>", re.DOTALL)
_TAG_NAME = re.compile(r"</?\s*([A-Za-z][A-Za-z0-9-]*)")
_ID = re.compile(r"""(?<![\w-])id\s*=\s*["']?s(\d+)["'\s>]""")
_CLASS_MATH = re.compile(r"""\bclass\s*=\s*["'][^"']*\barithmatex\b""")
# S10..S13 before S1..S9; no letter, digit or underscore on either side ("S14", "PS2",
# "S2a" are not citations); a following "-" or "." is fine ("S1–S7", "S9.").
_RULE = re.compile(r"(?<![\w])S(1[0-3]|[1-9])(?![\w])")

_SKIP = {"a", "code", "pre", "script", "style", "textarea", "h1", "h2", "h3", "h4", "h5", "h6"}
_VOID = {
    "area",
    "base",
    "br",
    "col",
    "embed",
    "hr",
    "img",
    "input",
    "link",
    "meta",
    "param",
    "source",
    "track",
    "wbr",
}


def rule_anchor(number: int) -> str:
    """The anchor of rule ``S<number>`` on soundness.md."""
    return f"s{number}"


def _link_text(text: str, base: str) -> str:
    return _RULE.sub(
        lambda m: f'<a href="{base}#{rule_anchor(int(m.group(1)))}">{m.group(0)}</a>', text
    )


def link_rules(html: str, base: str) -> str:
    """``html`` with every rule citation in a text node linked to ``base#s<n>``.

    ``base`` is the URL of soundness.md relative to the page (``""`` on soundness.md
    itself, which gives ``#s4``).
    """
    out: list[str] = []
    skipping: list[str] = []  # open elements, from the first skipped one inward
    pos = 0
    for match in _TAG.finditer(html):
        text = html[pos : match.start()]
        out.append(text if skipping else _link_text(text, base))
        tag = match.group(0)
        out.append(tag)
        pos = match.end()
        if tag.startswith("<!--"):
            continue
        name_match = _TAG_NAME.match(tag)
        if not name_match:
            continue
        name = name_match.group(1).lower()
        if tag.startswith("</"):
            if skipping and skipping[-1] == name:
                skipping.pop()
            continue
        if name in _VOID or tag.endswith("/>"):
            continue
        if skipping:
            skipping.append(name)
        elif name in _SKIP or _CLASS_MATH.search(tag):
            skipping.append(name)
        else:
            defined = _ID.search(tag)
            if defined and 1 <= int(defined.group(1)) <= LAST_RULE:
                skipping.append(name)
    text = html[pos:]
    out.append(text if skipping else _link_text(text, base))
    return "".join(out)
