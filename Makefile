# attnres_dist: every target sets up .venv itself on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CONFIG ?= configs/tiny.yaml
NPROC  ?= 2

.PHONY: setup train train-single test lint bench clean study gpu-wheels gpu-check gpu-check-dry

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
	$(VENV)/bin/hadolint docker/Dockerfile

bench: setup
	$(PY) -m attnres_dist.bench.run --out bench_results

# baseline vs Block vs Full AttnRes, 3 seeds each, into docs/results.md (about an hour on 2
# cores; finished runs in runs/study are kept, so an interrupted study resumes)
study: setup
	$(PY) -m attnres_dist.diagnostics.study $(ARGS)

clean:
	rm -rf runs bench_results .cache

# The GPU image (docker/Dockerfile, docs/docker.md). No Docker engine is needed to lint it:
# `make lint` and the test suite run hadolint on the Dockerfile.
.PHONY: docker-build docker-run
IMAGE       ?= attnres-dist:latest
DOCKER      ?= docker
DOCKER_GPUS ?= --gpus all
# What the container runs: attnres-dist arguments, or `launch torchrun|deepspeed|mpirun ...`.
DOCKER_ARGS ?= launch torchrun --config $(CONFIG)

docker-build:
	$(DOCKER) build -f docker/Dockerfile -t $(IMAGE) .

# runs/ and .cache/ (datasets) live on the host and are written as the calling user; NCCL and
# DeepSpeed want the host's IPC namespace and unlimited locked memory.
docker-run:
	mkdir -p runs .cache
	$(DOCKER) run --rm $(DOCKER_GPUS) --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
		--user $$(id -u):$$(id -g) -e HOME=/tmp -e NPROC=$(NPROC) \
		-v $(CURDIR)/runs:/workspace/attnres_dist/runs \
		-v $(CURDIR)/.cache:/workspace/attnres_dist/.cache \
		$(IMAGE) $(DOCKER_ARGS)

# The prepared GPU check (docs/gpu.md). gpu-wheels: on a CPU machine with network, the wheels a
# bare GPU machine lacks, into .whl/ (git-ignored). gpu-check: on the GPU machine (no venv of
# ours needed: it builds its own, as the Dockerfile does). gpu-check-dry: the same on this CPU.
gpu-wheels: setup
	PYTHON=$(PY) bash launch/gpu_wheels.sh .whl

gpu-check:
	bash launch/gpu_check.sh $(ARGS)

gpu-check-dry: setup
	GPU_CHECK_DRY_RUN=1 PYTHON=$(PY) OUT=$${OUT:-gpu_check_out} bash launch/gpu_check.sh $(ARGS)
