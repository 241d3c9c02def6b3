"""One version and one licence, stated alike everywhere they appear.

The version's source is ``version`` in setup.cfg (installed into the package metadata);
``lipdp.__version__``, ``lipdp --version``, CITATION.cff and the latest release of
CHANGELOG.md repeat it. The licence's source is ``license`` in setup.cfg; LICENSE holds its
text and CITATION.cff names it.
"""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml

import lipdp

ROOT = Path(__file__).resolve().parents[1]


def setup_cfg():
    config = configparser.ConfigParser(interpolation=None)
    config.read(ROOT / "setup.cfg", encoding="utf-8")
    return config["metadata"]


def citation():
    return yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))


def test_version_is_the_metadata_version():
    declared = setup_cfg()["version"]
    assert lipdp.__version__ == declared
    installed = metadata.version("lipdp")
    assert installed == declared, (
        f"the installed metadata says {installed}, setup.cfg {declared}: reinstall (make install)"
    )


def test_version_falls_back_to_setup_cfg_when_not_installed(monkeypatch):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert lipdp._version() == setup_cfg()["version"]


def test_command_line_prints_the_version():
    result = subprocess.run(
        [sys.executable, "-m", "lipdp.cli", "--version"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"lipdp {setup_cfg()['version']}"


def test_citation_file_is_cff_1_2_0_with_this_version_and_the_papers():
    cff = citation()
    # The keys CFF 1.2.0 requires, and the types of the ones used here.
    for key in ("cff-version", "message", "title", "authors"):
        assert cff.get(key), key
    assert cff["cff-version"] == "1.2.0"
    assert cff["type"] == "software"
    assert all("name" in a or "family-names" in a for a in cff["authors"])
    assert str(cff["version"]) == setup_cfg()["version"]
    assert cff["license"] == setup_cfg()["license"]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(cff["date-released"]))
    references = cff["references"]
    for reference in references:
        assert reference["type"] in ("article", "conference-paper"), reference["title"]
        assert reference["title"] and isinstance(reference["year"], int)
        assert all({"family-names", "given-names"} <= set(a) for a in reference["authors"])
    first_authors = {r["authors"][0]["family-names"] for r in references}
    assert first_authors == {"Béthune", "Barczewski", "Bu", "Hayes", "Knolle"}


def released_versions():
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    return re.findall(r"^## \[(\d+\.\d+\.\d+[^\]]*)\] - (\d{4}-\d{2}-\d{2})$", text, re.M), text


def test_changelog_latest_release_is_this_version():
    releases, text = released_versions()
    assert releases, "no '## [X.Y.Z] - YYYY-MM-DD' heading in CHANGELOG.md"
    assert releases[0][0] == setup_cfg()["version"]
    assert text.index("## [Unreleased]") < text.index(f"## [{releases[0][0]}]")
    # The citation's release date is the changelog's.
    assert str(citation()["date-released"]) == releases[0][1]


#: The first line of each licence's standard text, by SPDX identifier.
LICENCE_FIRST_LINES = {
    "MIT": "MIT License",
    "Apache-2.0": "Apache License",
}


@pytest.mark.parametrize("where", ["setup.cfg", "installed metadata"])
def test_licence_file_matches_the_declared_licence(where):
    declared = setup_cfg()["license"]
    if where == "installed metadata":
        info = metadata.metadata("lipdp")
        declared = info.get("License-Expression") or info.get("License")
    assert declared in LICENCE_FIRST_LINES, declared
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.splitlines()[0].strip() == LICENCE_FIRST_LINES[declared]
    assert "Permission is hereby granted, free of charge" in text or declared != "MIT"
