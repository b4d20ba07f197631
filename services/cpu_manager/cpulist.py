"""The one core-list format of the node: the kernel's cpulist, e.g. ``0-3,8,10-11``.

Used wherever a set of cores is written as text: the ``TANGRAM_CORES`` variable every action
sees (both backends), ``TANGRAM_CPU_CORES`` (the cores a node offers), cgroup ``cpuset.cpus``
and ``docker update --cpuset-cpus``. It is what ``taskset -c``, ``numactl --physcpubind`` and
``/proc/self/status`` (``Cpus_allowed_list``) speak, so an action can pass it on unchanged.
Ranges are ascending and maximal; a single core is just its number (``5``).
"""

from __future__ import annotations

from collections.abc import Iterable


def parse_cpulist(text: str) -> frozenset[int]:
    """Parse a kernel cpulist such as ``0-3,8,10-11`` (blanks and empty items ignored)."""
    cores: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(cores)


def format_cpulist(cores: Iterable[int]) -> str:
    """Format cores as a compact kernel cpulist (``0-3,8``)."""
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
