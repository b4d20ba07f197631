"""What a node has: its cores grouped by NUMA node, and its memory (read from /sys and /proc)."""

from __future__ import annotations

import os
from pathlib import Path

import psutil

from tangram.contract import Inventory, NumaCores

SYS_NODES = Path("/sys/devices/system/node")


def parse_cpulist(text: str) -> list[int]:
    """Parse a kernel cpulist such as ``0-3,8,10-11``."""
    cores: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def numa_layout(allowed: set[int], sys_nodes: Path = SYS_NODES) -> dict[int, tuple[int, ...]]:
    """NUMA node -> allowed cores; one node 0 when the kernel exposes no NUMA topology."""
    layout: dict[int, tuple[int, ...]] = {}
    for d in sorted(sys_nodes.glob("node[0-9]*")):
        cores = [c for c in parse_cpulist((d / "cpulist").read_text()) if c in allowed]
        if cores:
            layout[int(d.name[4:])] = tuple(cores)
    placed = {c for cs in layout.values() for c in cs}
    if not layout or placed != allowed:
        return {0: tuple(sorted(allowed))}
    return layout


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
    )
