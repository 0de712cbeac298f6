# shellcheck shell=bash
# Variables set here (TRAIN_ARGS, HOST_NAMES, ...) are read by the launch scripts that source it.
# shellcheck disable=SC2034
#
# launch/common.sh: helpers shared by launch/{torchrun,deepspeed,mpirun}.sh (sourced, not run).
#
# Owns: argument handling common to all launchers (--dry-run, --help), finding the Python to run
# (PYTHON, else the repository's .venv, else python3), picking a free TCP port, reading
# hostfiles, and printing or executing a command with its environment assignments.
#
# Every launcher builds its command(s) as bash arrays and hands them to emit_or_exec, so what
# --dry-run prints is exactly what a real run executes.

LAUNCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(dirname "$LAUNCH_DIR")
TRAIN_MODULE=attnres_dist.cli

die() {
    echo "error: $*" >&2
    exit 2
}

# Prints the comment block under the shebang of the calling script (its usage text); the block
# ends at the first line that is not a comment, blank lines included.
usage() {
    sed -n '2,/^\([^#]\|$\)/{/^#/s/^# \{0,1\}//p}' "$1"
}

# Parses the launcher's own leading options; sets DRY_RUN and TRAIN_ARGS (the rest, verbatim).
# Only leading options are ours, so a training argument can never be mistaken for one.
parse_launcher_args() {
    local script=$1
    shift
    DRY_RUN=0
    while (($#)); do
        case $1 in
            --dry-run) DRY_RUN=1 ;;
            -h | --help)
                usage "$script"
                exit 0
                ;;
            --) shift && break ;;
            *) break ;;
        esac
        shift
    done
    TRAIN_ARGS=("$@")
}

# The interpreter every rank runs: $PYTHON, else the repository's virtualenv, else python3.
find_python() {
    if [[ -n ${PYTHON:-} ]]; then
        echo "$PYTHON"
    elif [[ -x $REPO_ROOT/.venv/bin/python ]]; then
        echo "$REPO_ROOT/.venv/bin/python"
    elif command -v python3 >/dev/null; then
        command -v python3
    else
        die "no Python found: set PYTHON or create $REPO_ROOT/.venv"
    fi
}

# Sets PY and starts BASE_ENV (assignments every rank gets). When the package is not installed
# in that interpreter, the checkout is put on PYTHONPATH so `python -m attnres_dist.cli` works.
setup_python() {
    PY=$(find_python)
    BASE_ENV=()
    if ! "$PY" -c 'import attnres_dist' >/dev/null 2>&1; then
        BASE_ENV+=("PYTHONPATH=$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}")
    fi
    # One intra-op thread per rank unless the user chose otherwise: several ranks per host each
    # using every core oversubscribe the CPU (30x slower steps on 2 cores, DESIGN.md section 4).
    BASE_ENV+=("OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}")
}

# A TCP port that is free on this host right now. Both torchrun and deepspeed default to 29500,
# which collides as soon as two jobs share a machine.
free_port() {
    "$PY" -c 'import socket
s = socket.socket()
s.bind(("", 0))
print(s.getsockname()[1])'
}

# Dies unless $2 is an integer >= $3 (and < $4 when given); $1 names it in the message.
check_int() {
    local name=$1 value=$2 lo=$3 hi=${4:-}
    if [[ $value =~ ^[0-9]+$ ]] && ((value >= lo)) && { [[ -z $hi ]] || ((value < hi)); }; then
        return 0
    fi
    die "$name=$value: expected an integer >= $lo${hi:+ and < $hi}"
}

# Reads an MPI/DeepSpeed-style hostfile into HOST_NAMES and HOST_SLOTS. Accepted lines:
# "host slots=N" (DeepSpeed, Open MPI), "host:N" (MPICH hydra), "host" (one slot). Blank lines
# and '#' comments are skipped. HOSTFILE_DS_FORMAT=1 when every line uses "slots=".
read_hostfile() {
    local file=$1 line host slots
    [[ -f $file ]] || die "HOSTFILE=$file: no such file"
    HOST_NAMES=()
    HOST_SLOTS=()
    HOSTFILE_DS_FORMAT=1
    while IFS= read -r line || [[ -n $line ]]; do
        line=${line%%#*}
        read -r -a words <<<"$line"
        ((${#words[@]})) || continue
        host=${words[0]}
        slots=1
        if [[ ${words[1]:-} =~ ^slots=([0-9]+)$ ]]; then
            slots=${BASH_REMATCH[1]}
        elif [[ $host =~ ^([^:]+):([0-9]+)$ ]]; then
            host=${BASH_REMATCH[1]}
            slots=${BASH_REMATCH[2]}
            HOSTFILE_DS_FORMAT=0
        else
            HOSTFILE_DS_FORMAT=0
        fi
        HOST_NAMES+=("$host")
        HOST_SLOTS+=("$slots")
    done <"$file"
    ((${#HOST_NAMES[@]})) || die "HOSTFILE=$file lists no hosts"
}

abs_path() {
    echo "$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
}

# One word as shell input: bare when it has only characters no shell treats specially,
# else printf %q (which would also escape harmless ',' and ':', e.g. in "h1:8,h2:8").
shell_quote() {
    if [[ $1 =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
        printf '%s' "$1"
    else
        printf '%q' "$1"
    fi
}

# Prints one command as a copy-pasteable shell line: NAME=value assignments, then the words,
# quoted so that spaces and quotes in arguments survive a paste or Python's shlex.split.
print_cmd() {
    local -n env_ref=$1 cmd_ref=$2
    local out="" word
    for word in "${env_ref[@]}"; do
        out+="${word%%=*}=$(shell_quote "${word#*=}") "
    done
    for word in "${cmd_ref[@]}"; do
        out+="$(shell_quote "$word") "
    done
    echo "${out% }"
}

# With --dry-run prints the command; otherwise replaces this shell with it.
# Arguments: names of the environment array and the command array.
emit_or_exec() {
    local -n env_ref2=$1 cmd_ref2=$2
    if ((DRY_RUN)); then
        print_cmd "$1" "$2"
    else
        exec env "${env_ref2[@]}" "${cmd_ref2[@]}"
    fi
}
