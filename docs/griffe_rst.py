"""Griffe extension: render the reStructuredText markup of lipdp's docstrings.

lipdp's docstrings are Google-style (``Args:``, ``Returns:``, ...) but use Sphinx
roles (``:class:`~lipdp.x.Y```, ``:func:``, ``:mod:``, ``:math:``) and, in a few
places, reST constructs that Markdown reads differently. mkdocstrings renders
docstrings as Markdown, so this extension rewrites them once the package is
loaded (the modules themselves are not touched):

* cross-reference roles (``:class:``, ``:func:``, ``:meth:``, ``:mod:``, ``:data:``,
  ``:attr:``, ``:exc:``, ``:obj:``) become *optional* autorefs: a link when the
  target is rendered somewhere in the site, plain code otherwise (never a
  warning). Relative names are resolved in the scope of the documented object;
  a leading ``~`` shows the last component only, as in Sphinx;
* ``:math:`x``` and ``.. math:: x`` become inline and display formulas,
  ``\\(x\\)`` and ``$$x$$`` (``pymdownx.arithmatex``; MathJax is served by the site
  itself, see ``docs/hooks.py``);
* ``.. code-block:: python`` directives become fenced code blocks (Markdown would
  show the directive as text and the code as an indented paragraph);
* reST simple tables (rows framed by ``====  ====`` lines) become Markdown
  tables;
* an ``Args:`` entry documenting several parameters at once (``x, y: ...``, a
  numpydoc habit the Google parser does not know) becomes one entry per
  parameter, each with the shared description.

Registered in ``mkdocs.yml`` under the python handler's ``extensions``.
"""

from __future__ import annotations

import html
import re

import griffe

_ROLE = re.compile(r":(?:py:)?(class|func|meth|mod|data|attr|exc|obj):`(~?)([^`<>]+)`")
_MATH_ROLE = re.compile(r":math:`([^`]+)`")
_MATH_DIRECTIVE = re.compile(r"^([ \t]*)\.\. math::[ \t]*(\S.*?)[ \t]*$", re.MULTILINE)
_CODE_BLOCK = re.compile(r"^([ \t]*)\.\. code-block::[ \t]*(\w*)[ \t]*$")
_TABLE_BORDER = re.compile(r"^[ \t]*=+(?: +=+)+[ \t]*$")
_PARAM_SECTION = re.compile(
    r"^([ \t]*)(?:Args|Arguments|Params|Parameters|Keyword Args|Keyword Arguments"
    r"|Other Parameters):[ \t]*$"
)
_GROUPED_ENTRY = re.compile(r"^([ \t]+)(\*{0,2}\w+(?:[ \t]*,[ \t]*\*{0,2}\w+)+)[ \t]*:(.*)$")


def _resolve(obj: griffe.Object, name: str, loader: griffe.GriffeLoader) -> str:
    """Full path of ``name`` as seen from ``obj`` (best effort; ``name`` on failure)."""
    head, _, tail = name.partition(".")
    candidates = []
    scope = obj
    while scope is not None:
        try:
            candidates.append(scope.resolve(head) + ("." + tail if tail else ""))
            break
        except Exception:  # noqa: BLE001 - NameResolutionError and alias errors
            scope = scope.parent
    candidates.append(name)
    for path in candidates:
        try:
            target = loader.modules_collection.get_member(path)
        except Exception:  # noqa: BLE001 - not a lipdp object (or not loaded)
            continue
        try:
            return target.final_target.path if target.is_alias else target.path
        except Exception:  # noqa: BLE001 - unresolvable alias
            return path
    return candidates[0]


def _split_columns(line: str, spans: list[tuple[int, int]]) -> list[str]:
    cells = []
    for k, (start, stop) in enumerate(spans):
        stop = len(line) if k == len(spans) - 1 else stop
        cells.append(line[start:stop].strip())
    return cells


def _escape_pipes(cell: str) -> str:
    """Escape ``|`` outside code spans (a Markdown table would split the cell there)."""
    parts = re.split(r"(`+[^`]*?`+)", cell)
    return "".join(p if p.startswith("`") else p.replace("|", "\\|") for p in parts)


def _simple_table(lines: list[str], borders: list[int], indent: str) -> list[str]:
    """A reST simple table (header between the first two borders) as a Markdown table."""
    spans = [m.span() for m in re.finditer(r"=+", lines[borders[0]])]
    rows: list[list[str]] = []
    header_rows = 0
    for index in range(borders[0] + 1, borders[2]):
        if index == borders[1]:
            header_rows = len(rows)
            continue
        line = lines[index]
        if not line.strip():
            continue
        cells = _split_columns(line, spans)
        continues = rows and index != borders[1] + 1
        if continues and not cells[0]:
            # reST: a blank first column continues the previous row
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells)]
        elif continues and not any(cells[1:]):
            # a first cell wrapped on its own line (``Name-`` / ``continued``)
            first = rows[-1][0]
            rows[-1][0] = first[:-1] + cells[0] if first.endswith("-") else f"{first} {cells[0]}"
        else:
            rows.append(cells)
    header = rows[:header_rows] or [[""] * len(spans)]
    head = [" ".join(col).strip() for col in zip(*header)]
    body = rows[header_rows:]
    out = ["", indent + "| " + " | ".join(_escape_pipes(c) for c in head) + " |"]
    out.append(indent + "|" + " --- |" * len(spans))
    out += [indent + "| " + " | ".join(_escape_pipes(c) for c in row) + " |" for row in body]
    return out + [""]


