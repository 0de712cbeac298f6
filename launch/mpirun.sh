#!/usr/bin/env bash
# launch/mpirun.sh: run `attnres-dist train` under mpirun (MPICH hydra, from the `mpich` wheel).
#
# Usage: launch/mpirun.sh [--dry-run] [attnres-dist train arguments...]
#   e.g. launch/mpirun.sh --config configs/tiny.yaml train.steps=100
#
# Ranks read their rank and size from MPI (PMI_RANK/PMI_SIZE); rank 0 picks the rendezvous
# address and a free port and broadcasts them over mpi4py, so no port has to be chosen here.
# One command starts the whole job, on one machine or, from any one node, on several:
#   NPROC           total ranks (default 2; with HOSTFILE: the sum of its slots)
#   HOSTFILE        hosts to run on: "host slots=N", "host:N" or "host" lines. Hydra starts the
#                   remote ranks over ssh; the venv must be at the same path on every host.
#   MASTER_ADDR     address rank 0 announces (default: 127.0.0.1 when all ranks share a host,
#                   else the address rank 0 uses to reach the other hosts)
#   MASTER_PORT     port rank 0 listens on (default: a free one)
#   MPIRUN          the mpirun to use (default: the one next to the interpreter, else PATH)
#   MPIRUN_ARGS     extra hydra options, split on spaces, e.g. "-iface ib0" or
#                   "-launcher-exec /path/to/ssh-like-tool -localhost 10.0.0.1"
#   OMP_NUM_THREADS threads per rank (default 1), passed to every rank with -genv
#   PYTHON          interpreter (default: the repository's .venv, else python3)
# --dry-run prints the command instead of running it.

# CMD/ENV arrays reach print_cmd and emit_or_exec by name, which shellcheck cannot follow.
# shellcheck disable=SC2034
set -euo pipefail
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

parse_launcher_args "$0" "$@"
setup_python

# The mpich wheel installs mpirun/mpiexec next to the venv's python; mpi4py in that venv is
# linked against that MPICH, so a different MPI's mpirun would start ranks that cannot talk.
find_mpirun() {
    local bin
    if [[ -n ${MPIRUN:-} ]]; then
        echo "$MPIRUN"
        return
    fi
    bin=$(dirname "$PY")
    for name in mpirun mpiexec; do
        if [[ -x $bin/$name ]]; then
            echo "$bin/$name"
            return
        fi
    done
    for name in mpirun mpiexec; do
        if command -v "$name" >/dev/null; then
            command -v "$name"
            return
        fi
    done
    die "no mpirun found: pip install mpich mpi4py (or set MPIRUN)"
}
MPIRUN_BIN=$(find_mpirun)

# Hydra propagates the caller's environment to every rank by default; -genv makes the values
# this script sets explicit (and still applies if a site config turns propagation off).
GENV=()
for assignment in "${BASE_ENV[@]}"; do
    GENV+=(-genv "${assignment%%=*}" "${assignment#*=}")
done
for name in MASTER_ADDR MASTER_PORT; do
    if [[ -n ${!name:-} ]]; then
        GENV+=(-genv "$name" "${!name}")
    fi
done

HOSTS=()
if [[ -n ${HOSTFILE:-} ]]; then
    read_hostfile "$HOSTFILE"
    # Rewritten as -hosts h1:n1,h2:n2 so DeepSpeed/Open MPI style hostfiles work too (hydra's
    # -f only reads "host:N"), and so the printed command shows where ranks go.
    spec="" total=0
    for i in "${!HOST_NAMES[@]}"; do
        spec+="${spec:+,}${HOST_NAMES[i]}:${HOST_SLOTS[i]}"
        total=$((total + HOST_SLOTS[i]))
    done
    HOSTS=(-hosts "$spec")
    NPROC=${NPROC:-$total}
fi
NPROC=${NPROC:-2}
check_int NPROC "$NPROC" 1

# Options for hydra itself (network interface, how to reach the other hosts), word-split so
# several can be given in one variable.
read -r -a EXTRA <<<"${MPIRUN_ARGS:-}"

NO_ENV=()
CMD=("$MPIRUN_BIN" "${EXTRA[@]}" "${HOSTS[@]}" -np "$NPROC" "${GENV[@]}" "$PY" -m "$TRAIN_MODULE"
    train "${TRAIN_ARGS[@]}")
if ((DRY_RUN)); then
    if ((${#HOSTS[@]})); then
        echo "# mpirun: $NPROC ranks on ${#HOST_NAMES[@]} hosts, run once from any one of them"
    else
        echo "# mpirun: 1 node x $NPROC ranks"
    fi
fi
emit_or_exec NO_ENV CMD
