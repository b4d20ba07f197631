"""The quota node agent: the agent runtime (``tangram.agent``) with an HTTP executor.

The scheduler's quota core decides when a call may go (limits, fair queue, learned rate) and
whether to retry; this agent makes exactly ONE call per dispatch and reports what it saw
(``Outcome.http``, ``tokens_used``; ``started_at`` is when the request went out, or when the
attempt began if it never did: the quota's windows count sends). The quota's API key is read
from this process's environment (the variable ``quota.api_key_env`` names) and sent as
``Authorization: Bearer``; it is never logged, never in an Outcome, and the request headers are
recorded nowhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Final

import aiohttp
import msgspec

from services.quota_manager import config
from services.quota_manager.config import QuotaManagerConfig
from services.quota_manager.http import AddressRefused, Call, Sent, Upstream, scrub
from tangram import metrics
from tangram.agent import Agent, AgentConfig, Launch, Starts
from tangram.bus import BaseBus, open_bus
from tangram.config import MeshConfig
from tangram.contract import (
    Dispatch,
    ErrorKind,
    HttpAction,
    HttpResponse,
    Inventory,
    Outcome,
    QuotaSpec,
    kind_of,
)
from tangram.errors import InvalidRequest

log = logging.getLogger(__name__)
# a caller's headers dropped where a key is added (the key; a coding aiohttp cannot decode)
_KEYED_OUT: Final = frozenset({"authorization", "accept-encoding"})

Clock = Callable[[], float]
REDACTED = "[redacted]"


class HttpExecutor:
    """The agent runtime's :class:`~tangram.agent.Executor` for HTTP calls under quotas."""

    def __init__(
        self,
        upstream: Upstream,
        *,
        environ: Mapping[str, str] = os.environ,
        clock: Clock = time.time,
    ) -> None:
        self.upstream = upstream
        self.environ = environ
        self.clock = clock
        self._calls: dict[str, asyncio.Task[Outcome]] = {}
        # Launches for the health detector: a call until it is handed to the HTTP client. Not
        # until its request is sent: the wait for a connection slot (others hold) and the
        # connect (the upstream's, bounded by its own timeout) are no launch.
        self.starts = Starts()

    async def start(self) -> Inventory:
        return Inventory(kind="quota", backend="http")

    async def close(self) -> None:
        for task in list(self._calls.values()):
            task.cancel()
        await asyncio.gather(*self._calls.values(), return_exceptions=True)
        await self.upstream.close()

    async def run(self, dispatch: Dispatch) -> Outcome:
        started = self.clock()
        try:
            call, key, timeout_s = self.prepared(dispatch)
        except InvalidRequest as exc:
            return self._failed(ErrorKind.INVALID_REQUEST, str(exc), started)
        aid = dispatch.action.spec.action_id
        sent = Sent(self.clock)  # a killed call may have gone out too
        launch = self.starts.begin()
        task = asyncio.get_running_loop().create_task(
            self._call(call, key, timeout_s, sent, launch)
        )
        self._calls[aid] = task
        try:
            await asyncio.wait([task])
        finally:
            launch.done()
            self._calls.pop(aid, None)
            task.cancel()
        if task.cancelled():
            return self._failed(ErrorKind.CANCELLED, "call killed", sent.at or started)
        error = task.exception()
        if error is not None:  # a bug or an error no branch expected: scrubbed, never re-raised
            # with the key inside (the shell would log and report its text)
            log.error("call %s failed unexpectedly: %s", aid, type(error).__name__)
            why = _scrub(f"{type(error).__name__}: {error}", key)
            return self._failed(ErrorKind.INTERNAL, why, sent.at or started)
        outcome = task.result()
        status = outcome.http.status if outcome.http is not None else None
        quota = dispatch.quota.name if dispatch.quota is not None else ""
        metrics.quota_call(quota, status, outcome.tokens_used)
        return outcome

    async def canary(self) -> None:
        """The health detector's canary: a no-op on the thread pool that resolves the calls'
        hosts (``aiohttp.ThreadedResolver``: the loop's default executor). The calls
        themselves run on the event loop, which the ping proved; no connection slot is
        taken (the calls holding them all make progress or time out)."""
        await asyncio.get_running_loop().run_in_executor(None, _noop)

    async def kill(self, action_id: str) -> None:
        task = self._calls.get(action_id)
        if task is not None:
            task.cancel()

    async def drop_env(self, trajectory_id: str) -> None:
        """HTTP calls hold no environment."""

    def envs(self) -> dict[str, float]:
        return {}

    # ------------------------------------------------------------------ one call

    def prepared(self, d: Dispatch) -> tuple[Call, str, float]:
        """The call to make, the key added to it ("" when the quota names none), its timeout."""
        action = d.action.spec.action
        if not isinstance(action, HttpAction):
            raise InvalidRequest(f"a quota node runs http actions, not {kind_of(action)}")
        quota = d.quota
        if quota is None or quota.name != action.quota:
            raise InvalidRequest(f"http action dispatched without its quota {action.quota!r}")
        key = self.api_key(quota)
        headers = dict(action.headers)
        if key:  # and no coding of the caller's: one aiohttp does not decode would carry an
            # echoed key past the scrub (aiohttp asks for what it decodes itself)
            headers = {k: v for k, v in headers.items() if k.lower() not in _KEYED_OUT}
            headers["Authorization"] = f"Bearer {key}"
        cap = action.response_cap_bytes
        call = Call(action.method, action.url, headers, action.body, quota.hosts, cap, key)
        return call, key, d.action.spec.timeout_s

    def api_key(self, quota: QuotaSpec) -> str:
        """The quota's key from this process's environment ("" when it names none)."""
        if quota.api_key_env is None:
            return ""
        key = self.environ.get(quota.api_key_env, "")
        if not key:
            raise InvalidRequest(
                f"quota {quota.name!r}: ${quota.api_key_env} is not set on quota node",
                hint="set it in the quota_manager's environment",
            )
        return key

    async def _call(
        self, call: Call, key: str, timeout_s: float, sent: Sent, launch: Launch
    ) -> Outcome:
        """The call's facts; ``started_at`` is when its request went out (if it never did,
        when the attempt began)."""
        launch.done()  # handed to the HTTP client now
        began = self.clock()
        outcome = await self._fetch(call, key, timeout_s, sent)
        started = began if sent.at is None else sent.at
        return msgspec.structs.replace(outcome, started_at=started, finished_at=self.clock())

    async def _fetch(self, call: Call, key: str, timeout_s: float, sent: Sent) -> Outcome:
        try:
            async with asyncio.timeout(timeout_s):
                got = await self.upstream.fetch(call, sent)
        except InvalidRequest as exc:
            return _failure(ErrorKind.INVALID_REQUEST, _scrub(str(exc), key))
        except aiohttp.InvalidURL as exc:  # passed the allow-list, refused by aiohttp (e.g.
            # ``127.0.0.1.``): the caller's to fix, never retried as if the upstream failed
            return _failure(ErrorKind.INVALID_REQUEST, _scrub(_said(exc), key))
        except TimeoutError:
            why = f"no answer from the upstream within {timeout_s:g}s"
            return _failure(ErrorKind.EXEC_TIMEOUT, why)
        except aiohttp.ClientConnectorError as exc:
            if isinstance(exc.os_error, AddressRefused):
                return _failure(ErrorKind.INVALID_REQUEST, str(exc.os_error))
            return _failure(ErrorKind.UPSTREAM_FAILED, _scrub(_said(exc), key))
        except (aiohttp.ClientError, OSError) as exc:
            return _failure(ErrorKind.UPSTREAM_FAILED, _scrub(_said(exc), key))
        return Outcome(http=_scrubbed(got.response, key), tokens_used=got.tokens_used)

    def _failed(self, kind: ErrorKind, detail: str, started: float) -> Outcome:
        return Outcome(failure=kind, detail=detail, started_at=started, finished_at=self.clock())


