# attnres_dist: every target sets up .venv itself on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CONFIG ?= configs/tiny.yaml
NPROC  ?= 2

.PHONY: setup train train-single test lint bench clean

setup: $(STAMP)

# torch first, pinned: the CPU wheel where one is provided locally, never a surprise CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The main job: the default config as a pipeline over $(NPROC) processes.
train: setup
	NPROC=$(NPROC) bash launch/torchrun.sh --config $(CONFIG) $(ARGS)

# The same config in one process (the reference engine).
train-single: setup
	$(VENV)/bin/attnres-dist train --config $(CONFIG) $(ARGS)

test: setup
	$(VENV)/bin/ruff check attnres_dist tests
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check attnres_dist tests
	$(VENV)/bin/ruff format --check attnres_dist tests

bench: setup
	$(PY) -m attnres_dist.bench.run --out bench_results

clean:
	rm -rf runs bench_results .cache
