#!/bin/sh
# Size OpenVINO's thread pool to the container's CPU limit, not the host's core count:
# more threads than the CFS quota allows only adds throttling.
set -e
cgroup="${CGROUP_ROOT:-/sys/fs/cgroup}"
if [ -z "${VINOSERVE_THREADS:-}" ]; then
    limit=""
    if [ -r "$cgroup/cpu.max" ]; then  # cgroup v2: "<quota> <period>" or "max <period>"
        read -r quota period < "$cgroup/cpu.max"
        if [ "$quota" != "max" ]; then limit=$(( (quota + period - 1) / period )); fi
    elif [ -r "$cgroup/cpu/cpu.cfs_quota_us" ]; then  # cgroup v1
        quota=$(cat "$cgroup/cpu/cpu.cfs_quota_us")
        period=$(cat "$cgroup/cpu/cpu.cfs_period_us")
        if [ "$quota" -gt 0 ]; then limit=$(( (quota + period - 1) / period )); fi
    fi
    if [ -n "$limit" ] && [ "$limit" -gt 0 ]; then
        export VINOSERVE_THREADS="$limit"
    fi
fi
exec "$@"
