#!/usr/bin/env bash
# launch/torchrun.sh: run `attnres-dist train` under torchrun (torch.distributed.run).
#
# Usage: launch/torchrun.sh [--dry-run] [attnres-dist train arguments...]
#   e.g. launch/torchrun.sh --config configs/tiny.yaml train.steps=100
#
# One machine (default): NPROC ranks (default 2) with a standalone rendezvous on a free port.
# Several machines: run the same line on every node with its own NODE_RANK:
#   NNODES          number of nodes, or MIN:MAX for an elastic job
#   NODE_RANK       this node's index, 0..NNODES-1; node 0 must be the host named in
#                   RDZV_ENDPOINT (it hosts the c10d rendezvous store). Under srun it
#                   defaults to SLURM_NODEID (launch/slurm.sbatch relies on this)
#   RDZV_ENDPOINT   host:port of the rendezvous (c10d backend)
#   RDZV_ID         job id shared by all nodes (default attnres)
#   LOCAL_ADDR      this node's address as the others reach it (when its host name does not
#                   resolve to that address on the other nodes)
# Either way:
#   NPROC           ranks per node (default 2)
#   MAX_RESTARTS    restart the whole job up to this many times when a rank fails
#   OMP_NUM_THREADS threads per rank (default 1)
#   PYTHON          interpreter (default: the repository's .venv, else python3)
# --dry-run prints the command instead of running it; for several nodes, one line per node.

# CMD/ENV arrays reach print_cmd and emit_or_exec by name, which shellcheck cannot follow.
# shellcheck disable=SC2034
set -euo pipefail
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

parse_launcher_args "$0" "$@"
setup_python

NPROC=${NPROC:-2}
NNODES=${NNODES:-1}
check_int NPROC "$NPROC" 1
[[ $NNODES =~ ^[0-9]+(:[0-9]+)?$ ]] || die "NNODES=$NNODES: expected N or MIN:MAX"

ENV=("${BASE_ENV[@]}")
RESTART=()
if [[ -n ${MAX_RESTARTS:-} ]]; then
    check_int MAX_RESTARTS "$MAX_RESTARTS" 0
    RESTART=(--max-restarts="$MAX_RESTARTS")
    # By default the workers reuse the agent's rendezvous TCP store; after a restart gloo then
    # fails with "Gloo connectFullMesh failed". A store per attempt avoids it (DESIGN.md sec. 4).
    ENV+=(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
fi

LAUNCHER=("$PY" -m torch.distributed.run --nproc-per-node="$NPROC" "${RESTART[@]}")
PROGRAM=(-m "$TRAIN_MODULE" train "${TRAIN_ARGS[@]}")

if [[ $NNODES == 1 && -z ${RDZV_ENDPOINT:-} ]]; then
    # --standalone binds its rendezvous to port 0 and picks the workers' MASTER_PORT itself, so
    # concurrent jobs on one host never collide on torchrun's default 29500.
    CMD=("${LAUNCHER[@]}" --standalone "${PROGRAM[@]}")
    if ((DRY_RUN)); then
        echo "# torchrun: 1 node x $NPROC ranks"
    fi
    emit_or_exec ENV CMD
    exit 0
fi

[[ -n ${RDZV_ENDPOINT:-} ]] || die "NNODES=$NNODES: set RDZV_ENDPOINT=host:port (node 0's address)"
[[ $RDZV_ENDPOINT =~ ^.+:[0-9]+$ ]] || die "RDZV_ENDPOINT=$RDZV_ENDPOINT: expected host:port"
MAX_NODES=${NNODES#*:}

node_cmd() {
    local rank=$1 is_host=false
    ((rank == 0)) && is_host=true
    # Stating which node hosts the rendezvous store, instead of torchrun guessing from host
    # names, keeps working when names resolve differently on each node (namespaces, containers).
    CMD=("${LAUNCHER[@]}" --nnodes="$NNODES" --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT"
        --rdzv-id="${RDZV_ID:-attnres}" --rdzv-conf=is_host="$is_host")
    # LOCAL_ADDR describes this node only, so it goes on this node's line only.
    if [[ -n ${LOCAL_ADDR:-} && $rank == "${NODE_RANK:-}" ]]; then
        CMD+=(--local-addr="$LOCAL_ADDR")
    fi
    CMD+=("${PROGRAM[@]}")
}

if ((DRY_RUN)); then
    for ((rank = 0; rank < MAX_NODES; rank++)); do
        echo "# torchrun: node $rank of $NNODES ($NPROC ranks), run with NODE_RANK=$rank"
        node_cmd "$rank"
        print_cmd ENV CMD
    done
    exit 0
fi

# srun starts the same command on every node; Slurm's node index tells them apart.
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-}}
[[ -n ${NODE_RANK:-} ]] || die "NNODES=$NNODES: set NODE_RANK (0..$((MAX_NODES - 1))) on each node"
check_int NODE_RANK "$NODE_RANK" 0 "$MAX_NODES"
node_cmd "$NODE_RANK"
emit_or_exec ENV CMD
