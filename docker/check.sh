#!/usr/bin/env bash
# docker/check.sh: `make docker-check`, the image built and run for real on a CPU machine.
#
# Owns: building the CPU flavour of docker/Dockerfile with podman over a locally made Debian
# bookworm base, and running the documented jobs inside it as the image's non-root user with
# runs/ mounted from the host. Each check prints its name, result and time; a failure prints
# the tail of the container's log. The engine settings are the files in docker/podman/, passed
# explicitly (CONTAINERS_CONF, CONTAINERS_STORAGE_CONF); images and layers persist under
# /var/lib/attnres-dist/containers, so a second run on the machine reuses the base and the
# cached layers. Needs root (rootful podman, debootstrap) and Debian's apt for what is missing.
#
#   bash docker/check.sh          (make docker-check; logs and runs stay in runs/docker-check/)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
T0=$(date +%s)

say() { echo "docker-check: $*"; }
die() {
    echo "docker-check: error: $*" >&2
    exit 1
}

# -- tools --------------------------------------------------------------------------------------
[[ $(id -u) == 0 ]] || die "needs root (rootful podman and debootstrap); run it as root or with sudo"
STATE=/var/lib/attnres-dist/containers
export CONTAINERS_CONF=$ROOT/docker/podman/containers.conf
export CONTAINERS_STORAGE_CONF=$ROOT/docker/podman/storage.conf
PACKAGES=(podman runc netavark aardvark-dns iptables debootstrap)
missing=()
for tool in podman runc debootstrap iptables; do
    command -v "$tool" >/dev/null || missing+=("$tool")
