"""The message bus: typed endpoints served and requested over one connection, and the middleware
every hop goes through (decode-or-error-reply, bounded concurrency, trace context).

Handlers only ever see valid, decoded Structs. A message that does not decode (too large,
nested too deep, malformed, invalid, or anything else the decoder raises) gets an
:class:`~tangram.contract.ErrorReply` ``invalid_request`` naming the problem; a handler's
:class:`~tangram.errors.TangramError` becomes a typed error reply; anything else is logged as a
bug and answered with ``internal``. The service keeps serving in every case. A reply that does
not decode is raised to the requester as a :class:`~tangram.errors.RemoteError`.

:class:`BaseBus` holds all of that; a transport supplies four primitives (subscribe, send, ask,
close). :class:`Bus` is the NATS transport; :class:`tangram.membus.MemoryBus` is an in-process
one for fast tests of service shells.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final, TypeVar, overload

import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.aio.transport import TcpTransport

from tangram import auth, telemetry
from tangram.contract import MAX_MESSAGE_BYTES, ErrorReply, codec, encode
from tangram.errors import (
    Busy,
    InvalidRequest,
    RemoteError,
    TangramError,
    Unavailable,
    clipped,
    from_reply,
)
from tangram.subjects import Endpoint

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Rep = TypeVar("Rep")
Handler = Callable[[Any, Msg], Awaitable[Any]]
Callback = Callable[[Msg], Awaitable[None]]
Unsubscribe = Callable[[], Awaitable[None]]

# The contract nests ~6 deep; msgspec recurses per level and raises RecursionError near the
# interpreter's limit (~1,000), even while skipping an unknown field. Refuse far before that.
MAX_NESTING: Final = 32
# A user's value (an infer payload, a handler's output) rides inside a few levels of the
# messages that carry it (a dispatch, a completion, a result): it may nest this deep at most.
MAX_VALUE_NESTING: Final = MAX_NESTING - 8
DEFAULT_TIMEOUT_S: Final = 5.0
MAX_REASON_CHARS: Final = 300  # of a decoder's message, in the error reply naming it
# Refused pushes (no one to answer but the log): at most this many lines per this many seconds
DROPPED_LOG: Final = (5, 10.0)

# msgpack type bytes that open a container (fixmap, fixarray, array16/32, map16/32).
_OPENERS: Final = bytes(range(0x80, 0xA0)) + b"\xdc\xdd\xde\xdf"
_NOT_OPENERS: Final = bytes(b for b in range(256) if b not in _OPENERS)
_COUNT_BELOW: Final = 16 * 1024  # bigger messages are walked: counting would cost more
# Bytes after the type byte for fixed-size scalars, and the width of the length prefix of
# str/bin/ext (ext carries one more byte: its type code).
_FIXED: Final = {0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2}
_FIXED.update({0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17})
_SIZED: Final = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC7: 1, 0xC8: 2, 0xC9: 4}
_WIDE: Final = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}  # (len width, per item)


def too_deep(data: bytes, limit: int = MAX_NESTING) -> bool:
    """True when the msgpack ``data`` nests containers more than ``limit`` deep.

    Depth never exceeds the number of container type bytes, which one C-speed ``translate``
    counts: a typical message is cleared by that alone (~0.3 µs). One with more such bytes (they
    also occur inside strings and integers), or a large one (large for its strings, so few
    items), is walked value by value, skipping payloads. Malformed data is not judged here (the
    decoder names it)."""
    if len(data) <= _COUNT_BELOW and len(data.translate(None, _NOT_OPENERS)) <= limit:
        return False
    return _deeper_than(data, limit)


def _deeper_than(data: bytes, limit: int) -> bool:
    """Walk the values of ``data``, skipping payloads by their length; stop past ``limit``, at
    the end of the first value, or at malformed data."""
    pending: list[int] = []  # items still to read in each open container
    pos, end = 0, len(data)
    while pos < end:
        items, pos = _header(data, data[pos], pos + 1)
        while pending and pending[-1] == 0:
            pending.pop()
        if pending:
            pending[-1] -= 1
        if items < 0:
            return False
        if items:
            pending.append(items)
            if len(pending) > limit:
                return True
        if not pending:
            return False
    return False


def _header(data: bytes, b: int, pos: int) -> tuple[int, int]:
    """(items the value at ``b`` opens, position after its header and any payload); items is -1
    for a byte no msgpack value starts with."""
    if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):
        return 0, pos
    if b <= 0x8F:
        return 2 * (b & 0x0F), pos
    if b <= 0x9F:
        return b & 0x0F, pos
    if b <= 0xBF:
        return 0, pos + (b & 0x1F)
    if b in _FIXED:
        return 0, pos + _FIXED[b]
    if b in _SIZED:
        width = _SIZED[b]
        extra = 1 if b in (0xC7, 0xC8, 0xC9) else 0
        return 0, pos + width + extra + int.from_bytes(data[pos : pos + width], "big")
    if b in _WIDE:
        width, per = _WIDE[b]
        return per * int.from_bytes(data[pos : pos + width], "big"), pos + width
    return -1, pos


def decode_request(data: bytes, typ: Any) -> Any:
    """The decoded request, or an ``invalid_request`` :class:`ErrorReply` naming why not.

    Every exception of the decoder counts (a ``RecursionError`` too): no payload may leave a
    request unanswered."""
    if len(data) > MAX_MESSAGE_BYTES:
        return InvalidRequest(
            f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit"
        ).to_reply()
    if too_deep(data):
        return InvalidRequest(
            f"malformed message: nested deeper than {MAX_NESTING} levels"
        ).to_reply()
    try:
        return codec.decode(data, typ)
    except Exception as exc:
        return InvalidRequest(describe_decode_error(exc)).to_reply()


def describe_decode_error(exc: Exception) -> str:
    """A one-line reason for a payload that did not decode (msgspec names the bad field)."""
    if isinstance(exc, RecursionError):
        return "malformed message: nested too deep to decode"
    # msgspec quotes the offending value: a sender's 500 KB string came back whole
    return f"malformed message: {clipped(str(exc), MAX_REASON_CHARS)}"


def decode_reply(subject: str, data: bytes, reply_type: Any) -> Any:
    """The decoded reply; an :class:`ErrorReply` is raised as its error, and a reply that does
    not decode as a :class:`RemoteError` ``invalid_reply``."""
    try:
        if too_deep(data):
            raise ValueError(f"nested deeper than {MAX_NESTING} levels")
        reply = codec.decode(data, reply_type | ErrorReply)
    except Exception as exc:
        raise RemoteError("invalid_reply", f"undecodable reply on {subject}: {exc}") from exc
    if isinstance(reply, ErrorReply):
        raise from_reply(reply)
    return reply


class Server:
    """One subscription served by a handler, with bounded in-flight work.

    ``max_in_flight == 1`` runs the handler inline, in arrival order (single-owner services);
    otherwise each message gets a tracked task and overload is answered with ``busy``.
    """

    def __init__(
        self,
        bus: BaseBus,
        subject: str,
        typ: Any,
        handler: Handler,
        *,
        queue: str,
        max_in_flight: int,
    ) -> None:
        self._bus = bus
        self.subject = subject
        self._typ = typ
        self._handler = handler
        self._queue = queue
        self._max = max_in_flight
        self._tasks: set[asyncio.Task[None]] = set()
        self._unsubscribe: Unsubscribe | None = None
        self.served = 0
        self.rejected = 0
        self.dropped = 0  # pushes refused (nobody to tell but the log)
        self._unsaid = 0  # of those, not logged yet
        self._logs: list[float] = []  # when the last few were logged

    async def start(self) -> None:
        self._unsubscribe = await self._bus._subscribe(self.subject, self._queue, self._on_msg)

    async def stop(self, grace_s: float) -> None:
        """Stop intake, let in-flight handlers finish within ``grace_s``, cancel the rest."""
        if self._unsubscribe is not None:
            await self._unsubscribe()
            self._unsubscribe = None
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
        if reply is None:
            return
        if msg.reply:
            await self._bus.reply(msg, reply)
        elif isinstance(reply, ErrorReply):
            self._drop(reply)

    def refuse(self, why: str) -> None:
        """A request its handler refuses to answer at all (it returns None): logged as a
        dropped message is (:meth:`_drop`), so a flood of them is counted, not logged each."""
        self._drop(InvalidRequest(why).to_reply())

    def _drop(self, why: ErrorReply) -> None:
        """A published message refused (undecodable, or its handler said no): no requester to
        answer, so the log says it -- a few lines per window (``DROPPED_LOG``), a flood counted."""
        self.dropped += 1
        self._unsaid += 1
        most, window_s = DROPPED_LOG
        now = time.monotonic()
        self._logs = [t for t in self._logs if now - t < window_s]
        if len(self._logs) >= most:
            return
        self._logs.append(now)
        n, self._unsaid = self._unsaid, 0
        log.warning("%s: dropped %d message(s); the last: %s", self.subject, n, why.message)

    async def _dispatch(self, msg: Msg) -> Any:
        decoded = decode_request(msg.data, self._typ)
        if isinstance(decoded, ErrorReply):
            return decoded
        if not msg.headers and not telemetry.start_trace(decoded):  # hot path: 30 us less
            return await self._run_handler(decoded, msg)
        ctx = telemetry.extract(msg.headers)
        with telemetry.consumer_span(self.subject, decoded, ctx):
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


def _subject(target: str | Endpoint[Any, Any]) -> str:
    return target.subject if isinstance(target, Endpoint) else target


class BaseBus(abc.ABC):
    """Serve, publish and request typed endpoints; a transport implements the primitives."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._servers: list[Server] = []

    # ------------------------------------------------------------------ transport primitives

    @abc.abstractmethod
    async def _subscribe(self, subject: str, queue: str, cb: Callback) -> Unsubscribe:
        """Deliver each message on ``subject`` to ``cb`` (one at a time, in order)."""

    @abc.abstractmethod
    async def _send(self, subject: str, data: bytes, headers: dict[str, str] | None) -> None:
        """Publish raw bytes."""

    @abc.abstractmethod
    async def _ask(
        self, subject: str, data: bytes, headers: dict[str, str] | None, timeout: float
    ) -> bytes:
        """The raw reply to a request; raises :class:`Unavailable` on no responder or timeout."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Flush and close; idempotent."""

    # ------------------------------------------------------------------ serving

    @overload
    def serve(
        self,
        endpoint: Endpoint[Req, Rep],
        handler: Callable[[Req, Msg], Awaitable[Rep | None]],
        /,
        *,
        queue: str | None = None,
        max_in_flight: int = 1024,
    ) -> Server: ...

    @overload
    def serve(
        self,
        subject: str | Endpoint[Any, Any],
        typ: Any,
        handler: Handler,
        /,
        *,
        queue: str | None = None,
        max_in_flight: int = 1024,
    ) -> Server: ...

    def serve(
        self, target: Any, *args: Any, queue: str | None = None, max_in_flight: int = 1024
    ) -> Server:
        """Register a handler for an endpoint (started by :meth:`start`); the endpoint's queue
        group unless ``queue`` is given. (The ``(subject, type, handler)`` form is the old one.)"""
        if len(args) == 1:
            typ, handler = target.request, args[0]
        else:
            typ, handler = args
        if queue is None:
            queue = target.queue if isinstance(target, Endpoint) else ""
        server = Server(
            self, _subject(target), typ, handler, queue=queue, max_in_flight=max_in_flight
        )
        self._servers.append(server)
        return server

    async def start(self) -> None:
        for server in self._servers:
            await server.start()

    async def stop_serving(self, grace_s: float) -> None:
        await asyncio.gather(*(s.stop(grace_s) for s in self._servers))
        self._servers.clear()

    async def reply(self, msg: Msg, reply: Any) -> None:
        if msg.reply:
            try:
                await self._send(msg.reply, encode(reply), None)
            except (TangramError, nats.errors.Error) as exc:
                log.warning("could not reply on %s: %s", msg.reply, exc)

    # ------------------------------------------------------------------ sending

    @overload
    async def publish(
        self, endpoint: Endpoint[Req, Any], msg: Req, /, *, traceparent: str = ""
    ) -> None: ...

    @overload
    async def publish(self, subject: str, msg: Any, /, *, traceparent: str = "") -> None: ...

    async def publish(self, target: Any, msg: Any, /, *, traceparent: str = "") -> None:
        """Publish a contract message with the current (or given) trace context."""
        await self._send(_subject(target), encode(msg), _headers(traceparent) or None)

    @overload
    async def request(
        self, endpoint: Endpoint[Req, Rep], msg: Req, /, *, timeout: float = DEFAULT_TIMEOUT_S
    ) -> Rep: ...

    @overload
    async def request(
        self,
        subject: str | Endpoint[Any, Any],
        msg: Any,
        reply_type: Any,
        /,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> Any: ...

    async def request(
        self, target: Any, msg: Any, *reply_type: Any, timeout: float = DEFAULT_TIMEOUT_S
    ) -> Any:
        """Send a request and decode the reply; an :class:`ErrorReply` is raised as its error.
        (The ``(subject, msg, reply_type)`` form is the old one.)"""
        typ = reply_type[0] if reply_type else target.reply
        subject = _subject(target)
        raw = await self._ask(subject, encode(msg), _headers("") or None, timeout)
        return decode_reply(subject, raw, typ)


class _Nats(NATS):
    """nats-py's client, sending each publish at once rather than when its flusher task next
    runs.

    nats-py queues a publish and wakes a flusher task; whatever else became ready before it
    (a scheduling pass, a group commit's SQL) runs first, so a message waited for other work
    of its sender before it left: ~0.5 ms a hop here, most of a result push's time. Written
    through, the flusher later finds nothing to send. Requests publish through this too.
    While disconnected nothing is written here: nats-py buffers and replays as before. Nor
    while the socket is backed up (its buffer at its high-water mark, where nats-py's flusher
    waits for it to drain) or closing: what is pending stays in nats-py's buffer, bounded
    (``pending_size``: a publisher past it waits) and replayed when a stalled connection is
    replaced, rather than piling up without bound in the socket's buffer and lost with it.
    Nor on a websocket, which sends only when drained (the flusher then never would). Relies
    on three attributes of nats-py's client (``_pending``, ``_pending_data_size``,
    ``_transport``), and its TCP transport's ``_io_writer``; where they are missing it sends
    as nats-py does (``write_through``, ``_writable``)."""

    write_through = all(
        hasattr(NATS(), a) for a in ("_pending", "_pending_data_size", "_transport")
    )

    async def publish(self, *args: Any, **kwargs: Any) -> None:
        await super().publish(*args, **kwargs)
        self._send_pending(backed_up_too=False)

    async def flush(self, *args: Any, **kwargs: Any) -> None:
        """nats-py writes its PING straight to the socket, ahead of what waits in its buffer
        (a SUB just made: ``Bus.start``'s flush would return before the broker knew it):
        what waits is written first, so the PONG vouches for it."""
        self._send_pending(backed_up_too=True)
        await super().flush(*args, **kwargs)

    def _send_pending(self, *, backed_up_too: bool) -> None:
        if self.write_through and self._pending_data_size and self.is_connected:
            writer = _writable(self._transport, backed_up_too)
            if writer is not None:  # bytes are written in order: the flusher's, then these
                writer.writelines(self._pending)
                self._pending = []
                self._pending_data_size = 0


def _writable(transport: object, backed_up_too: bool) -> asyncio.StreamWriter | None:
    """The TCP socket's writer if a write would go out now (open, and its buffer below its
    high-water mark unless ``backed_up_too``: a drain would not wait), else None."""
    writer = getattr(transport, "_io_writer", None)  # a websocket: nothing leaves until drained
    if not isinstance(transport, TcpTransport) or not isinstance(writer, asyncio.StreamWriter):
        return None
    socket = writer.transport
    try:
        backed_up = socket.get_write_buffer_size() >= socket.get_write_buffer_limits()[1]
    except (AttributeError, NotImplementedError):  # a transport that cannot say
        return None
    return None if (backed_up and not backed_up_too) or socket.is_closing() else writer


class Bus(BaseBus):
    """The NATS transport: one connection with the contract codec and tracing middleware."""

    def __init__(self, nc: NATS, name: str, creds: auth.Creds | None = None) -> None:
        super().__init__(name)
        self.nc = nc
        self.creds = creds  # who the broker knows this connection as (None: no auth)

    @classmethod
    async def connect(
        cls,
        url: str,
        name: str,
        *,
        deadline_s: float = 10.0,
        on_reconnect: Callable[[], Awaitable[None]] | None = None,
        creds: str | Path | None = None,
    ) -> Bus:
        """Connect within ``deadline_s``; once connected, reconnect forever (a broker restart
        is survivable). ``on_reconnect`` runs after each reconnection. ``creds`` is a
        credential file (:mod:`tangram.auth`), else the one ``TANGRAM_CREDS`` names, if any."""
        path = creds or os.environ.get(auth.CREDS_VAR)
        who = auth.load_creds(path) if path else None
        try:
            nc = await asyncio.wait_for(cls._connect(url, name, on_reconnect, who), deadline_s)
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            why = str(exc) or f"{type(exc).__name__}, no answer within {deadline_s:g}s"
            if _is_refusal(exc):
                why = f"refused: {'wrong credentials' if who else 'credentials required'}"
            raise Unavailable(f"cannot connect to NATS at {url}: {why}") from exc
        return cls(nc, name, who)

    @staticmethod
    async def _connect(
        url: str,
        name: str,
        on_reconnect: Callable[[], Awaitable[None]] | None,
        who: auth.Creds | None,
    ) -> NATS:
        resyncs: set[asyncio.Task[None]] = set()

        async def reconnected() -> None:
            log.info("%s: reconnected to NATS", name)
            if on_reconnect is not None:  # in a task: nats-py awaits this in its reconnect loop
                task = asyncio.ensure_future(on_reconnect())
                resyncs.add(task)
                task.add_done_callback(_resynced(resyncs))

        options: dict[str, Any] = {
            "name": name,
            "connect_timeout": 2,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 0.25,
            "allow_reconnect": True,
            "pending_size": 64 * 1024 * 1024,
            "disconnected_cb": _log_event(f"{name}: disconnected from NATS"),
            "reconnected_cb": reconnected,  # logs, then ``on_reconnect`` (a client resyncs)
        }
        if who is not None:  # its own inbox prefix: the only one it may read replies under
            options.update(who.login())
        nc = _Nats()
        refused: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        connecting = asyncio.ensure_future(
            nc.connect(url, error_cb=_refusal_watch(refused), **options)
        )
        return await _unless_refused(nc, connecting, refused)

    async def start(self) -> None:
        """Start serving; on return the server knows every subscription (a request sent next,
        from any connection, finds its responder)."""
        await super().start()
        try:
            await self.nc.flush(timeout=5)
        except (TimeoutError, nats.errors.Error) as exc:
            raise Unavailable(f"NATS did not confirm the subscriptions: {exc}") from exc

    async def _subscribe(self, subject: str, queue: str, cb: Callback) -> Unsubscribe:
        sub = await self.nc.subscribe(subject, queue=queue, cb=cb, pending_msgs_limit=1_000_000)
        return lambda: _unsubscribe(sub)

    async def _send(self, subject: str, data: bytes, headers: dict[str, str] | None) -> None:
        try:
            await self.nc.publish(subject, data, headers=headers)
        except nats.errors.Error as exc:  # closed, draining, reconnect buffer full, ...
            raise Unavailable(f"cannot publish on {subject}: {exc}") from exc

    async def _ask(
        self, subject: str, data: bytes, headers: dict[str, str] | None, timeout: float
    ) -> bytes:
        try:
            raw = await self.nc.request(subject, data, timeout=timeout, headers=headers)
        except nats.errors.NoRespondersError as exc:
            raise Unavailable(f"no service is listening on {subject}") from exc
        except (TimeoutError, nats.errors.TimeoutError) as exc:
            raise Unavailable(f"no reply on {subject} within {timeout:.3g}s") from exc
        except nats.errors.ConnectionClosedError as exc:
            raise Unavailable("the NATS connection is closed") from exc
        except nats.errors.Error as exc:  # draining, reconnect buffer full, ...
            raise Unavailable(f"no reply on {subject}: {exc}") from exc
        return raw.data

    async def close(self) -> None:
        if self.nc.is_closed:
            return
        try:
            await asyncio.wait_for(self.nc.drain(), timeout=5)
        except (TimeoutError, nats.errors.Error):
            await self.nc.close()


async def _unsubscribe(sub: Subscription) -> None:
    try:
        await sub.unsubscribe()
    except nats.errors.Error:
        pass


def _headers(traceparent: str) -> dict[str, str]:
    if traceparent:
        return {"traceparent": traceparent}
    return telemetry.inject()


async def _log_error(exc: Exception) -> None:
    if "permissions violation" in str(exc).lower():  # a bug in the role's grant, or a probe
        log.warning("NATS refused: %s", exc)
        return
    log.info("NATS: %s", exc)


def _resynced(tasks: set[asyncio.Task[None]]) -> Callable[[asyncio.Task[None]], None]:
    """Forget a finished ``on_reconnect`` task, logging how it failed (it is retried at the
    next reconnection, not now)."""

    def done(task: asyncio.Task[None]) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("after a reconnection: %r", task.exception())

    return done


ADMITS_ATTEMPTS: Final = 3  # a login probe's tries when the broker closes before saying why


async def admits(url: str, creds: str | Path, timeout_s: int = 2) -> bool:
    """Whether the broker at ``url`` takes the login in ``creds`` now: a new connection per
    attempt (up to ``ADMITS_ATTEMPTS`` when the broker closes before saying why), no
    reconnecting, the connection closed before returning (a probe, not a bus: a reconnecting
    client's refused attempts are what leave sockets behind). Unreachable: ``Unavailable``."""
    who = auth.load_creds(creds)
    for attempt in range(1, ADMITS_ATTEMPTS + 1):
        nc = NATS()
        try:
            await nc.connect(
                url,
                **who.login(),
                connect_timeout=timeout_s,
                allow_reconnect=False,
                max_reconnect_attempts=0,
                error_cb=_ignore,
            )
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            if _is_refusal(exc):
                return False
            # A broker that refuses a login says so and closes the connection; nats-py may meet
            # the close before it reads why (seen in CI: "Connection lost" for a removed
            # client). Ask again: a refusal says so next time, an absent broker stays absent.
            if attempt < ADMITS_ATTEMPTS and isinstance(exc, ConnectionResetError):
                continue
            why = exc or type(exc).__name__
            raise Unavailable(f"cannot connect to NATS at {url}: {why}") from exc
        finally:  # without reconnecting, nats-py raises a refusal with its socket still open
            await _close_quietly(nc)
        return True
    raise AssertionError("unreachable: the last attempt returns or raises")


async def _ignore(exc: Exception) -> None:
    """A probe's errors are its answer (raised from ``connect``), not news to log."""


def _is_refusal(exc: BaseException) -> bool:
    """The broker rejected the login (nats-py raises it as a plain error while connecting)."""
    return isinstance(exc, nats.errors.AuthorizationError) or (
        isinstance(exc, nats.errors.Error) and "authorization violation" in str(exc).lower()
    )


def _refusal_watch(refused: asyncio.Future[None]) -> Callable[[Exception], Awaitable[None]]:
    """An error callback that also marks ``refused`` when the broker rejects the login."""

    async def on_error(exc: Exception) -> None:
        if _is_refusal(exc) and not refused.done():
            refused.set_exception(exc)
        await _log_error(exc)

    return on_error


async def _unless_refused(
    nc: NATS, connecting: asyncio.Future[None], refused: asyncio.Future[None]
) -> NATS:
    """``nc`` once connected; a rejected login ends the attempt at once (retrying the same
    credentials cannot succeed), instead of retrying until the deadline."""
    try:
        await asyncio.wait([connecting, refused], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not connecting.done():
            connecting.cancel()
            await asyncio.gather(connecting, return_exceptions=True)
            await _close_quietly(nc)
    if refused.done():  # the refusal wins even if the connect got through meanwhile
        await asyncio.gather(connecting, return_exceptions=True)  # its outcome, retrieved
        await _close_quietly(nc)
        refused.result()
    refused.cancel()
    connecting.result()  # raises a failed connect's error
    return nc


async def _close_quietly(nc: NATS) -> None:
    """Close a connection that never came up (its half-started tasks), bounded: a close that
    hangs on a dead socket must not hold up the caller's deadline."""
    with contextlib.suppress(TimeoutError, nats.errors.Error, OSError):
        await asyncio.wait_for(nc.close(), 1.0)
    # nats-py closes a failed attempt's socket, marks itself closed, and its next attempt opens
    # another; a close then returns early (already closed), leaving that socket open (a leaked
    # StreamWriter, seen when a login is refused twice in a row). Close whatever is left.
    transport = getattr(nc, "_transport", None)
    if transport is not None:
        with contextlib.suppress(Exception):
            transport.close()


def _log_event(text: str) -> Callable[[], Awaitable[None]]:
    async def cb() -> None:
        log.info(text)

    return cb


async def open_bus(stack: contextlib.AsyncExitStack, url: str, name: str) -> Bus:
    """A connected bus that ``stack`` drains and closes when it unwinds."""
    bus = await Bus.connect(url, name)
    stack.push_async_callback(bus.close)
    return bus
