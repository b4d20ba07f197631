"""CPU time of process trees, from /proc/PID/stat, for CPU-per-action figures.

A tree's CPU over a window is measured exactly, short-lived members included: every member's own
time (utime+stime) plus every member's reaped-children time (cutime+cstime). A process that exits
inside the window moves from the first sum into its reaper's second sum, so the delta counts it
once; one born and gone inside the window shows up only in its reaper's. Only orphans reparented
to init are lost (none in the mesh: each service reaps what it forks).
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass

TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Stat:
    ppid: int
    own: int  # utime + stime, clock ticks
    reaped: int  # cutime + cstime: children that exited and were waited for


@dataclass(frozen=True)
class Root:
    """A process to follow: its own CPU counts to ``own_group``, its tree's to ``below_group``."""

    pid: int
    own_group: str
    below_group: str


def read_stat(pid: int) -> Stat | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None  # gone between listing and reading
    # the command name may hold spaces and ')': fields start after the last ')'
    f = raw[raw.rindex(b")") + 2 :].split()
    return Stat(ppid=int(f[1]), own=int(f[11]) + int(f[12]), reaped=int(f[13]) + int(f[14]))


def scan() -> dict[int, Stat]:
    """Every process on the machine, by pid."""
    table: dict[int, Stat] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := read_stat(int(name))) is not None:
            table[int(name)] = st
    return table


def descendants(table: dict[int, Stat], root: int) -> list[int]:
    children: dict[int, list[int]] = defaultdict(list)
    for pid, st in table.items():
        children[st.ppid].append(pid)
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def tree_ticks(table: dict[int, Stat], root: int) -> tuple[int, int]:
    """(the root's own ticks, ticks of everything below it, reaped ones included)."""
    me = table.get(root)
    if me is None:
        return 0, 0
    below = descendants(table, root)
    return me.own, me.reaped + sum(table[p].own + table[p].reaped for p in below)


def snapshot(roots: list[Root], table: dict[int, Stat] | None = None) -> dict[str, float]:
    """CPU ms so far per group, over the trees of ``roots`` (groups may repeat: they add)."""
    table = scan() if table is None else table
    ms: dict[str, float] = defaultdict(float)
    for r in roots:
        own, below = tree_ticks(table, r.pid)
        ms[r.own_group] += own * TICK_MS
        ms[r.below_group] += below * TICK_MS
    return dict(ms)


def self_ms() -> float:
    """This process's own CPU ms (the bench client), finer than clock ticks where possible."""
    t = os.times()
    return 1000.0 * (t.user + t.system)


def per_action(
    before: dict[str, float], after: dict[str, float], actions: int
) -> dict[str, float | None]:
    """CPU ms per action per group, and their sum."""
    if actions <= 0:
        return {k: None for k in after}
    out = {k: round((after[k] - before.get(k, 0.0)) / actions, 3) for k in after}
    out["sum"] = round(sum(v for v in out.values()), 3)
    return dict(out)


def pids_ms(
    before: dict[int, Stat], after: dict[int, Stat], owner: dict[int, str]
) -> dict[str, float]:
    """CPU ms per owner over pids alive at the end (e.g. Postgres backends by client); one
    absent at the start was born inside the window."""
    ms: dict[str, float] = defaultdict(float)
    for pid, who in owner.items():
        if pid in after:
            start = before[pid].own if pid in before else 0
            ms[who] += (after[pid].own - start) * TICK_MS
    return dict(ms)


def machine_busy_ms() -> float:
    """CPU ms spent by the whole machine so far, all cores (not idle, not iowait): set against
    the sum of the groups, it tells whether something outside the bench ran meanwhile."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]  # user .. steal
    return (sum(ticks) - ticks[3] - ticks[4]) * TICK_MS
