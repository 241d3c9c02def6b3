# Every target works on a fresh machine with Python 3.11 and make.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: install demo test test-slow test-all lint clean

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

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
