"""Pure rules about what nodes can ever hold: impossible requests and memory reclaim.

Kept apart from the core's bookkeeping: each takes plain records and returns a decision.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from services.scheduler.core.books import EnvPlacement, Node
from tangram.contract import UnifiedAction


def impossible(act: UnifiedAction, nodes: Sequence[Node], home: Node | None) -> str | None:
    """Why no live node can ever run ``act`` (None: one could, once busy nodes free up).

    With no live node nothing is decided (nodes may be starting). ``home`` is the node its
    trajectory's environment lives on: the action can only ever run there."""
    cores = act.demands[0].min
    if home is not None:
        if cores <= home.capacity:
            return None
        return (
            f"no node can hold it: it asks for {cores} cores; its trajectory's environment "
            f"is on node {home.node_id}, which has {home.capacity}"
        )
    if not nodes:
        return None
    big = max(nodes, key=lambda n: (n.capacity, n.memory_mb))
    roomy = max(nodes, key=lambda n: n.memory_mb)
    if cores > big.capacity:
        return (
            f"no node can hold it: it asks for {cores} cores; the largest live node, "
            f"{big.node_id}, has {big.capacity}"
        )
    if act.env_memory_mb > roomy.memory_mb:
        return (
            f"no node can hold it: its environment asks for {act.env_memory_mb} MiB; "
            "the largest live node, "
            f"{roomy.node_id}, has {roomy.memory_mb} MiB"
        )
    return None


def reclaim_plan(
    need_mb: int, idle: Sequence[EnvPlacement], free_mb: Mapping[str, int]
) -> list[EnvPlacement]:
    """The idle environments to end, oldest first and all on one node, so that a new
    environment of ``need_mb`` fits there; empty when one already fits or none can be made to.

    The node chosen is the one where the fewest (oldest-first) environments must go."""
    if any(mb >= need_mb for mb in free_mb.values()):
        return []
    best: list[EnvPlacement] | None = None
    for node_id, mb in free_mb.items():
        picked = _oldest_until(need_mb - mb, [e for e in idle if e.node_id == node_id])
        if picked is not None and (best is None or len(picked) < len(best)):
            best = picked
    return best or []


def _oldest_until(short_mb: int, envs: Sequence[EnvPlacement]) -> list[EnvPlacement] | None:
    picked: list[EnvPlacement] = []
    for env in sorted(envs, key=lambda e: e.last_used):
        if short_mb <= 0:
            break
        picked.append(env)
        short_mb -= env.memory_mb
    return picked if short_mb <= 0 else None
