# Every target works on a fresh machine with Python 3.11 and make.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: install demo test test-slow test-all lint docs clean

$(BIN)/activate: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip setuptools wheel
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(BIN)/activate

install: $(BIN)/activate

# Trains a Lipschitz CNN on the bundled digits under (epsilon, delta) = (3, 1e-5).
demo: install
	TF_CPP_MIN_LOG_LEVEL=3 $(BIN)/lipdp train

# The fast suite (what CI runs): everything not marked slow.
test: install
	$(BIN)/pytest -q -n 2

# Slow tests only: training to accuracy, long adversarial searches.
test-slow: install
	$(BIN)/pytest -q -n 2 -m slow

test-all: install
	$(BIN)/pytest -q -m "slow or not slow" -n 2

lint: install
	$(BIN)/ruff check lipdp tests
	$(BIN)/ruff format --check lipdp tests

# The documentation site into site/ (mkdocs build --strict: any warning fails the
# build). The docs extra is installed into the virtual environment on first use.
$(VENV)/.docs-installed: $(BIN)/activate setup.cfg
	$(BIN)/pip install --quiet -e ".[docs]"
	touch $@

docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache site
