"""Node commands, sent in the order the scheduler's core decided them.

The shell queues every node effect synchronously (see ``Scheduler.apply``); this loop turns
them into messages: a dispatch only once its ``started`` record is committed (a restarted
scheduler never rebuilds as queued an action a node may run), and only if its attempt is still
the one assigned (the core may have redone it, or lost its node, while the record committed).
What is queued together leaves together, one message per node.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

from services.scheduler.core.effects import DropEnvOnNode, KillOnNode, PrepareOnNode, StartOnNode
from tangram import subjects
from tangram.bus import BaseBus
from tangram.contract import Commands, Dispatch, DropEnv, Kill, Prepare, batches
from tangram.errors import TangramError

log = logging.getLogger(__name__)

NodeEffect: TypeAlias = StartOnNode | KillOnNode | DropEnvOnNode | PrepareOnNode
NodeCommand: TypeAlias = Dispatch | Kill | DropEnv | Prepare


@dataclass(frozen=True, slots=True)
class _Command:
    """A message for a node agent; a dispatch leaves only once its ``started`` record is durable."""

    effect: NodeEffect
    recorded: asyncio.Future[None] | None = None


class Outbox:
    """The queue of node commands and the loop that sends them (``run``, an owned task)."""

    def __init__(self, bus: BaseBus, still_assigned: Callable[[StartOnNode], bool]) -> None:
        self.bus = bus
        self.still_assigned = still_assigned
        self.epoch = 0  # the fencing epoch every command carries: set once the lead is taken
        self._queue: asyncio.Queue[_Command] = asyncio.Queue()

    def put(self, effect: NodeEffect, recorded: asyncio.Future[None] | None = None) -> None:
        self._queue.put_nowait(_Command(effect, recorded))

    async def run(self) -> None:
        """Send node commands in the core's order, a dispatch once its start is committed;
        what is queued together goes together, one message per node."""
        while True:
            cmds = [await self._queue.get()]
            while not self._queue.empty():
                cmds.append(self._queue.get_nowait())
            by_node: dict[str, list[NodeCommand]] = {}
            for cmd in cmds:
                if cmd.recorded is not None and not await _committed(cmd.recorded):
                    continue
                item = self.message(cmd.effect)
                if item is not None:
                    by_node.setdefault(cmd.effect.node_id, []).append(item)
            for node_id, items in by_node.items():
                try:
                    await self._send(node_id, items)
                except TangramError as exc:  # broker away: a lost dispatch is redone after
                    # its grace, a lost kill is sent again on the node's next report
                    log.warning("node command not sent: %s", exc)

    def message(self, e: NodeEffect) -> NodeCommand | None:
        """The node command for an effect; None for a dispatch no longer meant to run."""
        match e:
            case StartOnNode():
                if not self.still_assigned(e):
                    return None
                return Dispatch(
                    action=e.action,
                    cores=e.cores,
                    epoch=self.epoch,
                    incarnation=e.incarnation,
                    gpus=e.gpus,
                    service=e.service,
                    quota=e.quota,
                    tokens=e.tokens,
                    after=e.after,
                    issued=e.issued,
                )
            case KillOnNode():
                return Kill(action_id=e.action_id, epoch=self.epoch, reason=e.reason)
            case DropEnvOnNode():
                return DropEnv(trajectory_id=e.trajectory_id, epoch=self.epoch)
            case PrepareOnNode():
                return Prepare(services=e.services, epoch=self.epoch)

    async def _send(self, node_id: str, items: list[NodeCommand]) -> None:
        """One message per node: a lone command as itself (a dispatch with its trace
        context), several as one ``Commands``."""
        for run in batches(items):
            if len(run) == 1:
                one = run[0]
                trace = one.action.traceparent if isinstance(one, Dispatch) else ""
                await self.bus.publish(subjects.node(node_id), one, traceparent=trace)
            else:
                batch = Commands(items=tuple(run), epoch=self.epoch)
                await self.bus.publish(subjects.node(node_id), batch)


async def _committed(fut: asyncio.Future[None]) -> bool:
    try:
        await asyncio.shield(fut)
    except TangramError as exc:
        log.warning("not dispatching: its start was not recorded (%s)", exc)
        return False
    return True
