"""The README's Python snippets run as written, in order, in one namespace."""

import re
import warnings
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"


def test_readme_snippets_run_in_order():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2  # the quick start and the privacy budget
    namespace = {}
    for index, block in enumerate(blocks):
        # The progress bar only: same calls, quiet output.
        block = block.replace(
            "callbacks=[DP_Accountant()])", "callbacks=[DP_Accountant()], verbose=0)"
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exec(compile(block, f"README block {index}", "exec"), namespace)
        # Keras 3 warns "Do not pass an `input_shape`/`input_dim` argument to a layer".
        noisy = [str(w.message) for w in caught if "input_shape" in str(w.message)]
        assert noisy == [], f"README block {index}: {noisy}"
    model = namespace["model"]
    history = model.history.history
    assert history["loss"][-1] < history["loss"][0]
    # The quick start ends within its budget, as it says, and the budget snippet agrees.
    assert history["epsilon"][-1] <= 3.0
    assert namespace["get_max_epochs"](3.0, model) == 40
    report = namespace["privacy_report"](model)
    assert report.epsilon == pytest.approx(history["epsilon"][-1]) and report.epochs == 40
    assert "exactly as trained" in report.sampling_assumption
    # make_private's model: trained 10 epochs within the budget it was calibrated for.
    clipped = namespace["clipped"]
    assert int(clipped.noisy_steps.numpy()) == 10 * 3
    assert 2.9 < namespace["privacy_report"](clipped).epsilon <= 3.0


def test_docs_first_model_is_the_tested_quick_start():
    quick_start = re.search(r"## Quick start\s+```python\n(.*?)```", README.read_text(), re.S)
    docs = (README.parent / "docs" / "index.md").read_text()
    assert quick_start.group(1) in docs
