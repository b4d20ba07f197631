"""An in-process bus with the real :class:`~tangram.bus.Bus`'s interface, for fast tests of
service shells without a nats-server.

A :class:`MemoryBroker` stands for one NATS server; each :meth:`MemoryBroker.connect` gives a
:class:`MemoryBus` (one per service, as each service has its own connection). Only the transport
differs from the real bus: serving, decoding, error replies, busy answers and tracing are the
same code (:class:`~tangram.bus.BaseBus`). Like NATS it delivers each subscription's messages
one at a time in order, picks one member of a queue group per message, matches ``*``/``>``
wildcards, refuses payloads over ``max_payload``, and answers a request nobody listens to with
"no responders".
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
from dataclasses import dataclass, field
from typing import cast

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from tangram.bus import BaseBus, Callback, Unsubscribe
from tangram.errors import Unavailable

MAX_PAYLOAD = 1024 * 1024  # nats-server's default max_payload


@dataclass(eq=False)
class _Subscription:
    subject: str
    queue: str
    cb: Callback
    inbox: asyncio.Queue[Msg | None] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        """Deliver in order, one at a time (as nats.py does per subscription)."""
        while (msg := await self.inbox.get()) is not None:
            await self.cb(msg)


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, a final ``>`` one or more."""
    want, got = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(got) > i
        if i >= len(got) or (token != "*" and token != got[i]):
            return False
    return len(want) == len(got)


class MemoryBroker:
    """The in-process stand-in for one NATS server, shared by every bus connected to it."""

    def __init__(self, *, max_payload: int = MAX_PAYLOAD, seed: int = 0) -> None:
        self.max_payload = max_payload
        self._subs: list[_Subscription] = []
        self._random = random.Random(seed)
        self._inboxes = itertools.count()

    def connect(self, name: str) -> MemoryBus:
        return MemoryBus(self, name)

    def inbox(self) -> str:
        return f"_INBOX.mem.{next(self._inboxes)}"

    async def add(self, sub: _Subscription) -> None:
        sub.task = asyncio.get_running_loop().create_task(sub.run(), name=f"sub {sub.subject}")
        self._subs.append(sub)

    async def remove(self, sub: _Subscription) -> None:
        """Stop delivering to ``sub``; what it was already given still runs to the end."""
        if sub in self._subs:
            self._subs.remove(sub)
            sub.inbox.put_nowait(None)
        if sub.task is not None and sub.task is not asyncio.current_task():
            await asyncio.gather(sub.task, return_exceptions=True)

    def deliver(self, msg: Msg) -> int:
        """Hand ``msg`` to every plain subscriber and to one member of each queue group; the
        number of subscriptions that got it."""
        if len(msg.data) > self.max_payload:
            raise nats.errors.MaxPayloadError  # as the NATS client refuses it
        groups: dict[str, list[_Subscription]] = {}
        chosen: list[_Subscription] = []
        for sub in self._subs:
            if matches(sub.subject, msg.subject):
                if sub.queue:
                    groups.setdefault(sub.queue, []).append(sub)
                else:
                    chosen.append(sub)
        chosen += [self._random.choice(members) for members in groups.values()]
        for sub in chosen:
            sub.inbox.put_nowait(msg)
        return len(chosen)


class MemoryBus(BaseBus):
    """One connection to a :class:`MemoryBroker`."""

    def __init__(self, broker: MemoryBroker, name: str) -> None:
        super().__init__(name)
        self.broker = broker
        self._own: list[_Subscription] = []
        self.closed = False

    async def _subscribe(self, subject: str, queue: str, cb: Callback) -> Unsubscribe:
        self._check_open()
        sub = _Subscription(subject, queue, cb)
        await self.broker.add(sub)
        self._own.append(sub)
        return lambda: self._unsubscribe(sub)

    async def _unsubscribe(self, sub: _Subscription) -> None:
        if sub in self._own:
            self._own.remove(sub)
        await self.broker.remove(sub)

    async def _send(self, subject: str, data: bytes, headers: dict[str, str] | None) -> None:
        self._check_open()
        self.broker.deliver(_msg(subject, data, headers))

    async def _ask(
        self, subject: str, data: bytes, headers: dict[str, str] | None, timeout: float
    ) -> bytes:
        self._check_open()
        inbox = self.broker.inbox()
        answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def on_reply(msg: Msg) -> None:
            if not answer.done():
                answer.set_result(msg.data)

        sub = _Subscription(inbox, "", on_reply)
        await self.broker.add(sub)
        try:
            if not self.broker.deliver(_msg(subject, data, headers, reply=inbox)):
                raise Unavailable(f"no service is listening on {subject}")
            return await asyncio.wait_for(answer, timeout)
        except TimeoutError as exc:
            raise Unavailable(f"no reply on {subject} within {timeout:.3g}s") from exc
        finally:
            await self.broker.remove(sub)

    async def close(self) -> None:
        """Drop this connection's subscriptions (as a drained NATS connection does)."""
        if self.closed:
            return
        self.closed = True
        for sub in list(self._own):
            with contextlib.suppress(Exception):
                await self._unsubscribe(sub)

    def _check_open(self) -> None:
        if self.closed:
            raise Unavailable("the bus connection is closed")


def _msg(subject: str, data: bytes, headers: dict[str, str] | None, reply: str = "") -> Msg:
    # Handlers get nats.py's Msg; replies go through the bus, never through its (absent) client.
    return Msg(_client=cast(NATS, None), subject=subject, reply=reply, data=data, headers=headers)
