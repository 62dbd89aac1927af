"""Which cores each replica gets: whole physical cores, one NUMA node's where the machine has
several, read from sysfs and this process's affinity mask (a container's cpuset included)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SYS = Path("/sys/devices/system")


@dataclass(frozen=True)
class Share:
    """One replica's cores: the logical CPUs it is pinned to and the inference threads it runs
    (one per physical core: hyperthread siblings share a core's vector units)."""

    cpus: tuple[int, ...]
    threads: int
    node: int


def parse_cpulist(text: str) -> list[int]:
    """sysfs's "0-3,8,10-11" form."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def physical_cores(allowed: set[int], root: Path = SYS) -> list[tuple[int, tuple[int, ...]]]:
    """(NUMA node, logical CPUs of one physical core) for every core this process may run on,
    in node order. Without sysfs every CPU is its own core on node 0."""
    node_of = {}
    for node_dir in sorted(root.glob("node/node[0-9]*"), key=lambda p: int(p.name[4:])):
        for cpu in parse_cpulist(_read(node_dir / "cpulist") or ""):
            node_of[cpu] = int(node_dir.name[4:])
    cores: dict[tuple[int, str], list[int]] = {}
    for cpu in sorted(allowed):
        siblings = _read(root / f"cpu/cpu{cpu}/topology/thread_siblings_list")
        key = (node_of.get(cpu, 0), siblings.strip() if siblings else str(cpu))
        cores.setdefault(key, []).append(cpu)
    return sorted(((node, tuple(cpus)) for (node, _), cpus in cores.items()), key=lambda c: (c[0], c[1][0]))


def plan_shares(replicas: int, cores: list[tuple[int, tuple[int, ...]]]) -> list[Share]:
    """Contiguous runs of cores in node order, as equal as they divide: when the replica count is
    a multiple of the node count (and nodes are the same size), no replica spans two nodes."""
    if replicas > len(cores):
        raise ValueError(f"--replicas {replicas} needs at least {replicas} physical cores; this process may use "
                         f"{len(cores)} (each replica gets whole cores of its own)")
    shares, start = [], 0
    for i in range(replicas):
        size = len(cores) // replicas + (i < len(cores) % replicas)
        mine = cores[start:start + size]
        start += size
        nodes = [node for node, _ in mine]
        shares.append(Share(tuple(c for _, cpus in mine for c in cpus), len(mine), max(set(nodes), key=nodes.count)))
    return shares


def shares_for(replicas: int) -> list[Share]:
    return plan_shares(replicas, physical_cores(os.sched_getaffinity(0)))
