# Every target works on a fresh machine with Python 3.11 and make.
PYTHON ?= python3.11
export TF_CPP_MIN_LOG_LEVEL ?= 2
# Two virtual environments, one stack each (constraints/ pins it): $(VENV) has the main stack,
# TensorFlow 2.21 with Keras 3, numpy 2 and the current dp-accounting (every target below but
# *-keras2); $(VENV_KERAS2) has TensorFlow 2.15.1 with its own Keras 2 (the original lip-dp
# package's stack), where tensorflow-privacy, the per-example clipping reference, still imports.
VENV ?= .venv
BIN := $(VENV)/bin
CONSTRAINTS ?= constraints/keras3.txt
VENV_KERAS2 ?= .venv-keras2
KERAS2_CONSTRAINTS ?= constraints/keras2.txt
BIN_KERAS2 := $(VENV_KERAS2)/bin
# A third, for benchmarks/cross_library_speed.py only: PyTorch (CPU) and Opacus.
VENV_TORCH ?= .venv-torch
BIN_TORCH := $(VENV_TORCH)/bin

.PHONY: install install-keras2 install-torch demo test test-thorough test-jax test-keras2 \
	test-keras2-all test-notebooks test-slow test-all lint docs clean bench

$(BIN)/activate: setup.cfg pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip setuptools wheel
	$(BIN)/pip install --quiet -c $(CONSTRAINTS) -e ".[dev,hub,jax]"
	touch $(BIN)/activate

install: $(BIN)/activate

$(BIN_KERAS2)/activate: setup.cfg pyproject.toml $(KERAS2_CONSTRAINTS)
	$(PYTHON) -m venv $(VENV_KERAS2)
	$(BIN_KERAS2)/pip install --quiet --upgrade pip setuptools wheel
	$(BIN_KERAS2)/pip install --quiet -c $(KERAS2_CONSTRAINTS) -e ".[dev,reference]"
	touch $(BIN_KERAS2)/activate

install-keras2: $(BIN_KERAS2)/activate

install-torch:
	$(PYTHON) -m venv $(VENV_TORCH) && $(BIN_TORCH)/pip install --quiet torch==2.13.0 opacus==1.6.0 numpy

# Trains the clipless family's default network on the bundled digits (scattering features
# and a Lipschitz linear head) under (epsilon, delta) = (3, 1e-5), one line per epoch
# (--quiet: no Keras progress bar). About 50 s after the install.
demo: install
	TF_CPP_MIN_LOG_LEVEL=3 $(BIN)/lipdp train --quiet
	@echo "make demo: five runs of this demo reached test accuracies of 0.912 to 0.969, mean"
	@echo "0.942 (each run draws fresh noise); the clipped family (lipdp train --method dp-sgd)"
	@echo "reached 0.900 to 0.927, mean 0.916, on the same data and budget"
	@echo "(benchmarks/clipless_defaults.py)."

# The default suite (tests/marks.py): every capability and every refusal once. Keras 3,
# 2 cores: 1603 tests (notebook 01 included) in 5 min 7 s, in a fresh clone right after its
# .ci/run (2026-12-08 00:39 UTC, load about 2); 6-8 min on slower machines before the last
# cuts (CONTRIBUTING.md, "Test time"). Keras 2: 1290 tests, 5 min 48 s (2026-11-27).
test: install
	$(BIN)/pytest -q -n 2 --dist worksteal

# The other configurations of the default checks, on Keras 3. Not in CI: CI runs the
# thorough tier on Keras 2 only (`make test-keras2-all`, 210 tests in 7 min 41 s in a
# fresh-clone .ci/run on 2 cores, 2026-11-27), the faster stack, to stay within 40 minutes.
test-thorough: install
	$(BIN)/pytest -q -n 2 --dist worksteal -m "thorough and not slow"

# Both families on Keras 3's JAX backend: tests/clipped/jax, tests/clipless/jax and tests/backends, in one process
# (the rest of the suite is TensorFlow programs; under KERAS_BACKEND=jax tests/conftest.py
# collects the JAX directories and tests/backends only; the default suite skips the JAX ones).
test-jax: install
	KERAS_BACKEND=jax $(BIN)/pytest -q -n 0 tests/clipped/jax tests/clipless/jax tests/backends

# The default suite on Keras 2 (TensorFlow 2.15.1), with the comparisons against
# tensorflow-privacy that only this stack can import (all of them in the default tier).
test-keras2: install-keras2
	$(BIN_KERAS2)/pytest -q -n 2 --dist worksteal

# The default and thorough tiers on Keras 2 (CI, before `make test`: the one stack CI runs
# the thorough tier on).
test-keras2-all: install-keras2
	$(BIN_KERAS2)/pytest -q -n 2 --dist worksteal -m "not slow"

# The three longer tutorial notebooks (02, 03, 04) in quick mode, on the main stack: 3
# tests in 65 s on 2 cores (2026-11-29). In CI after `make test` (users learn the package
# from them), outside the default tier (its time budget); 01_getting_started runs in
# `make test`.
test-notebooks: install
	$(BIN)/pytest -q -n 2 tests/test_notebooks.py -m slow

