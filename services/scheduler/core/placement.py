"""Which concrete cores an action gets: NUMA-local first (§5.2 "Pool"), best fit, deterministic."""

from __future__ import annotations

from collections.abc import Mapping


def pick_cores(free: set[int], numa: Mapping[int, tuple[int, ...]], n: int) -> tuple[int, ...]:
    """Choose ``n`` free cores, inside one NUMA node when any can hold them.

    Among NUMA nodes that can hold all ``n``, the one with the fewest free cores wins (best
    fit keeps large NUMA-local blocks for large actions). Otherwise cores are taken from the
    NUMA nodes with the most free cores first, so the action spans as few nodes as possible.
    """
    if n > len(free):
        raise ValueError(f"asked for {n} cores, {len(free)} free")
    per_numa = {node: sorted(c for c in cores if c in free) for node, cores in numa.items()}
    fitting = [(len(cs), node) for node, cs in per_numa.items() if len(cs) >= n]
    if fitting:
        _, node = min(fitting)
        return tuple(per_numa[node][:n])
    chosen: list[int] = []
    for node in sorted(per_numa, key=lambda k: (-len(per_numa[k]), k)):
        chosen.extend(per_numa[node][: n - len(chosen)])
        if len(chosen) == n:
            break
    return tuple(sorted(chosen))
