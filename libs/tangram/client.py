"""The public client: submit actions, get their results, close environments.

``Client`` is async; ``SyncClient`` wraps it for rollout code that is not. Results are pushed
to this client over NATS as soon as an action ends; if a push is missed (a reconnect), the
client falls back to asking the gateway, which answers from Postgres.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Coroutine, Generator, Sequence
from types import TracebackType
from typing import Any, TypeVar

import msgspec
from msgspec import UNSET, UnsetType
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from tangram import subjects, telemetry
from tangram.bus import Bus
from tangram.contract import (
    Accepted,
    ActionResult,
    ActionSpec,
    Cancel,
    CloseEnv,
    DurationHint,
    ExecAction,
    GetResult,
    Submit,
    codec,
)
from tangram.errors import Busy, RemoteError, ResultTimeout, TangramError, Unavailable

T = TypeVar("T")

GATEWAY_TIMEOUT_S = 30.0  # one gateway call, retries included: rides out a broker restart
ATTEMPT_FIRST_S, ATTEMPT_MAX_S = 2.0, 8.0  # one try's wait for a reply (a reply lost in a
# broker outage is retried rather than awaited for the whole budget); doubles per try
RETRY_FIRST_S, RETRY_MAX_S = 0.05, 1.0  # backoff between tries
EARLY_LIMIT = 10_000  # pushed results nobody waits for yet (the gateway keeps them all anyway)
RECHECK_S = 30.0  # ask the gateway for a result not pushed within this (and on reconnect)
POLL_MIN_S, POLL_MAX_S = 0.05, 1.0  # polling for results of other clients' actions


class Client:
    """Async client of a Tangram mesh. Use ``async with Client.connect(url) as client``."""

    def __init__(self, bus: Bus, *, request_timeout: float = GATEWAY_TIMEOUT_S) -> None:
        self.bus = bus
        self.client_id = uuid.uuid4().hex
        self.request_timeout = request_timeout
        self._waiters: dict[str, asyncio.Future[ActionResult]] = {}
        self._early: OrderedDict[str, ActionResult] = OrderedDict()
        self._sub: Subscription | None = None
        self._ids = itertools.count()

    @classmethod
    def connect(cls, nats_url: str = "nats://127.0.0.1:4222", **kw: Any) -> _Connecting:
        """Connect to the mesh's NATS (await it, or use it as an async context manager)."""
        return _Connecting(cls._open(nats_url, **kw))

    @classmethod
    async def _open(cls, nats_url: str, **kw: Any) -> Client:
        holder: list[Client] = []
        bus = await Bus.connect(nats_url, "tangram-client", on_reconnect=lambda: holder[0].resync())
        client = cls(bus, **kw)
        holder.append(client)
        client._sub = await bus.nc.subscribe(
            subjects.results(client.client_id), cb=client._on_result, pending_msgs_limit=1_000_000
        )
        return client

    async def close(self) -> None:
        """Stop listening and close the connection (idempotent)."""
        for fut in self._waiters.values():
            if not fut.done():
                fut.cancel()
        await self.bus.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ API

    async def exec(
        self,
        command: str | Sequence[str],
        *,
        trajectory_id: str,
        job_id: str,
        cpus: int | tuple[int, int] | UnsetType = UNSET,
        timeout_s: float | UnsetType = UNSET,
        action_id: str | None = None,
        memory_mb: int | UnsetType = UNSET,
        env: dict[str, str] | UnsetType = UNSET,
        queue_timeout_s: float | UnsetType | None = UNSET,
        profile: str | UnsetType = UNSET,
        parallel_fraction: float | None = None,
        output_cap_bytes: int | UnsetType = UNSET,
        image: str | UnsetType = UNSET,
        network: bool | UnsetType = UNSET,
        wait_s: float | None = None,
    ) -> ActionResult:
        """Run a command in the trajectory's environment and return its result.

        A ``str`` runs under ``sh -c``; a list is an argv. ``cpus`` is a core count or an
        inclusive ``(min, max)`` range for elastic commands (``{dop}`` becomes the grant).
        ``image`` and ``network`` shape the trajectory's environment when its first action
        creates it (Docker backend). What is left out takes the contract's default
        (:class:`~tangram.contract.ActionSpec`, :class:`~tangram.contract.ExecAction`).
        """
        action = ExecAction(
            **_given(
                command=command if isinstance(command, str) else list(command),
                env=env,
                output_cap_bytes=output_cap_bytes,
            )
        )
        hint = DurationHint(parallel_fraction=parallel_fraction)
        spec = ActionSpec(
            **_given(
                action_id=action_id or self.new_action_id(),
                job_id=job_id,
                trajectory_id=trajectory_id,
                action=action,
                cpus=list(cpus) if isinstance(cpus, tuple) else cpus,
                memory_mb=memory_mb,
                timeout_s=timeout_s,
                queue_timeout_s=queue_timeout_s,
                profile=profile,
                image=image,
                network=network,
                duration=hint if parallel_fraction is not None else UNSET,
            )
        )
        return await self.run(spec, wait_s=wait_s)

    async def run(self, spec: ActionSpec, *, wait_s: float | None = None) -> ActionResult:
        """Submit ``spec`` and wait for its result."""
        fut = self._waiter(spec.action_id)
        try:
            ack = await self._submit(spec)
            if isinstance(ack, ActionResult):
                return ack
            return await self._await(spec.action_id, fut, wait_s, ask_first=ack.duplicate)
        finally:
            self._unwait(spec.action_id, fut)

    async def submit(self, spec: ActionSpec) -> Accepted:
        """Make an action durable in the mesh; returns once it is acknowledged.

        No waiter is kept: a result pushed before :meth:`result` is called waits in a bounded
        cache, and :meth:`result` asks the gateway for anything not found there.
        """
        ack = await self._submit(spec)
        if isinstance(ack, ActionResult):
            self._deliver(ack)
            return Accepted(action_id=ack.action_id, duplicate=True, status=ack.status)
        return ack

    async def result(self, action_id: str, timeout: float | None = None) -> ActionResult:
        """Wait for an action's result (one submitted by any client)."""
        fut = self._waiter(action_id)
        return await self._await(action_id, fut, timeout, ask_first=not fut.done())

    async def close_env(self, trajectory_id: str) -> None:
        """End a trajectory: cancel its pending actions and remove its environment."""
        await self._gateway(CloseEnv(trajectory_id=trajectory_id))

    async def cancel(self, action_id: str) -> None:
        """Cancel a queued or running action (its result says ``cancelled``)."""
        await self._gateway(Cancel(action_id=action_id))

    def new_action_id(self) -> str:
        return f"{self.client_id[:12]}-{next(self._ids)}"

    # ------------------------------------------------------------------ internals

    async def _submit(self, spec: ActionSpec) -> Accepted | ActionResult:
        with telemetry.tracer().start_as_current_span("tangram.submit") as span:
            span.set_attribute("tangram.action_id", spec.action_id)
            reply = await self._gateway(
                Submit(spec=spec, reply_subject=subjects.results(self.client_id))
            )
        if not isinstance(reply, Accepted | ActionResult):
            raise TangramError(f"unexpected reply to submit: {type(reply).__name__}")
        return reply

    async def _gateway(self, req: Any) -> Any:
        """Ask the gateway. What the error tree marks retryable (busy, unreachable, no reply,
        a server's ``unavailable`` reply) is retried with backoff until ``request_timeout`` is
        spent; every request is idempotent (submits by ``action_id``), so a try whose reply
        was lost (a broker restart) is simply made again."""
        start = time.monotonic()
        deadline = start + self.request_timeout
        delay, attempt_s, tries = RETRY_FIRST_S, ATTEMPT_FIRST_S, 0
        while True:
            tries += 1
            try:
                return await self.bus.request(
                    subjects.GATEWAY, req, timeout=min(attempt_s, _left(deadline))
                )
            except TangramError as exc:
                pause = exc.retry_after_s or delay
                if not exc.retryable:
                    raise
                if time.monotonic() + pause >= deadline:
                    raise _gave_up(exc, tries, time.monotonic() - start) from exc
            await asyncio.sleep(pause)
            delay = min(RETRY_MAX_S, delay * 2)
            attempt_s = min(ATTEMPT_MAX_S, attempt_s * 2)

    def _waiter(self, action_id: str) -> asyncio.Future[ActionResult]:
        fut = self._waiters.get(action_id)
        if fut is None or fut.cancelled():
            fut = self._waiters[action_id] = asyncio.get_running_loop().create_future()
            early = self._early.pop(action_id, None)
            if early is not None:
                fut.set_result(early)
        return fut

    async def _await(
        self,
        action_id: str,
        fut: asyncio.Future[ActionResult],
        wait_s: float | None,
        *,
        ask_first: bool,
    ) -> ActionResult:
        """Wait for the push of a result; ask the gateway now and then.

        For our own submissions the push is expected, so the gateway is asked rarely (and on
        reconnect). For another client's action (``ask_first``) no push comes here: poll with
        a short, growing interval.
        """
        deadline = None if wait_s is None else time.monotonic() + wait_s
        recheck, cap = (0.0, POLL_MAX_S) if ask_first else (RECHECK_S, 4 * RECHECK_S)
        try:
            while True:
                if recheck == 0.0 or not await _wait(fut, _slice(recheck, deadline)):
                    found = await self._ask(action_id)
                    if found is not None:
                        return found
                if fut.done():
                    return fut.result()
                if deadline is not None and time.monotonic() >= deadline:
                    raise ResultTimeout(f"action {action_id} did not finish within {wait_s}s")
                recheck = min(cap, max(POLL_MIN_S, recheck * 2))
        finally:
            self._unwait(action_id, fut)

    def _unwait(self, action_id: str, fut: asyncio.Future[ActionResult]) -> None:
        if self._waiters.get(action_id) is fut:
            del self._waiters[action_id]

    async def resync(self) -> None:
        """After a reconnect, pushes may have been missed: ask for every awaited result."""
        pending = [aid for aid, fut in self._waiters.items() if not fut.done()]
        for i in range(0, len(pending), 64):
            found = await asyncio.gather(
                *(self._ask(aid) for aid in pending[i : i + 64]), return_exceptions=True
            )
            for res in found:
                if isinstance(res, ActionResult):
                    self._deliver(res)

    async def _ask(self, action_id: str) -> ActionResult | None:
        reply = await self._gateway(GetResult(action_id=action_id))
        return reply if isinstance(reply, ActionResult) else None

    async def _on_result(self, msg: Msg) -> None:
        try:
            result = codec.decode(msg.data, ActionResult)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return
        self._deliver(result)

    def _deliver(self, result: ActionResult) -> None:
        fut = self._waiters.get(result.action_id)
        if fut is not None and not fut.done():
            fut.set_result(result)
        elif fut is None:
            self._early[result.action_id] = result
            if len(self._early) > EARLY_LIMIT:
                self._early.popitem(last=False)


