# attnres_dist: every target sets up .venv itself on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CONFIG ?= configs/tiny.yaml
NPROC  ?= 2

.PHONY: setup train train-single test test-full test-rest lint bench clean study gpu-wheels gpu-check gpu-check-dry \
        gpu-study gpu-speed

setup: $(STAMP)

# uv installs in parallel: the whole set-up in 65 s where pip took 137 s, side by side on a
# 2-core host. It does not read pip's configuration, so pip's find-links (where a machine keeps
# its CPU torch wheel: never a surprise CUDA build) is passed on. Bytecode is compiled at
# install, as pip does: every rank of every job imports from it. pip itself stays current for
# what still uses it (gpu-wheels, the GPU check's dry run). Deferred (=): asked only when
# the venv is built, not on every make.
FIND_LINKS = $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_INSTALL = $(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) \
              $(foreach link,$(FIND_LINKS),--find-links $(link))

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip uv==0.13.9
	$(UV_INSTALL) torch==2.13.0 -e '.[dev]'
	touch $(STAMP)

# The main job: the default config as a pipeline over $(NPROC) processes.
train: setup
	NPROC=$(NPROC) bash launch/torchrun.sh --config $(CONFIG) $(ARGS)

# The same config in one process (the reference engine).
train-single: setup
	$(VENV)/bin/attnres-dist train --config $(CONFIG) $(ARGS)

# The package, its tests and the measurement harness (which the wheel does not ship).
LINTED := attnres_dist bench gpu_check studies tests

# The tiers and their budgets: tests/tiers.py. `make test` is the fast tier (every capability,
# 15 min on 2 cores), `make test-full` every test, `make test-rest` the full tier's tests that
# the fast one leaves out (CI runs it after `make test`). Each ends with its wall time and its
# slowest tests. The compilers' caches live outside the clone, so a fresh clone on a machine
# that ran the suite before finds its compiled graphs and kernels (docs/testing.md).
PYTEST = TORCHINDUCTOR_CACHE_DIR=$(or $(TORCHINDUCTOR_CACHE_DIR),$(HOME)/.cache/attnres_dist/inductor) \
         TRITON_CACHE_DIR=$(or $(TRITON_CACHE_DIR),$(HOME)/.cache/attnres_dist/triton) \
         $(PY) -m pytest -q -p no:cacheprovider --durations=30

test: setup
	$(VENV)/bin/ruff check $(LINTED)
	$(PYTEST) --tier fast $(PYTEST_ARGS)

test-full: setup
	$(VENV)/bin/ruff check $(LINTED)
	$(PYTEST) --tier full $(PYTEST_ARGS)

# The rest tier is mostly launches and compilation, each of which leaves a core idle part of
# the time: two pytest-xdist workers, one test file each at a time (docs/testing.md).
REST_WORKERS ?= 2

test-rest: setup
	$(PYTEST) --tier rest -n $(REST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/hadolint docker/Dockerfile

bench: setup
	$(PY) -m bench.run --out bench_results

# baseline vs Block, Full, Delta Block and Delta Full AttnRes at three peak learning rates,
# 2 seeds each, into docs/results.md (each variant at its best rate beside every run; about
# 130 min on 2 cores; finished runs in runs/study are kept, so an interrupted study resumes)
STUDY_LRS ?= 1e-3 3e-3 6e-3
study: setup
	$(PY) -m studies.study --lrs $(STUDY_LRS) --seeds 1 2 $(ARGS)

clean:
	rm -rf runs bench_results .cache

# The image (docker/Dockerfile, docs/docker.md): the NGC flavour by default, the CPU flavour
# with DOCKER_BUILD_ARGS. `make lint` and the test suite run hadolint on the Dockerfile;
# `make docker-check` builds the CPU flavour with podman and runs it.
.PHONY: docker-build docker-run docker-check
IMAGE       ?= attnres-dist:latest
DOCKER      ?= docker
DOCKER_GPUS ?= --gpus all
# What the container runs: attnres-dist arguments, or `launch torchrun|deepspeed|mpirun ...`.
DOCKER_ARGS ?= launch torchrun --config $(CONFIG)

# DOCKER_BUILD_ARGS: e.g. the CPU flavour, --build-arg BASE_IMAGE=python:3.11-slim-bookworm
# --build-arg FLAVOUR=cpu (docs/docker.md)
DOCKER_BUILD_ARGS ?=
docker-build:
	$(DOCKER) build -f docker/Dockerfile $(DOCKER_BUILD_ARGS) -t $(IMAGE) .

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

# The GPU study (docs/diagnostics.md, "On one lent GPU"): the install steps, then baseline vs
# Block, Full, Delta Block and Delta Full AttnRes sized to what is left of 530 s;
# study.tar.gz comes back beside gpu.md.
gpu-study:
	bash launch/gpu_check.sh --only study --budget-s 530 $(ARGS)

# The speed measurement (docs/gpu.md, "Speed"): one step per device call of about 5 minutes,
# SPEED=speed_125m (default), speed_1b or speed_125m_compiled.
SPEED ?= speed_125m
gpu-speed:
	bash launch/gpu_check.sh --only $(SPEED) --budget-s 330 $(ARGS)

gpu-check-dry: setup
	GPU_CHECK_DRY_RUN=1 PYTHON=$(PY) OUT=$${OUT:-gpu_check_out} bash launch/gpu_check.sh $(ARGS)

# The CPU flavour of the image, built with podman over a locally made Debian base and run for
# real: check-config, the main job, its resume, deepspeed, mpirun, export + generate, and two
# containers as two nodes (docker/check.sh, docs/docker.md). Needs root; installs podman and
# debootstrap with apt where they are missing. Images and layers persist under
# /var/lib/attnres-dist, so a second run reuses them.
docker-check:
	bash docker/check.sh
