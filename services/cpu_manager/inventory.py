"""What a node has: its cores grouped by NUMA node, and its memory (read from /sys and /proc)."""

from __future__ import annotations

import os

import psutil

from services.cpu_manager.cpulist import parse_cpulist
from services.cpu_manager.numa import numa_layout
from tangram.contract import Inventory, NumaCores


def read(backend: str, isolates: bool, cores: str = "", memory_mb: int = 0) -> Inventory:
    """This node's inventory; ``cores`` (a cpulist) and ``memory_mb`` override what is found."""
    allowed = set(parse_cpulist(cores)) if cores else set(os.sched_getaffinity(0))
    mem = memory_mb or psutil.virtual_memory().total // (1024 * 1024)
    layout = numa_layout(allowed)
    return Inventory(
        numa=tuple(NumaCores(numa_node=n, cores=cs) for n, cs in sorted(layout.items())),
        memory_mb=int(mem),
        backend=backend,
        isolates=isolates,
        # a process-backend environment is a directory: idle, it holds no memory (a Docker
        # one is a container, paused or saved to disk by the backend's own tiers)
        idle_envs_hold_memory=backend != "process",
    )
