"""Quota leases: a permit under a quota for a call the client makes itself.

``async with client.lease("llm", job_id="j") as lease:`` submits a ``LeaseAction`` and waits
for its grant (the scheduler's quota core queues it fairly with every other use of the
quota); inside, the caller makes its call with its own SDK and says what it saw with
``lease.report(...)``; leaving the block (an exception included) releases the lease with that
report, which feeds the quota's limiter. A lease not released (a crashed client) is freed when
its ``ttl_s`` runs out.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Protocol

from tangram.contract import ActionResult, ActionSpec, LeaseGrant, ReleaseLease
from tangram.errors import InvalidRequest, RemoteError, TangramError

log = logging.getLogger(__name__)


class LeaseClient(Protocol):
    """What a lease needs of the client: run an action, cancel one, ask the gateway."""

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
            with contextlib.suppress(TangramError):
                await self._client.cancel(self.spec.action_id)
            raise
        self.result = _granted(result)
        self._report = ReleaseLease(lease_id=self.lease_id)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        release = self._report
        try:
            await self._client.release_lease(release)
        except TangramError as exc:  # the TTL frees it; never hide the caller's own error
            log.warning("lease %s not released (its TTL will free it): %s", release.lease_id, exc)


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
