"""Co-batching's books (pure): which busy GPU chunk runs which service variant and how many
calls share it, which GPUs some call still holds, and the groups the policy grants as one.

See the module docstring of ``gpu_sched`` for the rules; this module only reads the core's
running and killed calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from services.scheduler.core.books import Dispatched, Node
from services.scheduler.core.gpu import Shared
from tangram.contract import InferAction, UnifiedAction

GPU = "gpu"
ChunkKey = tuple[str, tuple[int, ...]]  # (node, GPU indices)
Group = list[UnifiedAction]  # calls of one service the policy grants one chunk


def service_of(act: UnifiedAction) -> str:
    return act.spec.action.service if isinstance(act.spec.action, InferAction) else ""


def occupancy(
    running: Iterable[Dispatched], killed: Iterable[Dispatched], nodes: dict[str, Node]
) -> dict[ChunkKey, Shared]:
    """What each busy chunk of a known node runs, from its running calls (and the cancelled
    ones whose end the node has not confirmed: those close the chunk to new calls)."""
    out: dict[ChunkKey, Shared] = {}
    runs = [(r, False) for r in running] + [(r, True) for r in killed]
    for run, cancelled in runs:
        node = nodes.get(run.node_id)
        if run.action.key_resource != GPU or node is None or node.incarnation != run.incarnation:
            continue
        shared = out.setdefault(
            (run.node_id, run.cores), Shared(service_of(run.action), len(run.cores))
        )
        shared.calls += 1
        shared.closed |= cancelled or run.kill_by is not None
    return out


def held(runs: Iterable[Dispatched], node: Node) -> set[int]:
    """The units of ``node`` some call of its incarnation is on."""
    return {
        g
        for r in runs
        if r.node_id == node.node_id and r.incarnation == node.incarnation
        for g in r.cores
    }


def shares(
    runs: Iterable[Dispatched], node: Node, act: UnifiedAction, gpus: tuple[int, ...]
) -> bool:
    """Whether ``gpus`` of ``node`` run calls of ``act``'s service as that very chunk."""
    name = service_of(act)
    return bool(name) and any(
        r.node_id == node.node_id and r.cores == gpus and service_of(r.action) == name for r in runs
    )


def groups(
    acts: Iterable[UnifiedAction],
    floor: Callable[[UnifiedAction], int],
    max_batch: Callable[[str], int],
) -> list[Group]:
    """Calls of one service with the same smallest DoP (``floor``) in groups of up to its
    ``max_batch``, in order."""
    open_groups: dict[tuple[str, int], Group] = {}
    out: list[Group] = []
    for act in acts:
        name = service_of(act)
        key = (name, floor(act))
        group = open_groups.get(key)
        if group is None or len(group) >= max_batch(name):
            group = open_groups[key] = []
            out.append(group)
        group.append(act)
    return out
