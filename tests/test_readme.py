"""The README quick start runs as written."""

import re
from pathlib import Path


def test_readme_quick_start_runs():
    text = (Path(__file__).parents[1] / "README.md").read_text()
    block = re.search(r"## Quick start\s+```python\n(.*?)```", text, re.S).group(1)
    namespace = {}
    exec(compile(block.replace("epochs=40,", "epochs=40, verbose=0,"), "README", "exec"), namespace)
    model = namespace["model"]
    assert model.history.history["loss"][-1] < model.history.history["loss"][0]
