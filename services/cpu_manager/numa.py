"""Reading the node's NUMA layout from sysfs (which cores sit on which NUMA node)."""

from __future__ import annotations

from pathlib import Path

from services.cpu_manager.cpulist import parse_cpulist

SYS_NODES = Path("/sys/devices/system/node")


def numa_layout(allowed: set[int], sys_nodes: Path = SYS_NODES) -> dict[int, tuple[int, ...]]:
    """NUMA node -> allowed cores; one node 0 when the kernel exposes no NUMA topology (or
    some allowed core is on no node it lists)."""
    layout: dict[int, tuple[int, ...]] = {}
    for d in sorted(sys_nodes.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        cores = sorted(parse_cpulist((d / "cpulist").read_text()) & allowed)
        if cores:
            layout[int(d.name[4:])] = tuple(cores)
    placed = {c for cs in layout.values() for c in cs}
    if not layout or placed != allowed:
        return {0: tuple(sorted(allowed))}
    return layout
