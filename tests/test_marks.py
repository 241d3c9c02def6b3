"""The thorough tier's list (tests/marks.py) names tests that exist, and the tiers split the
suite as the Makefile says."""

import ast
from pathlib import Path

import pytest

from tests.marks import THOROUGH_TESTS, is_thorough, representatives

ROOT = Path(__file__).resolve().parent.parent


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test_")
    }


@pytest.mark.parametrize("nodeid", sorted(THOROUGH_TESTS))
def test_every_thorough_entry_names_a_test_function(nodeid):
    file, _, rest = nodeid.partition("::")
    path = ROOT / file
    assert path.is_file(), f"{nodeid}: no file {file}"
    function = rest.split("[", 1)[0]
    assert function in _test_functions(path), f"{nodeid}: no test {function} in {file}"


def test_no_case_is_listed_beside_its_whole_function():
    functions = {entry for entry in THOROUGH_TESTS if "[" not in entry}
    twice = [e for e in THOROUGH_TESTS if "[" in e and e.split("[", 1)[0] in functions]
    assert not twice, f"listed with their whole function: {twice}"


def test_listed_cases_match_their_function_and_only_them():
    case = "tests/core/test_xla.py::test_xla_step_gives_the_default_result[clipless]"
    assert is_thorough(case)
    assert not is_thorough(case.replace("[clipless]", "[dp-sgd-ghost]"))
    whole = "tests/cli/test_cli.py::test_no_native_start_up_lines_in_a_real_process"
    assert is_thorough(whole) and is_thorough(whole + "[any]")
    assert not is_thorough(
        "tests/cli/test_cli.py::test_train_saves_a_model_that_loads_with_its_ledger"
    )


def test_representatives_mark_the_others_and_refuse_unknown_defaults():
    params = representatives(["a", "b", "c"], default={"a"}, smoke={"c"})
    assert params[0] == "a"
    assert [m.name for m in params[1].marks] == ["thorough"]
    assert [m.name for m in params[2].marks] == ["thorough", "smoke"]
    with pytest.raises(ValueError, match=r"\['z'\]"):
        representatives(["a"], default={"z"})
