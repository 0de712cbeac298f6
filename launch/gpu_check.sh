#!/usr/bin/env bash
# The prepared GPU check (docs/gpu.md): install like docker/Dockerfile from the wheels in .whl/,
# run every step time-boxed, write gpu.md, gpu_check.json and steps.log into $OUT.
#   bash launch/gpu_check.sh [--budget-s 480] [--only STEP ...]
# GPU_CHECK_DRY_RUN=1 runs the same driver on a CPU with tiny sizes. PYTHON: the base
# interpreter (default python3, the one that holds torch).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
OUT_DIR="${OUT:-gpu_check_out}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
args=(--out "$OUT_DIR" --wheels .whl)
if [ "${GPU_CHECK_DRY_RUN:-0}" = 1 ]; then args+=(--dry-run); fi
exec "$PYTHON" -m gpu_check.run "${args[@]}" "$@"
