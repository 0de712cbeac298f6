#!/usr/bin/env bash
# docker/entrypoint.sh: the image's entrypoint.
#
#   <image> ARGS...                 runs `attnres-dist ARGS...` (train, check-config, ...)
#   <image> launch NAME ARGS...     runs launch/NAME.sh ARGS... (NAME: torchrun, deepspeed,
#                                   mpirun), for multi-process and multi-node jobs
#
# Both go through NGC's own entrypoint when the base has one: it runs the base image's start-up
# scripts (CUDA forward-compatibility libraries, driver checks) before the command.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

if [[ ${1:-} == launch ]]; then
    name=${2:-}
    # a fixed list: the name becomes a path, so nothing else may reach it
    if [[ ! $name =~ ^(torchrun|deepspeed|mpirun)$ ]]; then
        echo "usage: launch {torchrun|deepspeed|mpirun} [attnres-dist train arguments...]" >&2
        exit 2
    fi
    shift 2
    cmd=("$ROOT/launch/$name.sh" "$@")
else
    cmd=(attnres-dist "$@")
fi

NGC_ENTRYPOINT=${NGC_ENTRYPOINT:-/opt/nvidia/nvidia_entrypoint.sh}
if [[ -x $NGC_ENTRYPOINT ]]; then
    exec "$NGC_ENTRYPOINT" "${cmd[@]}"
fi
exec "${cmd[@]}"
