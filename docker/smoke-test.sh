#!/usr/bin/env bash
# Build docker/Dockerfile unmodified with buildah, start the image's entrypoint, check /health and
# one completion, then remove everything this script made. Needs buildah, podman and mmdebstrap
# (apt-get install buildah podman mmdebstrap) and root; no Docker daemon.
#
# Where python:3.11-slim cannot be pulled (no registry access), a stand-in is built first from
# Debian 12 packages (its python3 is 3.11), trusting the host's CA bundle so that pip inside the
# build works behind the same TLS interception as the host.
#   docker/smoke-test.sh              # everything, about 2-4 minutes
#   SMOKE_KEEP_BASE=1 docker/smoke-test.sh   # keep the stand-in base for the next run
set -euo pipefail
cd "$(dirname "$0")/.."

BASE=docker.io/library/python:3.11-slim
IMAGE=localhost/vinoserve-smoke:$$
PORT=${SMOKE_PORT:-18500}
work=$(mktemp -d)
ctr="" server="" made_base=""
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
    if [ $status -eq 0 ]; then log "PASS"; else log "FAIL (status $status)"; [ -f "$work.log" ] && tail -40 "$work.log"; fi
    rm -f "$work.log"
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

log "starting the image's entrypoint on 127.0.0.1:$PORT"
ctr=$(buildah from --pull=never "$IMAGE")
# Its own process group, so that cleanup stops the server and everything buildah started for it.
setsid buildah run --isolation chroot --env VINOSERVE_PORT="$PORT" "$ctr" \
    vinoserve-entrypoint vinoserve serve --host 127.0.0.1 --port "$PORT" > "$work.log" 2>&1 &
server=$!

for _ in $(seq 240); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then break; fi
    if ! kill -0 "$server" 2>/dev/null; then log "the server exited"; exit 1; fi
    sleep 0.5
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { log "/health never answered 200"; exit 1; }
log "/health is 200"

reply=$(curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'content-type: application/json' \
    -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": true}')
echo "$reply" | python3 -c '
import json, sys
r = json.load(sys.stdin)
assert r["usage"]["completion_tokens"] == 8 and r["choices"][0]["finish_reason"] == "length", r
print("completion:", repr(r["choices"][0]["text"]))'
if grep -q Traceback "$work.log"; then log "traceback in the server log"; exit 1; fi
# Which matmuls the decode model runs (where the CPU class takes one): the image carries the
# low-bit kernel built at its build time, since it has no compiler to build one at start.
grep -m1 "KV cache:" "$work.log" | sed 's/^/server: /' >&2 || true
if grep -q "no C++ compiler" "$work.log"; then log "the image lacks its prebuilt low-bit kernel"; exit 1; fi
