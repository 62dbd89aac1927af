"""How `--replicas` shares the cores out: whole physical cores, NUMA nodes kept apart, read from a
sysfs tree laid out here; and the command line each replica runs."""
from __future__ import annotations

import pytest

import json

from sglang_router.launch_router import parse_router_args

from vinoserve.cli import build_parser
from vinoserve.scale.router import Router
from vinoserve.scale.supervisor import replica_command
from vinoserve.scale.topology import Share, parse_cpulist, physical_cores, plan_shares


def _sysfs(root, nodes: dict[int, str], siblings: dict[int, str]):
    for node, cpulist in nodes.items():
        (root / f"node/node{node}").mkdir(parents=True)
        (root / f"node/node{node}/cpulist").write_text(cpulist + "\n")
    for cpu, sib in siblings.items():
        (root / f"cpu/cpu{cpu}/topology").mkdir(parents=True)
        (root / f"cpu/cpu{cpu}/topology/thread_siblings_list").write_text(sib + "\n")
    return root


@pytest.fixture
def two_sockets(tmp_path):
    """2 NUMA nodes x 4 cores x 2 hyperthreads, numbered as Intel does (cpu i and i+8 share a core)."""
    return _sysfs(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15"}, {i: f"{i % 8},{i % 8 + 8}" for i in range(16)})


def test_parse_cpulist():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("") == []


def test_one_replica_per_numa_node_with_whole_cores(two_sockets):
    cores = physical_cores(set(range(16)), two_sockets)
    assert len(cores) == 8 and cores[0] == (0, (0, 8)) and cores[4] == (1, (4, 12))
    assert plan_shares(2, cores) == [Share((0, 8, 1, 9, 2, 10, 3, 11), 4, 0), Share((4, 12, 5, 13, 6, 14, 7, 15), 4, 1)]
    four = plan_shares(4, cores)
    assert [s.node for s in four] == [0, 0, 1, 1] and all(s.threads == 2 for s in four)


def test_uneven_shares_and_too_many_replicas(two_sockets):
    cores = physical_cores(set(range(16)), two_sockets)
    assert [s.threads for s in plan_shares(3, cores)] == [3, 3, 2]
    assert sorted(c for s in plan_shares(3, cores) for c in s.cpus) == list(range(16))
    with pytest.raises(ValueError, match="--replicas 9 needs at least 9 physical cores; this process may use 8"):
        plan_shares(9, cores)


def test_affinity_mask_limits_the_cores(two_sockets):
    """A container's cpuset: only the CPUs this process may run on are shared out."""
    cores = physical_cores({0, 8, 5, 13}, two_sockets)
    assert plan_shares(2, cores) == [Share((0, 8), 1, 0), Share((5, 13), 1, 1)]


def test_without_sysfs_every_cpu_is_a_core(tmp_path):
    assert plan_shares(2, physical_cores({0, 1}, tmp_path)) == [Share((0,), 1, 0), Share((1,), 1, 0)]


def test_a_replica_keeps_the_users_flags_and_gets_its_own():
    argv = ["serve", "--max-num-seqs", "8", "--host", "0.0.0.0", "--port", "9000", "--replicas", "2",
            "--api-key", "k", "--threads", "16"]
    cmd = replica_command(argv, Share((2, 3), 2, 0), 41234, 2)
    assert cmd[1:5] == ["-m", "vinoserve.scale.child", "--cpus", "2,3"]
    args = build_parser().parse_args(cmd[cmd.index("vinoserve.cli") + 1:])
    assert (args.host, args.port, args.threads, args.replicas) == ("127.0.0.1", 41234, 2, 1)
    assert (args.max_num_seqs, args.api_key) == (8, "k")


def test_the_router_command_parses_with_the_routers_own_parser():
    router = Router("0.0.0.0", 9000, "round-robin", 9001, 30.0)
    cmd = router.command()
    assert cmd[1:4] == ["-m", "vinoserve.scale.child", "sglang_router.launch_router"]
    assert router.admin_key not in " ".join(cmd)  # it travels in the environment, not on `ps`
    args = parse_router_args(cmd[4:] + json.loads(router.secret_env()["VINOSERVE_CHILD_SECRET_ARGS"]))
    assert (args.host, args.port, args.policy, args.prometheus_host) == ("0.0.0.0", 9000, "round_robin", "127.0.0.1")
    ((key_id, _, key, role),) = args.control_plane_api_keys
    assert (key_id, role, key) == ("vinoserve", "admin", router.admin_key)
