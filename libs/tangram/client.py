"""The public client: submit actions, get their results, close environments.

``Client`` is async; ``SyncClient`` wraps it for rollout code that is not. Results are pushed
to this client over NATS as soon as an action ends; if a push is missed (a reconnect), the
client falls back to asking the gateway, which answers from Postgres.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import math
import random
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Generator, Sequence
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import msgspec
from msgspec import UNSET, UnsetType
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from tangram import auth, discovery, subjects, telemetry
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
    HttpAction,
    InferAction,
    LeaseAction,
    ListQuotas,
    ListServices,
    Quotas,
    QuotaSpec,
    QuotaState,
    RegisterService,
    ReleaseLease,
    Services,
    ServiceSpec,
    ServiceState,
    SetQuota,
    Submit,
    checked_quota,
    checked_service,
    codec,
)
from tangram.errors import (
    Busy,
    InvalidRequest,
    RemoteError,
    ResultTimeout,
    TangramError,
    Unavailable,
)
from tangram.intake import SubmitBatcher
from tangram.lease import Cleanups, Lease, SyncLease

T = TypeVar("T")

GATEWAY_TIMEOUT_S = 30.0  # one gateway call, retries included: rides out a broker restart
ATTEMPT_FIRST_S, ATTEMPT_MAX_S = 2.0, 8.0  # one try's wait for a reply (a reply lost in a
# broker outage is retried rather than awaited for the whole budget); doubles per try
RETRY_FIRST_S, RETRY_MAX_S = 0.05, 1.0  # backoff between tries
# A ``busy`` gateway says when to come back. Every client it refused at once hears about the
# same time, so each waits up to BUSY_JITTER longer (never sooner: the backlog needs that long
# to drain), and never more than BUSY_MAX_S whatever a server says.
BUSY_JITTER, BUSY_MAX_S = 0.5, 10.0
# How long a refused submit keeps coming back when its action sets no queue timeout: the
# scheduler's default bound on queueing (CoreConfig.queue_timeout_s).
BUSY_WAIT_S = 1800.0
# A registration's answer waits for the GPU nodes to build the service: the gateway waits up to
# its register_timeout_s (150 s) for it, so a client waits that long and a margin.
REGISTER_WAIT_S = 180.0
EARLY_LIMIT = 10_000  # pushed results nobody waits for yet (the gateway keeps them all anyway)
RECHECK_S = 30.0  # ask the gateway for a result not pushed within this (and on reconnect)
POLL_MIN_S, POLL_MAX_S = 0.05, 1.0  # polling for results of other clients' actions


def gateway_endpoint(bus: Bus) -> subjects.Endpoint[Any, Any]:
    """Where this connection asks the gateway: its client credential's own subject (the
    gateway then knows whose actions and trajectories are whose), else the shared one (a mesh
    without auth, or the operator's credential). An admin client's is its admin subject, where
    the gateway also takes mesh-wide changes (the broker admits there admin credentials alone)."""
    creds = bus.creds
    if creds is None or not creds.id:
        return subjects.GATEWAY
    return subjects.admin_of(creds.id) if auth.is_admin(creds) else subjects.gateway_of(creds.id)


class Client:
    """Async client of a Tangram mesh. Use ``async with Client.connect() as client``."""

    def __init__(self, bus: Bus, *, request_timeout: float = GATEWAY_TIMEOUT_S) -> None:
        self.bus = bus
        self.client_id = uuid.uuid4().hex
        self.request_timeout = request_timeout
        self._waiters: dict[str, asyncio.Future[ActionResult]] = {}
        self._early: OrderedDict[str, ActionResult] = OrderedDict()
        self._sub: Subscription | None = None
        self._ids = itertools.count()
        self.gateway = gateway_endpoint(bus)
        self._intake = SubmitBatcher(bus, ATTEMPT_FIRST_S, self.gateway)  # leave in batches
        self.cleanups = Cleanups()  # lease releases that outlive a cancelled caller

    @classmethod
    def connect(
        cls,
        nats_url: str | None = None,
        *,
        creds: str | Path | None = None,
        connect_timeout_s: float = 10.0,
        **kw: Any,
    ) -> _Connecting:
        """Connect to the mesh's NATS (await it, or use it as an async context manager).

        Without a URL the running mesh is found: ``TANGRAM_NATS_URL``, then the live
        ``mesh.json`` in ``TANGRAM_STATE_DIR`` (default ``.state``), then port 4222 here.
        Credentials: ``creds`` (a file ``tangram up`` wrote), else ``TANGRAM_CREDS``, else the
        ``client_creds`` named in that ``mesh.json``; none when the mesh asks for none.
        A broker that does not answer within ``connect_timeout_s`` is ``Unavailable``."""
        return _Connecting(
            cls._open(nats_url, creds=creds, connect_timeout_s=connect_timeout_s, **kw)
        )

    @classmethod
    async def _open(
        cls,
        nats_url: str | None,
        *,
        creds: str | Path | None = None,
        connect_timeout_s: float = 10.0,
        **kw: Any,
    ) -> Client:
        holder: list[Client] = []
        found = discovery.find(nats_url)
        creds = creds or auth.find_creds(found.url)
        try:
            bus = await Bus.connect(
                found.url,
                "tangram-client",
                on_reconnect=lambda: holder[0].resync(),
                creds=creds,
                deadline_s=connect_timeout_s,
            )
        except Unavailable as exc:
            hint = ""
            if creds is None and "credentials required" in exc.message:
                hint = (
                    "; `tangram up` keeps the client's credentials beside its mesh.json: run"
                    " where its .state is, or set TANGRAM_STATE_DIR, or TANGRAM_CREDS to"
                    f" {auth.Keyring(Path('<state>')).path(auth.DEFAULT_CLIENT)}"
                )
            raise Unavailable(f"{exc.message} (URL from {found.source}){hint}") from None
        client = cls(bus, **kw)
        holder.append(client)
        client._sub = await bus.nc.subscribe(
            client.results_subject, cb=client._on_result, pending_msgs_limit=1_000_000
        )
        return client

    @property
    def results_subject(self) -> str:
        """Where this client's results are pushed: under its credential's own id, if any (the
        broker lets no other credential read there)."""
        owner = self.bus.creds.id if self.bus.creds is not None else ""
        return subjects.results(f"{owner}.{self.client_id}" if owner else self.client_id)

    async def close(self) -> None:
        """Stop listening and close the connection (idempotent)."""
        for fut in self._waiters.values():
            if not fut.done():
                fut.cancel()
        await self.cleanups.wait(self.request_timeout)
        await self._intake.close()
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
        """Wait for an action's result (one submitted by any client of this credential; another
        credential's is ``not_found``)."""
        fut = self._waiter(action_id)
        return await self._await(action_id, fut, timeout, ask_first=not fut.done())

    async def close_env(self, trajectory_id: str) -> None:
        """End a trajectory: cancel its pending actions and remove its environment."""
        await self._gateway(CloseEnv(trajectory_id=trajectory_id))

    async def cancel(self, action_id: str) -> None:
        """Cancel a queued or running action (its result says ``cancelled``)."""
        await self._gateway(Cancel(action_id=action_id))

    # ------------------------------------------------------------------ quotas

    async def set_quota(self, spec: QuotaSpec) -> None:
        """Declare (or change) a quota for the whole mesh; durable once this returns."""
        await self._gateway(SetQuota(spec=checked_quota(spec)))

    async def list_quotas(self) -> list[QuotaState]:
        """Every quota with what its limiter learned (rate, use, queue, 429s seen)."""
        reply = await self._gateway(ListQuotas())
        if not isinstance(reply, Quotas):
            raise TangramError(f"unexpected reply to list_quotas: {type(reply).__name__}")
        return list(reply.quotas)

    async def http(
        self,
        method: str,
        url: str,
        *,
        quota: str,
        job_id: str,
        trajectory_id: str = "",
        headers: dict[str, str] | None = None,
        body: bytes | str | None = None,
        timeout_s: float | UnsetType = UNSET,
        tokens: int = 0,
        max_retries: int | UnsetType = UNSET,
        response_cap_bytes: int | UnsetType = UNSET,
        queue_timeout_s: float | UnsetType | None = UNSET,
        action_id: str | None = None,
        wait_s: float | None = None,
    ) -> ActionResult:
        """Make one HTTP call under ``quota`` (only to the quota's hosts; its API key is added
        by the mesh). ``result.http`` holds the status, headers and capped body; ``tokens``
        is the call's estimate, reserved from a token window and trued up after."""
        action = HttpAction(
            **_given(
                method=method.upper(),
                url=url,
                quota=quota,
                headers=dict(headers or {}),
                body=body.encode() if isinstance(body, str) else (body or b""),
                tokens=tokens,
                max_retries=max_retries,
                response_cap_bytes=response_cap_bytes,
            )
        )
        spec = self._quota_spec(
            action, job_id, trajectory_id, action_id, timeout_s=timeout_s, queue=queue_timeout_s
        )
        return await self.run(spec, wait_s=wait_s)

    def lease(
        self,
        quota: str,
        *,
        job_id: str,
        units: int = 1,
        tokens: int = 0,
        ttl_s: float = 60.0,
        trajectory_id: str = "",
        action_id: str | None = None,
        wait_s: float | None = None,
    ) -> Lease:
        """``async with client.lease(quota, job_id=...) as lease:`` a permit for a call made
        here; released on exit (with ``lease.report(...)``) or when ``ttl_s`` runs out."""
        action = LeaseAction(quota=quota, units=units, tokens=tokens, ttl_s=ttl_s)
        spec = self._quota_spec(action, job_id, trajectory_id, action_id)
        return Lease(self, spec, wait_s)

    async def release_lease(self, release: ReleaseLease) -> None:
        """End a lease (what ``async with client.lease(...)`` does on exit)."""
        await self._gateway(release)

    def _quota_spec(
        self,
        action: HttpAction | LeaseAction,
        job_id: str,
        trajectory_id: str,
        action_id: str | None,
        *,
        timeout_s: float | UnsetType = UNSET,
        queue: float | UnsetType | None = UNSET,
    ) -> ActionSpec:
        return ActionSpec(
            **_given(
                action_id=action_id or self.new_action_id(),
                job_id=job_id,
                trajectory_id=trajectory_id,
                action=action,
                timeout_s=timeout_s,
                queue_timeout_s=queue,
            )
        )

    # ------------------------------------------------------------------ model services

    async def register_service(self, spec: ServiceSpec) -> ServiceState:
        """Register (or update) a model service; returns once the GPU nodes prepared it.
        A factory that cannot be imported or built raises the error naming why."""
        req = RegisterService(spec=checked_service(spec))
        states = _services(await self._gateway(req, budget_s=REGISTER_WAIT_S))
        found = [s for s in states if s.spec.name == spec.name]
        return found[0] if found else ServiceState(spec=spec)

    async def list_services(self) -> list[ServiceState]:
        """Every registered service: where it is prepared and resident, or why it failed."""
        return list(_services(await self._gateway(ListServices())))

    async def infer(
        self,
        service: str,
        payload: Any = None,
        *,
        job_id: str,
        trajectory_id: str = "",
        timeout_s: float | UnsetType = UNSET,
        action_id: str | None = None,
        queue_timeout_s: float | UnsetType | None = UNSET,
        wait_s: float | None = None,
    ) -> ActionResult:
        """Call a registered model service with ``payload`` (any msgpack value); the
        handler's output for it is ``result.output``."""
        try:
            msgspec.msgpack.encode(payload)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidRequest(f"infer payload is not a msgpack value: {exc}") from exc
        spec = ActionSpec(
            **_given(
                action_id=action_id or self.new_action_id(),
                job_id=job_id,
                trajectory_id=trajectory_id,
                action=InferAction(service=service, payload=payload),
                timeout_s=timeout_s,
                queue_timeout_s=queue_timeout_s,
            )
        )
        return await self.run(spec, wait_s=wait_s)

    def new_action_id(self) -> str:
        return f"{self.client_id[:12]}-{next(self._ids)}"

    # ------------------------------------------------------------------ internals

    async def _submit(self, spec: ActionSpec) -> Accepted | ActionResult:
        req = Submit(spec=spec, reply_subject=self.results_subject)
        busy_s = spec.queue_timeout_s or BUSY_WAIT_S
        # A submit starts a trace only where this process records one, within its budget of
        # new traces (a service that is a client, the reward front, stores at most so many a
        # second); an untraced one is batched with the others.
        if not telemetry.start_trace(req):
            reply = await self._gateway(req, busy_s=busy_s, first=partial(self._intake.submit, req))
        else:
            with telemetry.tracer().start_as_current_span("tangram.submit") as span:
                span.set_attribute(telemetry.ACTION_ID, spec.action_id)
                reply = await self._gateway(req, busy_s=busy_s)  # alone: it carries its context
        if not isinstance(reply, Accepted | ActionResult):
            raise TangramError(f"unexpected reply to submit: {type(reply).__name__}")
        return reply

    async def _gateway(
        self,
        req: Any,
        *,
        busy_s: float = 0.0,
        first: Callable[[], Awaitable[Any]] | None = None,
        budget_s: float | None = None,
    ) -> Any:
        """Ask the gateway. What the error tree marks retryable (busy, unreachable, no reply,
        a server's ``unavailable`` reply) is retried with backoff (``busy``: after the
        ``retry_after_s`` it names, see :func:`_pause`) until ``request_timeout`` is spent,
        then raised; every request is idempotent (submits by ``action_id``), so a try whose
        reply was lost (a broker restart) is simply made again. A ``busy`` answer (the mesh
        is up, its queue full) renews that budget for up to ``busy_s`` in all: a submit
        refused for a full queue waits here as long as it would have waited in the queue.
        ``first`` makes the first try (a submit: in its client's batch, see ``intake``);
        ``budget_s`` replaces ``request_timeout`` for a request the mesh answers slowly."""
        start = time.monotonic()
        deadline = start + (budget_s or self.request_timeout)
        busy_until = start + max(self.request_timeout, busy_s)
        delay, attempt_s, tries = RETRY_FIRST_S, ATTEMPT_FIRST_S, 0
        while True:
            tries += 1
            try:
                if tries == 1 and first is not None:
                    return await first()
                return await self.bus.request(
                    self.gateway, req, timeout=min(attempt_s, _left(deadline))
                )
            except TangramError as exc:
                if not exc.retryable:
                    raise
                if tries == 1 and first is not None:
                    # the budget counts from when the try left: not its wait in the client's
                    # own batch queue (behind batches a loaded gateway was slow to answer).
                    # Counted, a batch that then timed out was given up unretried under
                    # overload (``Unavailable``: 256 of 30,000 submits at 3x capacity).
                    deadline += max(0.0, time.monotonic() - start - self._intake.attempt_s)
                pause = _pause(exc, delay)
                if isinstance(exc, Busy):
                    deadline = min(busy_until, time.monotonic() + pause + self.request_timeout)
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
                    found = await self._ask_within(action_id, deadline)
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

    async def _ask_within(self, action_id: str, deadline: float | None) -> ActionResult | None:
        """:meth:`_ask` for a wait with time left: a gateway too loaded (or away) to answer
        within the request budget is asked again at the next recheck, and the push may come
        meanwhile. Raised, it ended ``result(timeout=300)`` after ~30 s under overload while
        the action was fine (it finished later). A wait without a deadline still hears the
        error (a mesh gone for good must not hang it)."""
        try:
            return await self._ask(action_id)
        except TangramError as exc:
            if not exc.retryable or deadline is None or time.monotonic() >= deadline:
                raise
            return None

    async def _ask(self, action_id: str) -> ActionResult | None:
        reply = await self._gateway(GetResult(action_id=action_id))
        return reply if isinstance(reply, ActionResult) else None

    async def _on_result(self, msg: Msg) -> None:
        """A pushed result, or the results that ended together (a list)."""
        try:
            pushed = codec.decode(msg.data, ActionResult | list[ActionResult])
        except (msgspec.ValidationError, msgspec.DecodeError):
            return
        for result in pushed if isinstance(pushed, list) else (pushed,):
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


def _services(reply: object) -> tuple[ServiceState, ...]:
    if not isinstance(reply, Services):
        raise TangramError(f"unexpected reply about services: {type(reply).__name__}")
    return reply.services


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


def _pause(exc: TangramError, delay: float) -> float:
    """How long to wait before the next try: what the server asked for (a ``busy`` one with
    jitter, capped), else the client's own backoff ``delay``."""
    asked = exc.retry_after_s
    if asked is None or not math.isfinite(asked) or asked <= 0:
        return delay
    if isinstance(exc, Busy):
        return min(BUSY_MAX_S, asked * random.uniform(1.0, 1.0 + BUSY_JITTER))
    return min(BUSY_MAX_S, asked)


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

    def __init__(self, nats_url: str | None = None, **kw: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tangram", daemon=True)
        self._thread.start()
        try:
            self._client: Client = self._call(Client._open(nats_url, **kw))
        except BaseException:
            self._stop_loop()
            raise

    @classmethod
    def connect(cls, nats_url: str | None = None, **kw: Any) -> SyncClient:
        """The same spelling as :meth:`Client.connect` (and the same search for the mesh)."""
        return cls(nats_url, **kw)

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

    def register_service(self, spec: ServiceSpec) -> ServiceState:
        return self._call(self._client.register_service(spec))

    def list_services(self) -> list[ServiceState]:
        return self._call(self._client.list_services())

    def infer(self, service: str, payload: Any = None, **kw: Any) -> ActionResult:
        return self._call(self._client.infer(service, payload, **kw))

    def http(self, method: str, url: str, **kw: Any) -> ActionResult:
        return self._call(self._client.http(method, url, **kw))

    def set_quota(self, spec: QuotaSpec) -> None:
        self._call(self._client.set_quota(spec))

    def list_quotas(self) -> list[QuotaState]:
        return self._call(self._client.list_quotas())

    def lease(self, quota: str, **kw: Any) -> SyncLease:
        """``with sync_client.lease(quota, job_id=...) as lease:`` (see :meth:`Client.lease`)."""
        return SyncLease(self._client.lease(quota, **kw), self._call)

    def close(self) -> None:
        """Close the connection and stop the background loop (idempotent)."""
        if self._loop.is_closed():
            return
        self._call(self._client.close())
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _as_coro(aw: Awaitable[T]) -> T:
    return await aw
