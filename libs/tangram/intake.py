"""The client's side of intake batching: the submits of one client travel together.

A rollout worker submits for many trajectories at once. Each submit alone is a request, a
reply, and a gateway handler of its own; here the submits of one client leave one batch at a
time: while the gateway commits one batch, the next gathers, and it leaves the moment the
answer comes (a lone submit on a quiet client leaves at once, as itself). An item's error
(the batch's request failed, or the gateway refused that item: ``busy``, ``invalid_request``)
is raised to its caller, whose retry rules (:meth:`tangram.client.Client._gateway`) take it
from there, alone; submits are idempotent by ``action_id``, so a batch answered after it was
given up on harms nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

from tangram import subjects
from tangram.bus import BaseBus
from tangram.contract import (
    BATCH_BYTES,
    MAX_SUBMITS,
    Accepted,
    ActionResult,
    ErrorReply,
    Submit,
    SubmitMany,
    Submitted,
    encode,
)
from tangram.errors import TangramError, Unavailable, from_reply
from tangram.subjects import Endpoint

log = logging.getLogger(__name__)


Answer = Accepted | ActionResult
_Pending = tuple[Submit, "asyncio.Future[Answer]"]


class SubmitBatcher:
    """One batch of submits in flight per client (see the module doc)."""

    def __init__(
        self, bus: BaseBus, attempt_s: float, gateway: Endpoint[Any, Any] = subjects.GATEWAY
    ) -> None:
        self.bus = bus
        self.attempt_s = attempt_s
        self.gateway = gateway  # the client's own subject when it has a credential
        self._queue: deque[_Pending] = deque()
        self._sender: asyncio.Task[None] | None = None

    async def submit(self, req: Submit) -> Answer:
        """The gateway's answer for ``req``, or the error of this try (retryable or not)."""
        fut: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._queue.append((req, fut))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.get_running_loop().create_task(self._send_all())
        return await fut

    async def close(self) -> None:
        """Stop sending; every submit not answered yet fails ``unavailable`` (retryable)."""
        if self._sender is not None:
            self._sender.cancel()
            await asyncio.gather(self._sender, return_exceptions=True)
        _fail([fut for _, fut in self._queue], Unavailable("the client was closed"))
        self._queue.clear()

    async def _send_all(self) -> None:
        await asyncio.sleep(0)  # the submits of this turn of the event loop go together
        while self._queue:
            batch = self._next_batch()
            try:
                answers = await self._send(batch)
            except BaseException:  # cancelled (the client closed): none of it left hanging
                _fail([fut for _, fut in batch], Unavailable("the client was closed"))
                raise
            for (_, fut), answer in zip(batch, answers, strict=True):
                if fut.done():
                    continue
                if isinstance(answer, TangramError):
                    fut.set_exception(answer)
                else:
                    fut.set_result(answer)

    def _next_batch(self) -> list[_Pending]:
        """The oldest submits that fit one message together."""
        batch: list[_Pending] = []
        size = 0
        while self._queue and len(batch) < MAX_SUBMITS:
            n = len(encode(self._queue[0][0]))
            if batch and size + n > BATCH_BYTES:
                break
            batch.append(self._queue.popleft())
            size += n
        return batch

    async def _send(self, batch: list[_Pending]) -> list[Answer | TangramError]:
        """The answers (or errors), item by item."""
        wanted = Submitted if len(batch) > 1 else Accepted | ActionResult
        req = SubmitMany(items=tuple(r for r, _ in batch)) if len(batch) > 1 else batch[0][0]
        try:
            reply = await self.bus.request(self.gateway, req, timeout=self.attempt_s)
        except TangramError as exc:
            log.debug("a batch of %d submits got no answer: %s", len(batch), exc)
            return [exc] * len(batch)
        if not isinstance(reply, wanted):
            return [Unavailable(f"unexpected answer {type(reply).__name__}")] * len(batch)
        if not isinstance(reply, Submitted):
            return [reply]
        if len(reply.items) != len(batch):
            return [Unavailable("the answer does not match the batch")] * len(batch)
        return [_item(answer) for answer in reply.items]


def _item(answer: Accepted | ActionResult | ErrorReply) -> Answer | TangramError:
    return from_reply(answer) if isinstance(answer, ErrorReply) else answer


def _fail(futures: list[asyncio.Future[Answer]], error: TangramError) -> None:
    for fut in futures:
        if not fut.done():
            fut.set_exception(error)