async def _wait(fut: asyncio.Future[ActionResult], timeout: float) -> bool:
    """Wait for ``fut`` up to ``timeout``; True when it is done (never cancels it)."""
    if fut.done():
        return True
    done, _ = await asyncio.wait([fut], timeout=timeout)
    return bool(done)


def _given(**fields: Any) -> dict[str, Any]:
    """The fields a caller set: the rest take the contract's defaults."""
    return {k: v for k, v in fields.items() if v is not UNSET}


def _gave_up(exc: TangramError, tries: int, took_s: float) -> TangramError:
    """The last retryable error (same type), saying how long the client kept trying."""
    message = f"{exc.message} (gave up after {tries} tries over {took_s:.1f}s)"
    match exc:
        case Busy():
            return Busy(message, retry_after_s=exc.retry_after_s or 0.05)
        case RemoteError():
            return RemoteError(exc.code, message, retryable=True, retry_after_s=exc.retry_after_s)
        case _:
            return Unavailable(message, retry_after_s=exc.retry_after_s)


def _left(deadline: float) -> float:
    """Time left for one request before ``deadline`` (never zero: a last try is worth it)."""
    return max(0.05, deadline - time.monotonic())


def _slice(recheck: float, deadline: float | None) -> float:
    if deadline is None:
        return recheck
    return max(0.0, min(recheck, deadline - time.monotonic()))


