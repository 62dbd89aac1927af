"""How much memory this process may still take: the host's free memory, capped by the cgroup
(v1 or v2) memory limit it runs under, so that `docker run --memory 2g` sizes the default KV cache
from 2 GB and not from the host's RAM."""
from __future__ import annotations

import ctypes
import gc
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def host_free_bytes() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def available_memory_bytes(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup"),
                           host_free: int | None = None) -> int:
    """The smaller of the host's free memory and what the tightest enclosing cgroup limit leaves."""
    host = host_free_bytes() if host_free is None else host_free
    room = cgroup_room_bytes(cgroup_root, proc_cgroup)
    return host if room is None else max(0, min(host, room))


def reclaimable_room_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """What this process could take if the kernel evicted every cache it can: the host's
    MemAvailable (free memory plus reclaimable page cache), capped by the cgroup's room."""
    kib = _proc_kib(meminfo, "MemAvailable")
    return available_memory_bytes(host_free=host_free_bytes() if kib is None else kib * 1024)


def anonymous_bytes() -> int:
    """This process' anonymous resident memory (RssAnon: not file pages); 0 where /proc cannot tell."""
    return (_proc_kib(Path("/proc/self/status"), "RssAnon") or 0) * 1024


def _proc_kib(path: Path, key: str) -> int | None:
    """A "Key:   N kB" line's N in a /proc file; None where it cannot be read."""
    try:
        line = next(l for l in path.read_text().splitlines() if l.startswith(f"{key}:"))
        return int(line.split()[1])
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def resident_bytes() -> int:
    """This process' resident memory (VmRSS); 0 where /proc cannot tell."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def release_freed_heap() -> None:
    """Give memory freed after a load back to the OS. glibc raises its mmap threshold to the
    largest block freed (up to 32 MB), so after one large temporary the next ones land on the heap
    and stay resident once freed: loading a 1.5B model whose decode model repacks its weights
    (model/lowbit) left 390 MiB of them, half of it out of reach once compiling had filled the
    heap around them (so the repacking trims too). Cycles are collected first: some of the
    load's temporaries are held by them. The trim is a no-op without glibc."""
    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def memory_limit_bytes(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """The host's physical memory, or the tightest cgroup limit over this process if smaller."""
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    room = cgroup_room_bytes(cgroup_root, proc_cgroup, limits_only=True)
    return host if room is None else min(host, room)


def cgroup_room_bytes(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup"),
                      limits_only: bool = False) -> int | None:
    """Limit minus working set (usage less reclaimable inactive file cache, as the kubelet counts
    it) of this process's memory cgroup and each ancestor, the least of them; None without a limit.
    `limits_only`: the least limit, usage not subtracted."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and controllers == "":  # cgroup v2's unified hierarchy
            rooms += _rooms(cgroup_root, path, "memory.max", "memory.current", "inactive_file", limits_only)
        elif "memory" in controllers.split(","):  # cgroup v1's memory controller
            rooms += _rooms(cgroup_root / "memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes",
                            "total_inactive_file", limits_only)
    return min(rooms) if rooms else None


def _rooms(mount: Path, path: str, limit_file: str, usage_file: str, inactive_key: str,
           limits_only: bool = False) -> list[int]:
    """Room left in each cgroup from `path` up to the mount. Inside a container the mount is the
    container's own cgroup while /proc names the host's path, so the mount itself is read too."""
    dirs, current = [], Path(path.strip() or "/")
    while True:
        d = mount / str(current).lstrip("/")
        if d.is_dir() and d not in dirs:
            dirs.append(d)
        if current == current.parent:
            break
        current = current.parent
    rooms = []
    for d in dirs:
        limit = _read_int(d / limit_file)
        if limit is None or limit >= 2**60:  # "max", or v1's "unlimited" (a page-rounded 2**63)
            continue
        if limits_only:
            rooms.append(limit)
            continue
        usage = _read_int(d / usage_file) or 0
        rooms.append(limit - max(0, usage - _stat(d / "memory.stat", inactive_key)))
    return rooms


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0