def _noop() -> None:
    """The canary's work (see :meth:`HttpExecutor.canary`)."""


def _failure(kind: ErrorKind, detail: str) -> Outcome:
    return Outcome(failure=kind, detail=detail)


def _said(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _scrub(text: str, key: str) -> str:
    """``text`` without the key, should a library ever quote a header back."""
    return text.replace(key, REDACTED) if key else text


def _scrubbed(response: HttpResponse, key: str) -> HttpResponse:
    """The upstream's answer without the key (a debug endpoint may echo the request's
    headers): it would otherwise reach the result, Postgres and the client."""
    if not key:
        return response
    headers = {k: _scrub(v, key) for k, v in response.headers.items()}
    body = scrub(response.body, key)
    return msgspec.structs.replace(response, headers=headers, body=body)


def node_agent(bus: BaseBus, cfg: QuotaManagerConfig, upstream: Upstream | None = None) -> Agent:
    """A quota node agent on ``bus``."""
    upstream = upstream or Upstream(
        max_connections=cfg.max_connections, connect_timeout_s=cfg.connect_timeout_s
    )
    agent_cfg = AgentConfig(
        node_id=cfg.node_id, incarnation=uuid.uuid4().hex, heartbeat_s=cfg.heartbeat_s
    )
    return Agent(bus, HttpExecutor(upstream), agent_cfg, name="quota_manager")


async def build(
    stack: contextlib.AsyncExitStack, overrides: Mapping[str, Any] | None = None
) -> tuple[MeshConfig, Agent]:
    """The quota_manager as configured by the environment and ``overrides`` (runtime.Build)."""
    mesh, cfg = config.load(overrides)
    bus = await open_bus(stack, mesh.nats_url, f"quota_manager.{cfg.node_id}")
    return mesh, node_agent(bus, cfg)
