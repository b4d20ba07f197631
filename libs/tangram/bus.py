"""The message bus: one NATS connection, one codec, request/reply with timeouts, and the
middleware every hop goes through (decode-or-error-reply, bounded concurrency, trace context).

Handlers only ever see valid, decoded Structs. A message that does not decode gets an
:class:`~tangram.contract.ErrorReply` naming the problem; a handler's
:class:`~tangram.errors.TangramError` becomes a typed error reply; anything else is logged as a
bug and answered with ``internal``. The service keeps serving in every case.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry import trace

from tangram import telemetry
from tangram.contract import MAX_MESSAGE_BYTES, ErrorReply, codec, encode
from tangram.errors import Busy, InvalidRequest, TangramError, Unavailable, from_reply

log = logging.getLogger(__name__)

Handler = Callable[[Any, Msg], Awaitable[Any]]


def describe_decode_error(exc: Exception) -> str:
    """A one-line reason for a payload that did not decode (msgspec names the bad field)."""
    return f"malformed message: {exc}"


class Server:
    """One subscription served by a handler, with bounded in-flight work.

    ``max_in_flight == 1`` runs the handler inline, in arrival order (single-owner services);
    otherwise each message gets a tracked task and overload is answered with ``busy``.
    """

    def __init__(
        self, bus: Bus, subject: str, typ: Any, handler: Handler, *, queue: str, max_in_flight: int
    ) -> None:
        self._bus = bus
        self.subject = subject
        self._typ = typ
        self._handler = handler
        self._queue = queue
        self._max = max_in_flight
        self._tasks: set[asyncio.Task[None]] = set()
        self._sub: Subscription | None = None
        self.served = 0
        self.rejected = 0

    async def start(self) -> None:
        self._sub = await self._bus.nc.subscribe(
            self.subject, queue=self._queue, cb=self._on_msg, pending_msgs_limit=1_000_000
        )

    async def stop(self, grace_s: float) -> None:
        """Stop intake, let in-flight handlers finish within ``grace_s``, cancel the rest."""
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except nats.errors.Error:
                pass
            self._sub = None
        if self._tasks:
            _done, pending = await asyncio.wait(set(self._tasks), timeout=grace_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    async def _on_msg(self, msg: Msg) -> None:
        if self._max <= 1:
            await self._handle(msg)
            return
        if len(self._tasks) >= self._max:
            self.rejected += 1
            await self._bus.reply(msg, Busy(f"{self.subject} is at capacity").to_reply())
            return
        task = asyncio.get_running_loop().create_task(self._handle(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, msg: Msg) -> None:
        self.served += 1
        reply = await self._dispatch(msg)
        if reply is not None:
            await self._bus.reply(msg, reply)

    async def _dispatch(self, msg: Msg) -> Any:
        if len(msg.data) > MAX_MESSAGE_BYTES:
            return InvalidRequest(
                f"message of {len(msg.data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit"
            ).to_reply()
        try:
            decoded = codec.decode(msg.data, self._typ)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return InvalidRequest(describe_decode_error(exc)).to_reply()
        ctx = telemetry.extract(msg.headers)
        with telemetry.tracer().start_as_current_span(
            f"{self.subject} {type(decoded).__name__}", context=ctx, kind=trace.SpanKind.CONSUMER
        ):
            return await self._run_handler(decoded, msg)

    async def _run_handler(self, decoded: Any, msg: Msg) -> Any:
        try:
            return await self._handler(decoded, msg)
        except TangramError as exc:
            return exc.to_reply()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("handler for %s failed", self.subject)
            return ErrorReply(code="internal", message="internal error; see the service log")


class Bus:
    """A NATS connection with the contract codec and tracing middleware."""

    def __init__(self, nc: NATS, name: str) -> None:
        self.nc = nc
        self.name = name
        self._servers: list[Server] = []

    @classmethod
    async def connect(
        cls,
        url: str,
        name: str,
        *,
        deadline_s: float = 10.0,
        on_reconnect: Callable[[], Awaitable[None]] | None = None,
    ) -> Bus:
        """Connect within ``deadline_s``; once connected, reconnect forever (a broker restart
        is survivable). ``on_reconnect`` runs after each reconnection."""
        try:
            nc = await asyncio.wait_for(cls._connect(url, name, on_reconnect), deadline_s)
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            raise Unavailable(f"cannot connect to NATS at {url}: {exc or 'timed out'}") from exc
        return cls(nc, name)

    @staticmethod
    async def _connect(
        url: str, name: str, on_reconnect: Callable[[], Awaitable[None]] | None
    ) -> NATS:
        async def reconnected() -> None:
            log.info("%s: reconnected to NATS", name)
            if on_reconnect is not None:
                await on_reconnect()

        return await nats.connect(
            url,
            name=name,
            connect_timeout=2,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.25,
            allow_reconnect=True,
            pending_size=64 * 1024 * 1024,
            error_cb=_log_error,
            disconnected_cb=_log_event(f"{name}: disconnected from NATS"),
            reconnected_cb=_log_event(f"{name}: reconnected to NATS"),
        )

    def serve(
        self,
        subject: str,
        typ: Any,
        handler: Handler,
        *,
        queue: str = "",
        max_in_flight: int = 1024,
    ) -> Server:
        """Register a handler for ``subject`` (started by :meth:`start`)."""
        server = Server(self, subject, typ, handler, queue=queue, max_in_flight=max_in_flight)
        self._servers.append(server)
        return server

    async def start(self) -> None:
        for server in self._servers:
            await server.start()

    async def publish(self, subject: str, msg: Any, *, traceparent: str = "") -> None:
        """Publish a contract message with the current (or given) trace context."""
        headers = _headers(traceparent)
        await self.nc.publish(subject, encode(msg), headers=headers or None)

    async def request(self, subject: str, msg: Any, reply_type: Any, *, timeout: float) -> Any:
        """Send a request and decode the reply; an :class:`ErrorReply` is raised as its error."""
        try:
            raw = await self.nc.request(
                subject, encode(msg), timeout=timeout, headers=_headers("") or None
            )
        except nats.errors.NoRespondersError as exc:
            raise Unavailable(f"no service is listening on {subject}") from exc
        except (TimeoutError, nats.errors.TimeoutError) as exc:
            raise Unavailable(f"no reply on {subject} within {timeout:.3g}s") from exc
        except nats.errors.ConnectionClosedError as exc:
            raise Unavailable("the NATS connection is closed") from exc
        reply = codec.decode(raw.data, reply_type | ErrorReply)
        if isinstance(reply, ErrorReply):
            raise from_reply(reply)
        return reply

    async def reply(self, msg: Msg, reply: Any) -> None:
        if msg.reply:
            try:
                await self.nc.publish(msg.reply, encode(reply))
            except nats.errors.Error as exc:
                log.warning("could not reply on %s: %s", msg.reply, exc)

    async def stop_serving(self, grace_s: float) -> None:
        await asyncio.gather(*(s.stop(grace_s) for s in self._servers))
        self._servers.clear()

    async def close(self) -> None:
        """Flush and close; idempotent."""
        if self.nc.is_closed:
            return
        try:
            await asyncio.wait_for(self.nc.drain(), timeout=5)
        except (TimeoutError, nats.errors.Error):
            await self.nc.close()


def _headers(traceparent: str) -> dict[str, str]:
    if traceparent:
        return {"traceparent": traceparent}
    return telemetry.inject()


async def _log_error(exc: Exception) -> None:
    log.info("NATS: %s", exc)


def _log_event(text: str) -> Callable[[], Awaitable[None]]:
    async def cb() -> None:
        log.info(text)

    return cb
