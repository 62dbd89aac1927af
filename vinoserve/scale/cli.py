"""`vinoserve serve --replicas N`: the flags of the scale-out layer, added to `serve`'s."""
from __future__ import annotations

import argparse

from vinoserve.scale.router import POLICIES


def add_scale_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=1,
                   help="engine processes, each pinned to its own share of the cores (its own NUMA node where "
                        "there are several), behind SGLang's router on --host/--port (pip install "
                        "'vinoserve[scale]'); 1 (default): this process serves alone")
    p.add_argument("--router-policy", choices=tuple(POLICIES), default="cache-aware",
                   help="with --replicas: how the router picks a replica (default: cache-aware, the one that "
                        "holds the longest prefix of the request)")