done
[[ -x /usr/lib/podman/netavark ]] || missing+=(netavark)
if ((${#missing[@]})); then
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install them"
    say "installing ${PACKAGES[*]} with apt-get (missing: ${missing[*]})"
    log=$(mktemp)
    if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
        --no-install-recommends "${PACKAGES[@]}"; } >"$log" 2>&1; then
        tail -n 5 "$log" >&2
        die "apt-get could not install ${PACKAGES[*]} (log above)"
    fi
    rm -f "$log"
fi
mkdir -p "$STATE" /run/attnres-dist
podman info >/dev/null 2>&1 || die "podman does not start here: $(podman info 2>&1 | tail -n 1)"
say "$(podman --version), runtime $(podman info --format '{{.Host.OCIRuntime.Name}}')," \
    "storage $(podman info --format '{{.Store.GraphRoot}}')"

# Limits a container may have: nofile at most this shell's hard limit, nproc at most 32768.
NOFILE=$(ulimit -Hn)
[[ $NOFILE == unlimited || $NOFILE -gt 65536 ]] && NOFILE=65536
ULIMITS=(--ulimit "nofile=$NOFILE:$NOFILE" --ulimit nproc=32768:32768)

# -- the base: Debian bookworm + Python 3.11, made with debootstrap and imported ----------------
# python-is-python3: the Dockerfile's steps call `python`, as on the NGC base. gcc and libc6-dev:
# the project's C kernels (RMSNorm, two-phase depth attention) build at run time, as on the host.
BASE_PACKAGES=python3,python3-venv,python3-pip,python-is-python3,ca-certificates,gcc,libc6-dev
# The machine's extra certificate authorities (a TLS-inspecting proxy's, say) go into the base,
# or pip inside the build cannot verify PyPI.
EXTRA_CAS=(/usr/local/share/ca-certificates/*.crt)
[[ -e ${EXTRA_CAS[0]} ]] || EXTRA_CAS=()
MIRROR=$(sed -n 's/^URIs: *\([^ ]*debian\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null |
    head -n 1)
MIRROR=${MIRROR:-http://deb.debian.org/debian}
base_id=$({
    echo "$BASE_PACKAGES"
    cat "${EXTRA_CAS[@]}" </dev/null
} | sha256sum | cut -c1-12)
BASE=localhost/attnres-base:bookworm-$base_id
if podman image exists "$BASE"; then
    say "base: $BASE (reused)"
    BASE_S=0
else
    say "base: making $BASE with debootstrap from $MIRROR"
    t=$(date +%s)
    rootfs=$(mktemp -d /var/tmp/attnres-rootfs.XXXXXX)
    trap 'rm -rf "$rootfs"' EXIT
    log=$STATE/debootstrap.log
    debootstrap --variant=minbase --include="$BASE_PACKAGES" bookworm "$rootfs" "$MIRROR" \
        >"$log" 2>&1 || {
        tail -n 20 "$log" >&2
        die "debootstrap failed (log above, all of it in $log)"
    }
    if ((${#EXTRA_CAS[@]})); then
        cp "${EXTRA_CAS[@]}" "$rootfs/usr/local/share/ca-certificates/"
        chroot "$rootfs" update-ca-certificates >/dev/null
    fi
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin
    tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
    rm -rf "$rootfs"
    trap - EXIT
    BASE_S=$(($(date +%s) - t))
    say "base: made in ${BASE_S} s"
fi

# -- the image: docker/Dockerfile's CPU flavour ----------------------------------------------------
IMAGE=localhost/attnres-dist:cpu
# The CPU torch wheel: from the machine's pip find-links when it holds one (this machine class
# keeps it there), else PyTorch's CPU wheel index.
WHEELS=$(python3 -m pip config get global.find-links 2>/dev/null || true)
WHEELS=${PIP_FIND_LINKS:-$WHEELS}
BUILD_MOUNT=()
TORCH_FIND_LINKS=https://download.pytorch.org/whl/cpu/torch/
if [[ -d $WHEELS ]] && compgen -G "$WHEELS/torch-*+cpu-*.whl" >/dev/null; then
    BUILD_MOUNT=(-v "$WHEELS:/wheels:ro")
    TORCH_FIND_LINKS=/wheels
fi
say "build: $IMAGE from $BASE, torch wheel from $TORCH_FIND_LINKS"
t=$(date +%s)
log=$STATE/build.log
podman build --pull=never --layers --format docker -f docker/Dockerfile -t "$IMAGE" \
    "${ULIMITS[@]}" "${BUILD_MOUNT[@]}" --build-arg BASE_IMAGE="$BASE" --build-arg FLAVOUR=cpu \
    --build-arg TORCH_FIND_LINKS="$TORCH_FIND_LINKS" . >"$log" 2>&1 || {
    tail -n 30 "$log" >&2
    die "podman build failed (log above, all of it in $log)"
}
BUILD_S=$(($(date +%s) - t))
# The image a previous run built is left untagged; its own layers go (the shared ones stay).
podman image prune -f >/dev/null 2>&1 || true
grep -h '^base check' "$log" | tail -n 1 | sed 's/^/docker-check: build: /' || true
SIZE=$(podman image inspect --format '{{.Size}}' "$IMAGE")
say "build: done in ${BUILD_S} s ($(grep -c 'Using cache' "$log" || true) cached steps)," \
    "image $((SIZE / 1000000)) MB"

# -- the checks -----------------------------------------------------------------------------------
RUNS=$ROOT/runs/docker-check
rm -rf "$RUNS"
mkdir -p "$RUNS"
# Who runs the jobs, and so owns what they write under runs/: the calling user (a sudo caller's
# own uid) as a non-root user in the container, the way `make docker-run` does. A root caller
# cannot be both: the image's own user (uid 10001) runs the jobs and owns their files. (Mapping
# uid 10001 to host root needs a multi-range user namespace, which podman 4.3 builds as a chowned
# copy of the image that overlayfs then refuses here: "failed to resolve ...: -13".)
OWNER_UID=${SUDO_UID:-$(id -u)}
OWNER_GID=${SUDO_GID:-$(id -g)}
USER_FLAGS=()
if ((OWNER_UID == 0)); then
    OWNER_UID=10001 OWNER_GID=10001
else
    USER_FLAGS=(--user "$OWNER_UID:$OWNER_GID" -e HOME=/tmp)
fi
# The prepared corpus (.cache/) is kept in runs/docker-check/ too: made once, not per container.
mkdir -p "$RUNS/.cache"
chown "$OWNER_UID:$OWNER_GID" "$RUNS" "$RUNS/.cache"
KEPT=(podman run --pull=never --shm-size=1g "${ULIMITS[@]}" "${USER_FLAGS[@]}"
    -v "$RUNS:/workspace/attnres_dist/runs/docker-check"
    -v "$RUNS/.cache:/workspace/attnres_dist/.cache")
RUN=("${KEPT[@]:0:2}" --rm "${KEPT[@]:2}")
NET=attnres-check
podman rm -f -i attnres-node0 attnres-node1 >/dev/null 2>&1 || true
podman network rm -f "$NET" >/dev/null 2>&1 || true

RESULTS=()
FAILED=0
# check NAME EXPECTED-TEXT COMMAND...: runs the command, logs to runs/docker-check/NAME.log,
# passes when it exits 0 and its output has the expected text (a fixed string).
check() {
    local name=$1 expect=$2 t rc=0 what
    shift 2
    what="$*"
    what=${what#*"$IMAGE" }  # what ran in the container (the podman flags are the same for all)
    t=$(date +%s)
    "$@" >"$RUNS/$name.log" 2>&1 || rc=$?
    t=$(($(date +%s) - t))
    if ((rc == 0)) && grep -qF -- "$expect" "$RUNS/$name.log"; then
        RESULTS+=("$(printf '%-14s ok      %4d s' "$name" "$t")")
        say "$name: ok in $t s: $what"
    else
        FAILED=1
        RESULTS+=("$(printf '%-14s FAILED  %4d s' "$name" "$t")")
        say "$name: FAILED (exit $rc, wanted \"$expect\") in $t s: $what"
        tail -n 25 "$RUNS/$name.log" | sed 's/^/    | /'
    fi
}

# losses RUN: the per-step training losses of runs/docker-check/RUN, one line.
losses() {
    python3 -c 'import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print(" ".join(repr(r["loss"]) for r in rows if r["kind"] == "train"))' \
        "$RUNS/$1/metrics.jsonl"
}

TINY=(--config configs/tiny.yaml train.eval_every=0 train.eval_batches=4 train.log_every=1
    train.progress=false optim.warmup_steps=4)
check check-config "ok: " "${RUN[@]}" "$IMAGE" check-config --config configs/tiny.yaml
check torchrun "final validation" "${RUN[@]}" "$IMAGE" launch torchrun "${TINY[@]}" \
    train.steps=24 checkpoint.every=12 output.run_dir=runs/docker-check/tiny
check resume "resumed from" "${RUN[@]}" "$IMAGE" launch torchrun "${TINY[@]}" \
    train.steps=36 checkpoint.every=12 output.run_dir=runs/docker-check/tiny
check owner "step-00000036" stat -c '%u:%g %n' "$RUNS/tiny/metrics.jsonl" \
    "$RUNS/tiny/checkpoints/step-00000036"
owners=$({ stat -c '%u:%g' "$RUNS/tiny/metrics.jsonl" "$RUNS/tiny/checkpoints/step-00000036" \
    2>/dev/null || true; } | sort -u)
if [[ $owners != "$OWNER_UID:$OWNER_GID" ]]; then
    FAILED=1
    RESULTS+=("$(printf '%-14s FAILED' owner)")
    say "owner: FAILED: runs/docker-check/tiny is owned by ${owners:-nobody}," \
        "not $OWNER_UID:$OWNER_GID"
else
    say "owner: the run's files belong to $owners (the container's user)"
fi
SHORT=("${TINY[@]}" train.steps=6 checkpoint.every=0)
check deepspeed "final validation" "${RUN[@]}" "$IMAGE" launch deepspeed "${SHORT[@]}" \
    output.run_dir=runs/docker-check/deepspeed
check mpirun "final validation" "${RUN[@]}" "$IMAGE" launch mpirun "${SHORT[@]}" \
    output.run_dir=runs/docker-check/mpirun
check export-hf "exported step 36" "${RUN[@]}" "$IMAGE" export runs/docker-check/tiny --format hf \
    --output runs/docker-check/tiny-hf
check generate "def " "${RUN[@]}" "$IMAGE" generate runs/docker-check/tiny-hf --prompt "def " \
    --max-new-tokens 40 --seed 1

# Two containers as two nodes on one podman network, one pipeline stage each, joined by
# torchrun's c10d rendezvous on node 0 (docs/docker.md, "Several nodes").
two_nodes() {
    local subnet=10.89.37 rc=0
    podman network create --subnet "$subnet.0/24" "$NET" >/dev/null
    local node=(-e NNODES=2 -e NPROC=1 -e "RDZV_ENDPOINT=$subnet.10:29400" -e RDZV_ID=check
        -e GLOO_SOCKET_IFNAME=eth0 --network "$NET")
    # node 0 is kept after it exits (no --rm) so that its exit status and log can be read
    "${KEPT[@]}" -d --name attnres-node0 --ip "$subnet.10" "${node[@]}" -e NODE_RANK=0 \
        -e "LOCAL_ADDR=$subnet.10" "$IMAGE" launch torchrun "${SHORT[@]}" \
        output.run_dir=runs/docker-check/two-nodes >/dev/null
    "${RUN[@]}" --name attnres-node1 --ip "$subnet.11" "${node[@]}" -e NODE_RANK=1 \
        -e "LOCAL_ADDR=$subnet.11" "$IMAGE" launch torchrun "${SHORT[@]}" \
        output.run_dir=runs/docker-check/two-nodes || rc=$?
    echo "--- node 1 (exit $rc) ---"
    rc0=$(podman wait attnres-node0 2>/dev/null || echo 1)
    echo "--- node 0 (exit $rc0) ---"
    podman logs attnres-node0 2>&1 || true
    podman rm -f -i attnres-node0 >/dev/null 2>&1 || true
    podman network rm -f "$NET" >/dev/null 2>&1 || true
    ((rc == 0 && rc0 == 0))
}
check two-nodes "final validation" two_nodes

# The same 6 steps under deepspeed, mpirun and two nodes: the same losses, to the last bit.
if ((!FAILED)); then
    ds=$(losses deepspeed)
    if [[ $ds == "$(losses mpirun)" && $ds == "$(losses two-nodes)" ]]; then
        RESULTS+=("$(printf '%-14s ok' same-losses)")
        say "same-losses: ok: deepspeed, mpirun and two nodes: $ds"
    else
        FAILED=1
        RESULTS+=("$(printf '%-14s FAILED' same-losses)")
        say "same-losses: FAILED: deepspeed $ds; mpirun $(losses mpirun);" \
            "two nodes $(losses two-nodes)"
    fi
fi

TOTAL=$(($(date +%s) - T0))
{
    echo "image $IMAGE: $((SIZE / 1000000)) MB; base ${BASE_S} s; build ${BUILD_S} s; total ${TOTAL} s"
    printf '%s\n' "${RESULTS[@]}"
} | tee "$RUNS/summary.txt" | sed 's/^/docker-check: /'
((!FAILED)) || die "some checks failed (logs in runs/docker-check/)"
say "all checks passed in ${TOTAL} s"
