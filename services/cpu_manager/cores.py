"""Which cores an action runs on: NUMA-local choice and the one-action-per-core ledger (§5.2)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path


def parse_cpulist(text: str) -> frozenset[int]:
    """Parse a kernel cpu list such as ``0-3,8,10-11``."""
    cores: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(cores)


def format_cpulist(cores: Iterable[int]) -> str:
    """Format cores as a compact kernel cpu list (``0-3,8``)."""
    ordered = sorted(set(cores))
    runs: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(runs)


def numa_nodes(sys_root: Path = Path("/sys/devices/system/node")) -> list[frozenset[int]]:
    """The cores of each NUMA node; one node with every online core when sysfs says nothing."""
    nodes = [
        parse_cpulist((d / "cpulist").read_text())
        for d in sorted(sys_root.glob("node[0-9]*"), key=lambda p: int(p.name[4:]))
        if (d / "cpulist").is_file()
    ]
    nodes = [n for n in nodes if n]
    if nodes:
        return nodes
    online = Path("/sys/devices/system/cpu/online")
    return [parse_cpulist(online.read_text())] if online.is_file() else []


def choose_cores(
    free: Iterable[int], n: int, nodes: Sequence[frozenset[int]]
) -> tuple[int, ...] | None:
    """Pick ``n`` free cores, all on one NUMA node when any node can hold them.

    Best fit among nodes that can (fewest free cores left over) keeps large holes for large
    actions; otherwise spill across nodes, fullest-free first. None if not enough free cores.
    """
    free_set = set(free)
    if n < 1 or len(free_set) < n:
        return None
    per_node = [sorted(free_set & node) for node in nodes]
    unplaced = sorted(free_set - set().union(*nodes)) if nodes else sorted(free_set)
    fitting = [cores for cores in per_node if len(cores) >= n]
    if fitting:
        return tuple(min(fitting, key=len)[:n])
    picked: list[int] = []
    for cores in [*sorted(per_node, key=len, reverse=True), unplaced]:
        picked.extend(cores[: n - len(picked)])
    return tuple(sorted(picked))


class CoreLedger:
    """Which action holds which core on this node; refuses to share a core."""

    def __init__(self) -> None:
        self._owner: dict[int, str] = {}
        self._held: dict[str, tuple[int, ...]] = {}

    def claim(self, action_id: str, cores: Sequence[int]) -> list[int]:
        """Take ``cores`` for ``action_id``; returns cores held by others (then none is taken)."""
        busy = sorted(c for c in cores if self._owner.get(c, action_id) != action_id)
        if busy:
            return busy
        for core in cores:
            self._owner[core] = action_id
        self._held[action_id] = tuple(cores)
        return []

    def release(self, action_id: str) -> None:
        """Give back whatever ``action_id`` holds (idempotent)."""
        for core in self._held.pop(action_id, ()):
            if self._owner.get(core) == action_id:
                del self._owner[core]

    def busy(self) -> frozenset[int]:
        """Cores held right now."""
        return frozenset(self._owner)