def _tables_to_markdown(text: str) -> str:
    """Turn every reST simple table (three border lines) into a Markdown table."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        if _TABLE_BORDER.match(lines[i]):
            borders = [j for j in range(i, len(lines)) if _TABLE_BORDER.match(lines[j])][:3]
            if len(borders) == 3:
                indent = re.match(r"[ \t]*", lines[i]).group(0)
                out.extend(_simple_table(lines, borders, indent))
                i = borders[2] + 1
                continue
        out.append(lines[i])
        i += 1
    return "\n".join(out)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _split_grouped_params(text: str) -> str:
    """``x, y: description`` in a parameters section -> one entry per name."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    section_indent = None
    while i < len(lines):
        line = lines[i]
        header = _PARAM_SECTION.match(line)
        if header:
            section_indent = len(header.group(1))
            out.append(line)
            i += 1
            continue
        if section_indent is not None and line.strip() and _indent(line) <= section_indent:
            section_indent = None
        entry = _GROUPED_ENTRY.match(line) if section_indent is not None else None
        if entry is None:
            out.append(line)
            i += 1
            continue
        indent, names, first = entry.group(1), entry.group(2), entry.group(3)
        body = [first]
        i += 1
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > len(indent)):
            if not lines[i].strip() and (
                i + 1 >= len(lines) or _indent(lines[i + 1]) <= len(indent)
            ):
                break
            body.append(lines[i])
            i += 1
        for name in (n.strip() for n in names.split(",")):
            out.append(f"{indent}{name}:{body[0]}")
            out.extend(body[1:])
    return "\n".join(out)


def _code_blocks_to_fences(text: str) -> str:
    """Every ``.. code-block:: lang`` directive and its indented body as a fenced block
    at the directive's indentation (the body dedented to it)."""
    lines, out, k = text.split("\n"), [], 0
    while k < len(lines):
        match = _CODE_BLOCK.match(lines[k])
        if not match:
            out.append(lines[k])
            k += 1
            continue
        indent, language = match.group(1), match.group(2)
        body, k = [], k + 1
        while k < len(lines) and (not lines[k].strip() or _indent(lines[k]) > len(indent)):
            body.append(lines[k])
            k += 1
        while body and not body[-1].strip():
            body.pop()
        while body and not body[0].strip():
            body.pop(0)
        depth = min(_indent(line) for line in body if line.strip()) if body else 0
        out += [f"{indent}```{language}"]
        out += [indent + line[depth:] if line.strip() else "" for line in body]
        out += [f"{indent}```", ""]
    return "\n".join(out)


def rest_to_markdown(text: str, obj: griffe.Object, loader: griffe.GriffeLoader) -> str:
    """The Markdown rendering of a docstring written with reST markup."""

    def role(match: re.Match) -> str:
        short, name = match.group(2) == "~", match.group(3).strip()
        if name.endswith("()"):
            name = name[:-2]
        title = name.rsplit(".", 1)[-1] if short else name
        identifier = _resolve(obj, name, loader)
        return (
            f'<autoref identifier="{html.escape(identifier)}" optional>'
            f"<code>{html.escape(title)}</code></autoref>"
        )

    text = _code_blocks_to_fences(text)
    text = _MATH_DIRECTIVE.sub(lambda m: f"{m.group(1)}\n{m.group(1)}$${m.group(2)}$$\n", text)
    text = _MATH_ROLE.sub(lambda m: f"\\({' '.join(m.group(1).split())}\\)", text)
    text = _ROLE.sub(role, text)
    text = _split_grouped_params(text)
    return _tables_to_markdown(text)


def _doc_comment(attr: griffe.Object) -> griffe.Docstring | None:
    """The Sphinx doc comment (``#:`` lines right above) of an attribute, if any."""
    try:
        lines = attr.lines_collection[attr.filepath]
    except Exception:  # noqa: BLE001 - no source available
        return None
    if not attr.lineno:
        return None
    comment: list[str] = []
    index = attr.lineno - 2  # the line above the assignment (lineno is 1-based)
    while index >= 0 and lines[index].lstrip().startswith("#:"):
        comment.insert(0, lines[index].lstrip()[2:].strip())
        index -= 1
    if not comment:
        return None
    return griffe.Docstring(
        "\n".join(comment), lineno=index + 2, endlineno=attr.lineno - 1, parent=attr
    )


class RestructuredText(griffe.Extension):
    """Rewrite the reST markup of every docstring of the loaded package.

    Attributes documented by a Sphinx doc comment (``#: text`` above the assignment),
    which Griffe does not read, get it as their docstring.
    """

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs) -> None:
        if obj.is_alias:
            return
        if obj.docstring is None and obj.is_attribute:
            obj.docstring = _doc_comment(obj)
        if obj.docstring is None:
            return
        obj.docstring.value = rest_to_markdown(obj.docstring.value, obj, loader)
