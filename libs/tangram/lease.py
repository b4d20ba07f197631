"""Quota leases: a permit under a quota for a call the client makes itself.

``async with client.lease("llm", job_id="j") as lease:`` submits a ``LeaseAction`` and waits
for its grant (the scheduler's quota core queues it fairly with every other use of the
quota); inside, the caller makes its call with its own SDK and says what it saw with
``lease.report(...)``; leaving the block (an exception included) releases the lease with that
report, which feeds the quota's limiter. A lease not released (a crashed client) is freed when
its ``ttl_s`` runs out.

Cancellation is a normal way out: the release (or, while waiting for the grant, the cancel of
the lease action) runs in a task the client owns (:class:`Cleanups`), shielded from the
caller's cancellation, so a task cancelled inside the block, even again while it leaves, still
frees the unit at once; the client's ``close()`` waits for those tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any, Protocol

from tangram.contract import ActionResult, ActionSpec, LeaseGrant, ReleaseLease
from tangram.errors import InvalidRequest, RemoteError, TangramError

log = logging.getLogger(__name__)


class Cleanups:
    """Cleanup that a cancelled caller must not cut short, each in a task owned here."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self, cleanup: Coroutine[Any, Any, None]) -> None:
        """Run ``cleanup`` to its end: a cancelled caller stops waiting for it (the
        CancelledError is re-raised at once) but the task goes on."""
        task = asyncio.get_running_loop().create_task(cleanup)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        await asyncio.shield(task)

    async def wait(self, timeout_s: float) -> None:
        """Let the cleanups running (or started meanwhile) finish within ``timeout_s``; cancel
        what is left then."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._tasks and (left := deadline - loop.time()) > 0:
            await asyncio.wait(set(self._tasks), timeout=left)
        late = set(self._tasks)
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # seen here even when its caller was cancelled and can no longer raise it
            log.error("lease cleanup failed", exc_info=task.exception())


class LeaseClient(Protocol):
    """What a lease needs of the client: run an action, cancel one, ask the gateway, and a
    home for cleanup tasks."""

    cleanups: Cleanups

    async def run(self, spec: ActionSpec, *, wait_s: float | None = None) -> ActionResult: ...

    async def cancel(self, action_id: str) -> None: ...

    async def release_lease(self, release: ReleaseLease) -> None: ...


class Lease:
    """An async context manager holding one granted lease (see the module docstring)."""

    def __init__(self, client: LeaseClient, spec: ActionSpec, wait_s: float | None) -> None:
        self._client = client
        self.spec = spec
        self._wait_s = wait_s
        self.result: ActionResult | None = None
        self._report = ReleaseLease(lease_id="-")

    @property
    def grant(self) -> LeaseGrant:
        """The grant (lease id, units, tokens, expiry); only inside the ``async with``."""
        if self.result is None or self.result.lease is None:
            raise InvalidRequest("the lease is not granted yet: use it inside 'async with'")
        return self.result.lease

    @property
    def lease_id(self) -> str:
        return self.grant.lease_id

    @property
    def expires_at(self) -> float:
        return self.grant.expires_at

    def report(
        self,
        *,
        tokens_used: int | None = None,
        status: int | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        """Record what the call saw (sent with the release): the tokens it really spent, the
        upstream's status (429 slows the quota down) and its ``Retry-After``."""
        self._report = ReleaseLease(
            lease_id=self._report.lease_id,
            tokens_used=tokens_used,
            status=status,
            retry_after_s=retry_after_s,
        )

    async def __aenter__(self) -> Lease:
        try:
            result = await self._client.run(self.spec, wait_s=self._wait_s)
        except BaseException:
            # no grant seen: do not leave one to be granted later and held until its TTL
            await self._client.cleanups.run(self._withdraw())
            raise
        self.result = _granted(result)
        self._report = ReleaseLease(lease_id=self.lease_id)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._client.cleanups.run(self._release(self._report))

    async def _withdraw(self) -> None:
        """Cancel the lease action; release it too, if a grant raced the cancel (the lease
        id is the action id)."""
        with contextlib.suppress(TangramError):
            await self._client.cancel(self.spec.action_id)
        await self._release(ReleaseLease(lease_id=self.spec.action_id), quiet=True)

    async def _release(self, release: ReleaseLease, *, quiet: bool = False) -> None:
        try:
            await self._client.release_lease(release)
        except TangramError as exc:  # the TTL frees it; never hide the caller's own error
            if not quiet:
                log.warning("lease %s not released (TTL will free it): %s", release.lease_id, exc)


def _granted(result: ActionResult) -> ActionResult:
    """``result`` if it carries a grant, else the error saying why the lease was not granted."""
    if result.ok and result.lease is not None:
        return result
    err = result.error
    code, message = (err.kind.value, err.message) if err else (result.status, "no grant")
    if code == "invalid_request":
        raise InvalidRequest(f"lease refused: {message}")
    raise RemoteError(code, f"lease not granted ({result.status}): {message}")


class SyncLease:
    """The blocking form of :class:`Lease` (``with sync_client.lease(...) as lease:``)."""

    def __init__(self, lease: Lease, call: Callable[[Awaitable[Any]], Any]) -> None:
        self._lease = lease
        self._call = call

    def __enter__(self) -> Lease:
        self._call(self._lease.__aenter__())
        return self._lease

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._call(self._lease.__aexit__(et, e, tb))
