#!/usr/bin/env bash
# launch/netns-two-nodes.sh: profile a 2-stage pipeline across two simulated hosts (needs root).
#
# Usage: launch/netns-two-nodes.sh [--dry-run] [attnres-dist profile arguments...]
#   e.g. RATE=1gbit launch/netns-two-nodes.sh --config configs/tiny.yaml --steps 5
#
# Creates two network namespaces joined by a veth pair (addresses $SUBNET.1/24 and $SUBNET.2/24
# exist only inside them), runs one torchrun node with one rank in each (node 0 hosts the c10d
# rendezvous store), and runs `attnres-dist profile` across them, so every stage-to-stage byte
# crosses the veth link. The namespaces (and with them the link) are removed on exit, also on
# failure or Ctrl-C. The profile's world size is 2: the config must have pp*dp*tp = 2.
#   RATE     optional bandwidth cap on each end of the link (tc tbf), e.g. 1gbit or 200mbit
#   SUBNET   first three octets of the private /24 inside the namespaces (default 10.77.0)
#   PORT     rendezvous port inside the namespaces (default 29400)
#   OMP_NUM_THREADS threads per rank (default 1)
#   PYTHON   interpreter (default: the repository's .venv, else python3)
# --dry-run prints the commands instead of running them.
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DRY_RUN=0
case ${1:-} in
    --dry-run) DRY_RUN=1 && shift ;;
    -h | --help)
        sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"
        exit 0
        ;;
esac

die() {
    echo "error: $*" >&2
    exit 2
}

SUBNET=${SUBNET:-10.77.0}
PORT=${PORT:-29400}
[[ $SUBNET =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "SUBNET=$SUBNET: expected three octets, e.g. 10.77.0"
[[ $PORT =~ ^[0-9]+$ ]] || die "PORT=$PORT: expected a port number"
if [[ -n ${RATE:-} && ! $RATE =~ ^[0-9]+(\.[0-9]+)?([kmgt]?bit|[kmgt]?bps)$ ]]; then
    die "RATE=$RATE: expected a tc rate such as 1gbit or 200mbit"
fi
if ((!DRY_RUN)); then
    [[ $(id -u) == 0 ]] || die "network namespaces need root (run with sudo)"
    command -v ip >/dev/null || die "the 'ip' command (iproute2) is not installed"
    [[ -z ${RATE:-} ]] || command -v tc >/dev/null || die "RATE needs the 'tc' command (iproute2)"
fi

if [[ -n ${PYTHON:-} ]]; then
    PY=$PYTHON
elif [[ -x $REPO_ROOT/.venv/bin/python ]]; then
    PY=$REPO_ROOT/.venv/bin/python
else
    PY=$(command -v python3) || die "no Python found: set PYTHON"
fi

# Unique names: several runs (e.g. concurrent test sessions) may share the machine. Addresses
# can repeat between runs, since each pair of namespaces is a network of its own.
NS=("attnres-$$-0" "attnres-$$-1")
DEV=(veth0 veth1)
ADDR=("$SUBNET.1" "$SUBNET.2")

run() {
    if ((DRY_RUN)); then
        printf '%q ' "$@"
        echo
    else
        "$@"
    fi
}

PIDS=()
cleanup() {
    local pid ns
    for pid in "${PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for ns in "${NS[@]}"; do
        ip netns del "$ns" 2>/dev/null || true
    done
}
((DRY_RUN)) || trap cleanup EXIT INT TERM

run ip netns add "${NS[0]}"
run ip netns add "${NS[1]}"
# Both ends are created inside their namespaces: no interface ever appears in the host's.
run ip link add "${DEV[0]}" netns "${NS[0]}" type veth peer name "${DEV[1]}" netns "${NS[1]}"
for i in 0 1; do
    run ip -n "${NS[$i]}" addr add "${ADDR[$i]}/24" dev "${DEV[$i]}"
    run ip -n "${NS[$i]}" link set "${DEV[$i]}" up
    run ip -n "${NS[$i]}" link set lo up
    if [[ -n ${RATE:-} ]]; then
        # tbf caps what leaves each end, so both directions (activations and gradients) are
        # capped. The burst must hold one GSO segment (up to 64 KiB) or packets are dropped.
        run ip netns exec "${NS[$i]}" tc qdisc add dev "${DEV[$i]}" root tbf rate "$RATE" \
            burst 128kb latency 100ms
    fi
done

# Node i's command in CMD; the remaining arguments go to `attnres-dist profile` unchanged.
node_cmd() {
    local i=$1 is_host=false
    shift
    ((i == 0)) && is_host=true
    CMD=(ip netns exec "${NS[$i]}" env "OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}"
        "PYTHONPATH=$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
        "GLOO_SOCKET_IFNAME=${DEV[$i]}" "$PY" -m torch.distributed.run --nnodes=2
        --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint="${ADDR[0]}:$PORT"
        --rdzv-id="netns$$" --rdzv-conf=is_host="$is_host" --local-addr="${ADDR[$i]}"
        -m attnres_dist.cli profile "$@")
}

if ((DRY_RUN)); then
    for i in 0 1; do
        node_cmd "$i" "$@"
        run "${CMD[@]}"
    done
    exit 0
fi
node_cmd 0 "$@"
"${CMD[@]}" &
PIDS+=($!)
node_cmd 1 "$@"
status=0
"${CMD[@]}" || status=$?
wait "${PIDS[0]}" || status=$?
PIDS=()
exit "$status"
