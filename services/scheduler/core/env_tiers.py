"""Environments on disk hold no node memory: the scheduler's side of environment tiering.

On a node whose idle environments hold no memory at all (the process backend: an environment
is a directory) the scheduler tiers them itself: an environment is booked while an action of
it runs, and unbooked as "on disk" when the last one ends (``idled``).

A CPU node agent may save an idle environment to disk and remove its container (plexrl §4.5);
its reports name those (``NodeReport.envs_on_disk``). The scheduler then books only running and
paused environments against the node's memory, so more trajectories fit on a node. An action
dispatched to an environment on disk books its memory again at once (the agent restores it
before the action runs). Environments on disk survive a restart of their node agent: the new
incarnation reports them and keeps them. A node reporting on disk an environment the scheduler
does not place there (ended meanwhile) is told to drop it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from services.scheduler.core.books import Dispatched, EnvPlacement, Node
from services.scheduler.core.effects import DropEnvOnNode, EnvChanged
from tangram.contract import NodeReport


def adopt(envs: Mapping[str, EnvPlacement], report: NodeReport) -> list[EnvChanged]:
    """Before a new incarnation's first report ends the old one's environments: those it kept
    on disk move to it (booked as resident, as the first report's other books are; ``sync``
    then unbooks them)."""
    moved: list[EnvChanged] = []
    for tid in report.envs_on_disk:
        env = envs.get(tid)
        if env is None or env.node_id != report.node_id or env.incarnation == report.incarnation:
            continue
        env.incarnation, env.on_disk = report.incarnation, False
        moved.append(
            EnvChanged(tid, env.job_id, env.node_id, env.incarnation, env.memory_mb, "active")
        )
    return moved


def sync(
    node: Node,
    envs: Mapping[str, EnvPlacement],
    report: NodeReport,
    running: Mapping[str, Dispatched],
) -> list[DropEnvOnNode]:
    """Book the memory of the node's environments by the tier its report says they are in.

    An environment with an action running or dispatched is resident whatever an older report
    says (its restore is under way)."""
    on_disk = set(report.envs_on_disk)
    if not node.idle_envs_hold_memory or (not on_disk and not node.on_disk):
        return []  # nothing tiered by the node (or the scheduler tiers it: idled)
    busy = {r.action.spec.trajectory_id for r in running.values() if r.node_id == node.node_id}
    for tid in on_disk | node.on_disk:  # what changes tier: O(environments on disk)
        env = envs.get(tid)
        if env is None or env.node_id != node.node_id or env.incarnation != node.incarnation:
            continue
        now_on_disk = tid in on_disk and tid not in busy
        if now_on_disk != env.on_disk:
            _tier(env, node, now_on_disk)
    return [
        DropEnvOnNode(node.node_id, tid)
        for tid in sorted(on_disk)
        if tid not in envs or envs[tid].node_id != node.node_id
    ]


def _tier(env: EnvPlacement, node: Node, on_disk: bool) -> None:
    env.on_disk = on_disk
    if on_disk:
        node.on_disk.add(env.trajectory_id)
    else:
        node.on_disk.discard(env.trajectory_id)
    node.reserved_mb += -env.memory_mb if on_disk else env.memory_mb


def idled(env: EnvPlacement | None, node: Node, runs: Iterable[Dispatched]) -> None:
    """An action of ``env`` ended (no longer among ``runs``). On a node whose idle
    environments hold no memory (``Inventory.idle_envs_hold_memory``: the process backend's
    is a directory), it is unbooked as if on disk unless another action of its trajectory runs
    there; its next action books it again (:func:`booked`). Booked while idle, a burst of new
    trajectories would end idle ones "under memory pressure" that freed nothing but their
    files."""
    if (
        env is None
        or node.idle_envs_hold_memory
        or env.on_disk
        or env.node_id != node.node_id
        or env.incarnation != node.incarnation
    ):
        return
    tid = env.trajectory_id
    if not any(r.node_id == node.node_id and r.action.spec.trajectory_id == tid for r in runs):
        _tier(env, node, True)


def booked(env: EnvPlacement, node: Node | None) -> None:
    """An action dispatched to an environment on disk: its memory is booked again now."""
    if env.on_disk and node is not None and node.incarnation == env.incarnation:
        _tier(env, node, False)


def released(env: EnvPlacement, node: Node) -> None:
    """An environment of ``node`` (this incarnation) ends: unbook what it holds."""
    if env.on_disk:
        node.on_disk.discard(env.trajectory_id)
    else:
        node.reserved_mb -= env.memory_mb