class _Connecting:
    """``await Client.connect(...)`` or ``async with Client.connect(...) as c``."""

    def __init__(self, coro: Coroutine[Any, Any, Client]) -> None:
        self._coro = coro
        self._client: Client | None = None

    def __await__(self) -> Generator[Any, None, Client]:
        return self._coro.__await__()

    async def __aenter__(self) -> Client:
        self._client = await self._coro
        return self._client

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._client is not None:
            await self._client.close()


class SyncClient:
    """Blocking client for rollout code that is not async; same methods as :class:`Client`."""

    def __init__(self, nats_url: str = "nats://127.0.0.1:4222", **kw: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tangram", daemon=True)
        self._thread.start()
        self._client: Client = self._call(Client._open(nats_url, **kw))

    def _call(self, coro: Awaitable[T]) -> T:
        fut: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(
            _as_coro(coro), self._loop
        )
        return fut.result()

    def exec(self, command: str | Sequence[str], **kw: Any) -> ActionResult:
        return self._call(self._client.exec(command, **kw))

    def run(self, spec: ActionSpec, **kw: Any) -> ActionResult:
        return self._call(self._client.run(spec, **kw))

    def submit(self, spec: ActionSpec) -> Accepted:
        return self._call(self._client.submit(spec))

    def result(self, action_id: str, timeout: float | None = None) -> ActionResult:
        return self._call(self._client.result(action_id, timeout))

    def close_env(self, trajectory_id: str) -> None:
        self._call(self._client.close_env(trajectory_id))

    def cancel(self, action_id: str) -> None:
        self._call(self._client.cancel(action_id))

    def close(self) -> None:
        """Close the connection and stop the background loop (idempotent)."""
        if self._loop.is_closed():
            return
        self._call(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _as_coro(aw: Awaitable[T]) -> T:
    return await aw
