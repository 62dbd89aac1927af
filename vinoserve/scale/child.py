"""A supervised process: `python -m vinoserve.scale.child [--cpus 0,1] MODULE ARGS...` pins itself
to its cores before anything starts a thread (OpenVINO's pool inherits the mask, and memory it
first touches lands on those cores' NUMA node), asks the kernel to end it when the supervisor dies,
then runs MODULE as `python -m MODULE ARGS...` would."""
from __future__ import annotations

import ctypes
import json
import os
import runpy
import signal
import sys

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the supervisor's own SIGTERM handling remains
        return
    if os.getppid() != parent:  # the supervisor died before prctl took effect
        sys.exit(1)


def main(argv: list[str]) -> None:
    parent = int(os.environ.pop("VINOSERVE_SUPERVISOR_PID", os.getppid()))
    if argv[:1] == ["--cpus"]:
        os.sched_setaffinity(0, {int(c) for c in argv[1].split(",")})
        argv = argv[2:]
    _die_with_parent(parent)
    # Secrets come through the environment, so they never show in `ps` (a process's command line
    # is world-readable, its environment is not).
    secret = json.loads(os.environ.pop("VINOSERVE_CHILD_SECRET_ARGS", "[]"))
    module, *args = argv
    sys.argv = [module, *args, *secret]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
