#!/usr/bin/env bash
# Build docker/Dockerfile unmodified with buildah, start the image's entrypoint twice, with the
# image's own /data (the model it preloaded) and with an empty volume over /data (a fresh Kubernetes
# PVC: the model is fetched), check /health and one completion each time and that the low-bit kernel
# the image built runs where the CPU has it, then remove everything this script made. Needs buildah,
# podman and mmdebstrap (apt-get install buildah podman mmdebstrap) and root; no Docker daemon.
#
# Where python:3.11-slim cannot be pulled (no registry access), a stand-in is built first from
# Debian 12 packages (its python3 is 3.11), trusting the host's CA bundle so that pip inside the
# build works behind the same TLS interception as the host.
#   docker/smoke-test.sh              # everything, about 3-5 minutes
#   SMOKE_KEEP_BASE=1 docker/smoke-test.sh   # keep the stand-in base for the next run
set -euo pipefail
cd "$(dirname "$0")/.."

BASE=docker.io/library/python:3.11-slim
IMAGE=localhost/vinoserve-smoke:$$
PORT=${SMOKE_PORT:-18500}
work=$(mktemp -d)
ctr="" server="" made_base="" server_log=""
start=$(date +%s)

log() { echo "smoke-test [$(( $(date +%s) - start ))s]: $*" >&2; }

cleanup() {
    status=$?
    if [ -n "$server" ]; then kill -TERM -- "-$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; fi
    if [ -n "$ctr" ]; then buildah rm "$ctr" >/dev/null 2>&1 || true; fi
    buildah rmi "$IMAGE" >/dev/null 2>&1 || true
    buildah rmi --prune >/dev/null 2>&1 || true  # the build stage's intermediate image
    if [ -n "$made_base" ] && [ -z "${SMOKE_KEEP_BASE:-}" ]; then
        buildah rmi "$BASE" localhost/debian-py-raw >/dev/null 2>&1 || true
    fi
    rm -rf "$work"
    if [ $status -eq 0 ]; then log "PASS"; else log "FAIL (status $status)"; [ -f "$server_log" ] && tail -40 "$server_log"; fi
    rm -f "$work".*.log
}
trap cleanup EXIT

if ! buildah inspect --type image "$BASE" >/dev/null 2>&1; then
    log "no $BASE here: building a stand-in from Debian 12 (python3 3.11)"
    mmdebstrap --quiet --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates \
        bookworm "$work/base.tar"
    podman import --quiet "$work/base.tar" localhost/debian-py-raw >/dev/null
    cp /etc/ssl/certs/ca-certificates.crt "$work/host-ca.crt"
    cat > "$work/standin.Dockerfile" <<'D'
FROM localhost/debian-py-raw
COPY host-ca.crt /etc/ssl/certs/ca-certificates.crt
RUN ln -sf /usr/bin/python3 /usr/local/bin/python && ln -sf /usr/bin/pip3 /usr/local/bin/pip \
 && rm -f /usr/lib/python3*/EXTERNALLY-MANAGED
D
    buildah bud --quiet --isolation chroot -f "$work/standin.Dockerfile" -t "$BASE" "$work" >/dev/null
    made_base=1
fi

log "building docker/Dockerfile"
buildah bud --quiet --pull=never --isolation chroot -f docker/Dockerfile -t "$IMAGE" . >/dev/null

# serve NAME [buildah run options]: the image's entrypoint on 127.0.0.1:$PORT until /health is 200
# (a first start with an empty /data fetches and converts the model), one completion, then stopped;
# the server's output in $work.NAME.log.
serve() {
    local name=$1; shift
    server_log="$work.$name.log"
    log "$name: starting the image's entrypoint on 127.0.0.1:$PORT"
    # Its own process group, so that stopping it stops everything buildah started for it.
    setsid buildah run --isolation chroot --env VINOSERVE_PORT="$PORT" "$@" "$ctr" \
        vinoserve-entrypoint vinoserve serve --host 127.0.0.1 --port "$PORT" > "$server_log" 2>&1 &
    server=$!
    for _ in $(seq 600); do
        if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then break; fi
        if ! kill -0 "$server" 2>/dev/null; then log "$name: the server exited"; exit 1; fi
        sleep 0.5
    done
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { log "$name: /health never answered 200"; exit 1; }
    log "$name: /health is 200"
    reply=$(curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'content-type: application/json' \
        -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": true}')
    echo "$reply" | python3 -c '
import json, sys
r = json.load(sys.stdin)
assert r["usage"]["completion_tokens"] == 8 and r["choices"][0]["finish_reason"] == "length", r
print("completion:", repr(r["choices"][0]["text"]))'
    kill -TERM -- "-$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
    server=""
    if grep -q Traceback "$server_log"; then log "$name: traceback in the server log"; exit 1; fi
    # Which matmuls the model runs: the startup line names the low-bit kernel where it runs.
    grep -m1 "KV cache:" "$server_log" | sed "s/^/$name: server: /" >&2 || true
}

# kernel_runs NAME: where the CPU class's defaults put matmuls on the low-bit kernel, the server's
# startup line says they run on it.
kernel_runs() {
    if [[ $kernel == *" default" ]] && ! grep -q "matmuls on vinoserve's low-bit kernel" "$work.$1.log"; then
        log "$1: the server does not run the low-bit kernel"; exit 1
    fi
}

ctr=$(buildah from --pull=never "$IMAGE")
# First as `docker run` without -v: buildah run gives the image's VOLUME /data a copy of what the
# image holds there (the model it preloaded).
serve image-data

# Then a fresh volume over /data, writable by the image's user as a PVC with fsGroup 10001 is.
# buildah run would mount its copy over it while the container declares the VOLUME: undeclared here.
buildah config --volume /data- "$ctr"
mkdir "$work/data" && chown 10001 "$work/data"
empty=(--volume "$work/data:/data")
# Where this CPU runs a path of the kernel: the image's prebuilt library, found with nothing in /data
# and no compiler in the image; and whether the CPU class's defaults put matmuls on it (cpu_defaults.py).
kernel=$(buildah run --isolation chroot "${empty[@]}" "$ctr" python -c '
import os
from vinoserve.model.cpu_class import cpu_flags, this_cpu
from vinoserve.model.cpu_defaults import DEFAULTS
from vinoserve.model.lowbit import build
if build.NEEDED_FLAGS <= cpu_flags():
    path = build.library()  # raises Unavailable where the image lacks its library
    assert path.is_relative_to(os.environ["VINOSERVE_KERNEL_DIR"]), f"{path} is not one the image built"
    row = DEFAULTS[this_cpu()]
    print(path, "default" if row.lowbit_main or row.decode_model else "asked-for")
') || { log "the image has no low-bit kernel this CPU can run"; exit 1; }
log "low-bit kernel: ${kernel:-none: this CPU lacks the instructions of every path}"
kernel_runs image-data
serve empty-data "${empty[@]}"
kernel_runs empty-data
# and the volume, not the image's /data, got the model the server fetched
[ -n "$(ls -A "$work/data/cache/converted" 2>/dev/null)" ] || { log "empty-data: nothing converted into the volume"; exit 1; }