# Slow tests only: training to accuracy, long adversarial searches.
test-slow: install
	$(BIN)/pytest -q -n 2 -m slow

test-all: install
	$(BIN)/pytest -q -m "slow or thorough or not slow" -n 2

# Benchmarks (NOT part of `make test`; the tables of benchmarks/README.md were measured on
# the Keras 2 stack, with tensorflow-privacy, so they rerun there; keras_stacks_speed.py
# compares the two stacks side by side; cross_library_speed.py compares lipdp with
# jax-privacy (installed here into $(VENV)) and with Opacus (`make install-torch` first, else
# its rows are skipped; 20 min); about 2.5 h on 2 shared cores: step_speed 40 min,
# fmnist_utility 45 min, fmnist_capacity 6 min, shuttle 2 x 6 min). Results and how to read them:
# benchmarks/README.md. Tables, raw JSON and the plot go to BENCH_OUT.
BENCH_OUT ?= benchmarks/results
bench: install install-keras2
	mkdir -p $(BENCH_OUT)
	$(BIN_KERAS2)/python benchmarks/accounting_speed.py > $(BENCH_OUT)/accounting_speed.md
	$(BIN_KERAS2)/python benchmarks/digits_cnn.py > $(BENCH_OUT)/digits_cnn.md
	$(BIN_KERAS2)/python benchmarks/evaluation_digits.py > $(BENCH_OUT)/evaluation_digits.md
	$(BIN_KERAS2)/python benchmarks/step_speed.py --rounds 11 --mem-cap-gb 12 \
		--json $(BENCH_OUT)/step_speed.json --plot $(BENCH_OUT)/step_speed.png \
		> $(BENCH_OUT)/step_speed.md
	$(BIN_KERAS2)/python benchmarks/groupsort_speed.py > $(BENCH_OUT)/groupsort_speed.md
	$(BIN_KERAS2)/python benchmarks/power_iterations_check.py --arch dense > $(BENCH_OUT)/power_dense.md
	$(BIN_KERAS2)/python benchmarks/power_iterations_check.py --arch cnn > $(BENCH_OUT)/power_cnn.md
	$(BIN_KERAS2)/python benchmarks/shuttle_utility.py > $(BENCH_OUT)/shuttle_standardize.md
	$(BIN_KERAS2)/python benchmarks/shuttle_utility.py --scaling asinh > $(BENCH_OUT)/shuttle_asinh.md
	$(BIN_KERAS2)/python benchmarks/fmnist_utility.py > $(BENCH_OUT)/fmnist_utility.md
	$(BIN_KERAS2)/python benchmarks/fmnist_capacity.py > $(BENCH_OUT)/fmnist_capacity.md
	$(BIN)/python benchmarks/clipless_tightness.py --out $(BENCH_OUT)/clipless_tightness.json \
		> $(BENCH_OUT)/clipless_tightness.md
	$(BIN)/python benchmarks/clipless_defaults.py --runs 5 > $(BENCH_OUT)/clipless_defaults.md
	$(BIN)/python benchmarks/clipless_defaults.py --dataset breast_cancer --runs 10 \
		> $(BENCH_OUT)/clipless_defaults_breast_cancer.md
	$(BIN)/python benchmarks/clipless_defaults.py --search > $(BENCH_OUT)/clipless_defaults_search.md
	$(BIN)/python benchmarks/clipless_defaults.py --dataset fashion_mnist --runs 3 \
		> $(BENCH_OUT)/clipless_defaults_fashion_mnist.md
	$(BIN)/python benchmarks/shuttle_private_search.py --seeds 0 1 2 3 4 5 6 \
		> $(BENCH_OUT)/shuttle_private_search.md
	$(BIN)/python benchmarks/keras_stacks_speed.py --keras3-python $(BIN)/python \
		--keras2-python $(BIN_KERAS2)/python --json $(BENCH_OUT)/keras_stacks_speed.json \
		> $(BENCH_OUT)/keras_stacks_speed.md
	$(BIN)/pip install --quiet jax-privacy==2.0.0
	$(BIN)/python benchmarks/cross_library_speed.py --keras3-python $(BIN)/python \
		--torch-python $(BIN_TORCH)/python --json $(BENCH_OUT)/cross_library_speed.json \
		> $(BENCH_OUT)/cross_library_speed.md
	cat $(BENCH_OUT)/*.md

lint: install
	$(BIN)/ruff check lipdp tests
	$(BIN)/ruff format --check lipdp tests

# The documentation site into site/ (mkdocs build --strict: any warning fails the
# build). The docs extra is installed into the virtual environment on first use.
$(VENV)/.docs-installed: $(BIN)/activate setup.cfg
	$(BIN)/pip install --quiet -c $(CONSTRAINTS) -e ".[docs]"
	touch $@

docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) $(VENV_KERAS2) $(VENV_TORCH) *.egg-info .pytest_cache .ruff_cache site
