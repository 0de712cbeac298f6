#!/usr/bin/env bash
# launch/deepspeed.sh: run `attnres-dist train` under the deepspeed launcher.
#
# Usage: launch/deepspeed.sh [--dry-run] [attnres-dist train arguments...]
#   e.g. launch/deepspeed.sh --config configs/tiny.yaml train.steps=100
#
# One machine (default): NPROC ranks (default 2) on a free --master_port (or MASTER_PORT).
# Several machines: a DeepSpeed hostfile ("host slots=N" per line, same path on every node);
# run the same line on every node with its own NODE_RANK (deepspeed --no_ssh: no pdsh or ssh):
#   HOSTFILE        the hostfile; node r is its r-th host, which runs global ranks in order
#   NODE_RANK       this node's index in the hostfile, 0..nodes-1
#   MASTER_ADDR     address of the hostfile's first host (default: that host's name)
#   MASTER_PORT     port rank 0 listens on (default 29500 with a hostfile; it must be the
#                   same on every node, so no per-node free port can be picked)
#   NPROC           with a hostfile: ranks per node instead of each host's slots (optional)
# Either way:
#   OMP_NUM_THREADS threads per rank (default 1: the deepspeed launcher leaves it unset and
#                   every rank would use all cores)
#   PYTHON          interpreter (default: the repository's .venv, else python3)
# --dry-run prints the command instead of running it; for several nodes, one line per node.

# CMD/ENV arrays reach print_cmd and emit_or_exec by name, which shellcheck cannot follow.
# shellcheck disable=SC2034
set -euo pipefail
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

parse_launcher_args "$0" "$@"
setup_python

ENV=("${BASE_ENV[@]}")
# `python -m deepspeed.launcher.runner` is the `deepspeed` console script, run by the chosen
# interpreter; the ranks then run with that same interpreter (the runner's sys.executable).
# --module runs the CLI as `python -m attnres_dist.cli`; --no_local_rank because LOCAL_RANK is
# in the environment (the CLI would also accept and ignore --local_rank=N).
RUNNER=("$PY" -m deepspeed.launcher.runner)
PROGRAM=(--module --no_local_rank "$TRAIN_MODULE" train "${TRAIN_ARGS[@]}")

if [[ -z ${HOSTFILE:-} ]]; then
    NPROC=${NPROC:-2}
    check_int NPROC "$NPROC" 1
    # Without a hostfile the runner sizes the job by the accelerator's device count, which on
    # CPU is the number of NUMA nodes (or LOCAL_SIZE), usually 1. --num_gpus N (alias
    # --num_accelerators) overrides it: the slot list becomes 0..N-1 whatever was detected.
    # --hostfile=/dev/null (not a regular file) keeps the job local even on machines that have
    # the runner's default /job/hostfile.
    CMD=("${RUNNER[@]}" --hostfile=/dev/null --num_gpus="$NPROC" --master_port="${MASTER_PORT:-$(free_port)}"
        "${PROGRAM[@]}")
    if ((DRY_RUN)); then
        echo "# deepspeed: 1 node x $NPROC ranks"
    fi
    emit_or_exec ENV CMD
    exit 0
fi

read_hostfile "$HOSTFILE"
((HOSTFILE_DS_FORMAT)) || die "HOSTFILE=$HOSTFILE: deepspeed needs 'host slots=N' on every line"
HOSTFILE_ABS=$(abs_path "$HOSTFILE")
NUM_NODES=${#HOST_NAMES[@]}
SLOTS=()
if [[ -n ${NPROC:-} ]]; then
    check_int NPROC "$NPROC" 1
    SLOTS=(--num_gpus="$NPROC")
fi

node_cmd() {
    # --no_ssh makes the runner start only this node's ranks (no pdsh fan-out); it still reads
    # the whole hostfile to number them. Giving --master_addr skips its `ssh host hostname -I`.
    CMD=("${RUNNER[@]}" --hostfile="$HOSTFILE_ABS" "${SLOTS[@]}" --no_ssh --node_rank="$1"
        --master_addr="${MASTER_ADDR:-${HOST_NAMES[0]}}" --master_port="${MASTER_PORT:-29500}"
        "${PROGRAM[@]}")
}

if ((DRY_RUN)); then
    for ((rank = 0; rank < NUM_NODES; rank++)); do
        echo "# deepspeed: node $rank of $NUM_NODES (${HOST_NAMES[rank]}), run with NODE_RANK=$rank"
        node_cmd "$rank"
        print_cmd ENV CMD
    done
    exit 0
fi

[[ -n ${NODE_RANK:-} ]] || die "HOSTFILE given: set NODE_RANK (0..$((NUM_NODES - 1))) on each node"
check_int NODE_RANK "$NODE_RANK" 0 "$NUM_NODES"
node_cmd "$NODE_RANK"
emit_or_exec ENV CMD
