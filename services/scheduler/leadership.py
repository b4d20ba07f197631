"""Which scheduler leads: a Postgres session advisory lock held on a connection of its own.

Every scheduler process first waits for the lock (a standby waits here, before it opens its
pool or its serving NATS connection: it answers nothing and costs one idle Postgres session, and
one NATS connection that only publishes its heartbeats, ``tangram.beats``); the one
holding it takes a new epoch (``store.take_lead``) and rebuilds. Why the lock, not a lease
(a NATS KV key or a row with an expiry that the leader renews):

- it is released the moment the leader's session ends: a leader killed -9 closes its socket,
  Postgres ends the session and the standby's blocked ``pg_advisory_lock`` returns within
  milliseconds; a lease is taken over only once it expires, so its TTL is the takeover time;
- a waiting standby costs nothing: no renewals, no polling, no clock to agree on;
- it lives in the same Postgres as the epoch that fences every write (``store``): the lock
  decides who may take the epoch, the epoch refuses whatever a replaced leader still sends.

A leader whose host vanishes without closing its socket is noticed by Postgres's TCP
keepalives, set short on the lock session (about 4 s). The leader itself checks its lock
session and the epoch every ``check_s``: the epoch moved, or the session gone and not re-taken
(epoch unchanged) within ``lost_s``, and it is :class:`store.Deposed` -- it stops serving, so it
does not keep taking messages of the scheduler's queue group from the one that leads now.

A Postgres restart ends every session at once, the leader's and the standby's alike: whoever
reconnects first would get the lock, and a live leader would be replaced for nothing (a full
takeover). So the leader, its lock session gone, is woken at once (a termination listener) and
tries to re-take the lock every ``retake_s``; a standby whose own session was cut off (Postgres
out of its reach: it may have been out of the leader's too) does not contend until it has seen
the lock free for ``grace_s`` -- longer than a live leader takes to come back. A standby whose
session held on while the lock came free (the leader died, Postgres up) takes it at once, as
before. Either way only the lock's holder takes an epoch, so the epoch stays the fence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import asyncpg

from services.scheduler import store
from tangram import db

log = logging.getLogger(__name__)

LOCK_ID = 0x7A4E_5344  # the session advisory lock of the lead (db's migration lock differs)
# Lock sessions are named so: not matched by store.fence's 'tangram-scheduler %', which ends
# the sessions of replaced schedulers, not the waits of the standbys.
LOCK_SESSIONS = "tangram-scheduler-lead"
RECONNECT = db.Backoff(first_s=0.1, max_s=2.0)
# The lead lock's rows in pg_locks. Advisory locks are per database and pg_locks shows the
# whole server's: without the database, another mesh's leader on the same server would look
# like this one's (a standby's grace cut short, the wrong holder shown).
_LOCK_ROWS = (
    "l.locktype = 'advisory' AND l.classid = 0 AND l.objid = $1 AND l.objsubid = 1"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)
_HELD = f"SELECT EXISTS (SELECT 1 FROM pg_locks l WHERE {_LOCK_ROWS} AND l.granted)"


@dataclass(frozen=True, slots=True)
class LeadConfig:
    check_s: float = 1.0  # how often the leader checks its lock session and the epoch
    lost_s: float = 5.0  # how long it may be without its lock session before it stops
    wait_s: float = 30.0  # a standby re-issues its wait this often (a dead session shows)
    # a standby cut off from Postgres contends only once the lock has been free this long
    # after it is back (a live leader re-takes it within about retake_s of Postgres's return)
    grace_s: float = 3.0
    retake_s: float = 0.2  # how often a leader that lost its lock session tries to re-take it
    poll_s: float = 0.2  # how often a standby in its grace looks whether the lock is held


def session_name() -> str:
    """This process's lock session: host and pid say which process leads (see holder)."""
    return f"{LOCK_SESSIONS} {socket.gethostname()[:24]}:{os.getpid()} {uuid.uuid4().hex[:6]}"


