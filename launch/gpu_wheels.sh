#!/usr/bin/env bash
# Wheels of what a bare GPU machine (Python 3.12, a CUDA torch, no network) lacks to install
# this project the way docker/Dockerfile does: DeepSpeed (an sdist, built here into a pure
# Python wheel without its JIT ops), Megatron-Core, mpich / mpi4py and the small packages
# they need. `make gpu-wheels` writes them into .whl/ (git-ignored); `make gpu-check` and the
# device tool's `carry` take them from there (docs/gpu.md). Versions are those of the CPU venv,
# which run the test suite.
set -euo pipefail
DEST="${1:-.whl}"
PYTHON="${PYTHON:-.venv/bin/python}"
mkdir -p "$DEST"
rm -f "$DEST"/*.whl
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
          --platform manylinux1_x86_64)
# megatron-core's cp312 wheel; DeepSpeed's requirements the image lacks; mpich for mpirun;
# typing-extensions and packaging at the floors pydantic and megatron-core set; fla-core (the
# gpu extra: auto's depth-attention kernel on CUDA) and flash-attn-res (the kernel benchmark's
# other outside kernel), both pure Python over the image's own triton and einops; transformers
# at the project's floor (the GPU image's is older) with the huggingface-hub, tokenizers (the
# image's 0.23.2 wants a hub below 2), kernels and HTTP stack it needs (pip installs only those
# the image lacks)
"$PYTHON" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$DEST" \
  megatron-core==0.16.1 mpich==5.0.2 mpi4py==4.1.2 \
  hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing-extensions==4.16.0 packaging==26.4 \
  fla-core==0.6.0 flash-attn-res==0.1.12 \
  transformers==5.25.0 huggingface-hub==2.4.0 tokenizers==0.23.3 kernels==0.19.1 hf-xet==1.8.0 \
  httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 h11==0.16.0 anyio==4.16.0 \
  idna==3.20 click==8.5.1 regex==2026.11.19 tomlkit==0.15.3 typer==0.29.2
# DeepSpeed 0.19.8 has no wheel on PyPI: build one from its sdist, ops left to JIT (DS_BUILD_OPS=0);
# its setup.py imports torch, so it builds against this venv's (the wheel is pure Python)
DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" deepspeed==0.19.8
ls -l "$DEST"
du -cb "$DEST"/*.whl | tail -1