class Lead:
    """This scheduler's hold on the lead: :meth:`acquire` once (a standby waits there), then
    :meth:`watch` while it serves; :meth:`close` lets the lock go."""

    def __init__(
        self, dsn: str, cfg: LeadConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.dsn = dsn
        self.cfg = cfg
        self.clock = clock
        self.name = session_name()
        self._conn: asyncpg.Connection | None = None
        self._broken = asyncio.Event()  # the held lock session closed: check at once
        self._closed = False  # let go for good: a watch still running never re-takes it

    async def __aenter__(self) -> Lead:
        await self.acquire()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _connect(self, timeout_s: float = 10.0) -> asyncpg.Connection:
        settings = {
            "application_name": self.name,
            "lock_timeout": f"{int(self.cfg.wait_s * 1000)}ms",
            # Postgres ends the session of a leader whose host went silent after ~4 s
            "tcp_keepalives_idle": "1",
            "tcp_keepalives_interval": "1",
            "tcp_keepalives_count": "3",
        }
        conn: asyncpg.Connection = await asyncpg.connect(
            self.dsn, timeout=timeout_s, server_settings=settings
        )
        return conn

    async def acquire(self) -> None:
        """Return once this process holds the lock; until then wait, idle, as a standby."""
        delay, said, cut_off = RECONNECT.first_s, False, False
        while self._conn is None:
            conn: asyncpg.Connection | None = None
            try:
                conn = await self._connect()
                delay = RECONNECT.first_s  # the next outage backs off afresh
                if cut_off:  # Postgres was out of reach: let a live leader come back first
                    await self._grace(conn)
                if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", LOCK_ID):
                    if not said:
                        log.info("standing by: waiting for the scheduler lead (%s)", self.name)
                        said = True
                    await self._wait(conn)
                self._hold(conn)
            except BaseException as exc:
                if conn is not None:
                    conn.terminate()
                if not isinstance(exc, Exception) or not db.transient(exc):
                    raise
                log.warning("lead lock: %s; retrying in %.1fs", exc, delay)
                cut_off = True
                await asyncio.sleep(delay)
                delay = min(RECONNECT.max_s, delay * 2)
        log.info("took the scheduler lead lock (%s)", self.name)

    def _hold(self, conn: asyncpg.Connection) -> None:
        """Keep ``conn`` as the lock session; its end wakes :meth:`watch` at once."""
        self._conn = conn
        self._broken.clear()
        conn.add_termination_listener(lambda _: self._broken.set())

    async def _grace(self, conn: asyncpg.Connection) -> None:
        """Return once the lock is held (then wait in it as usual) or has been seen free for
        ``grace_s`` (then contend): a leader that lost its session to the same outage re-takes
        the lock within that, and keeps the lead."""
        free_since = self.clock()
        while not await conn.fetchval(_HELD, LOCK_ID):
            if self.clock() - free_since >= self.cfg.grace_s:
                log.warning("the lead lock stayed free for %.1fs: contending", self.cfg.grace_s)
                return
            await asyncio.sleep(self.cfg.poll_s)

    async def _wait(self, conn: asyncpg.Connection) -> None:
        """Block in the lock. Every ``wait_s`` the server ends the wait (lock_timeout) and it is
        issued again; a connection that died silently does not answer within that, and the
        client's own timeout (TimeoutError, transient) has the caller connect afresh."""
        while True:
            try:
                sql = "SELECT pg_advisory_lock($1)"
                await conn.execute(sql, LOCK_ID, timeout=self.cfg.wait_s + 5)
                return
            except asyncpg.LockNotAvailableError:
                continue

    async def watch(self, epoch: int) -> None:
        """Check the lock session and the epoch every ``check_s``; returns only once the lock
        was let go (``close``). Raises :class:`store.Deposed` once another scheduler leads, or
        once the session has been lost for ``lost_s`` without being re-taken with the epoch
        unchanged."""
        lost_at: float | None = None
        while True:
            await self._next_check(lost=lost_at is not None)
            if self._closed:
                return
            if await self._holds(epoch):
                if lost_at is not None:
                    log.warning("re-took the lead lock, epoch %d unchanged", epoch)
                lost_at = None
                continue
            now = self.clock()
            lost_at = now if lost_at is None else lost_at
            if now - lost_at >= self.cfg.lost_s:
                raise store.Deposed(
                    f"scheduler epoch {epoch} lost its lead lock for {self.cfg.lost_s:.0f}s"
                )

    async def _next_check(self, lost: bool) -> None:
        """Until the next check: ``check_s``, or at once when the lock session ends; while it is
        lost, ``retake_s`` (the lock re-taken before a standby's grace runs out)."""
        if lost:
            await asyncio.sleep(min(self.cfg.retake_s, self.cfg.check_s))
            return
        # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancellation that
        # comes as the event is set, and the watch went on (and re-took the lock) after it
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.cfg.check_s):
                await self._broken.wait()
        self._broken.clear()

    async def _holds(self, epoch: int) -> bool:
        """Whether the lock session is up (re-taking it if it was lost) and ``epoch`` leads;
        raises :class:`store.Deposed` when another epoch leads."""
        try:
            if self._conn is None:
                conn = await self._retake(epoch)
                if conn is None:
                    return False
                self._hold(conn)
            assert self._conn is not None
            await asyncio.wait_for(store.check_lead(self._conn, epoch), self.cfg.check_s * 2)
            return True
        except store.Deposed:
            raise
        except Exception as exc:
            if not db.transient(exc):
                raise
            if self._conn is not None:  # said once; the attempts to re-take it are not
                log.warning("lead lock session lost: %s", exc or type(exc).__name__)
                self._conn.terminate()
                self._conn = None
            return False

    async def _retake(self, epoch: int) -> asyncpg.Connection | None:
        """A new lock session holding the lock, or None while another session holds it (the
        old one of this process may linger: it is ended first). Raises
        :class:`store.Deposed` once another epoch leads."""
        conn = await self._connect(self.cfg.check_s * 2)
        if self._closed:  # let go while this connected: never taken again
            conn.terminate()
            return None
        try:  # this process's old session: ended, waiting up to 2 s until it is gone
            await conn.execute(
                "SELECT pg_terminate_backend(pid, 2000) FROM pg_stat_activity"
                " WHERE application_name = $1 AND pid <> pg_backend_pid()",
                self.name,
            )
            if await conn.fetchval("SELECT pg_try_advisory_lock($1)", LOCK_ID):
                return conn
            await store.check_lead(conn, epoch)  # a standby holds it: has it taken over yet?
        except BaseException:
            conn.terminate()
            raise
        conn.terminate()
        return None

    async def close(self) -> None:
        """Let the lock go for good (ending the session releases it)."""
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                await asyncio.wait_for(conn.close(), 5)
            except Exception:
                conn.terminate()


async def lock_sessions(conn: asyncpg.Connection) -> tuple[str | None, list[str]]:
    """The session name of the leader (None: no one leads) and those of the standbys."""
    rows = await conn.fetch(
        "SELECT l.granted, s.application_name FROM pg_locks l JOIN pg_stat_activity s"
        f" USING (pid) WHERE {_LOCK_ROWS}",
        LOCK_ID,
    )
    holder = next((r["application_name"] for r in rows if r["granted"]), None)
    return holder, [r["application_name"] for r in rows if not r["granted"]]
