"""The Docker backend's environment tiering: the async shell around ``tiers.plan``.

Every ``tick_s`` the backend's idle environments are moved down as the policy says: paused
(``docker pause``) or put on disk (paused, work directory saved to a snapshot file, container
removed). An environment's next action brings it back first (:meth:`Tiering.wake`): unpaused, or
restored into a new container with exactly its files. One lock per trajectory orders moves,
wakes and drops of one environment; an environment with an action running or arriving (the
backend's ``_runs``) is never moved. Docker and file I/O run on the backend's threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from services.cpu_manager.docker.engine import DockerFailure
from services.cpu_manager.docker.snapshots import SnapshotError, SnapshotMeta, SnapshotStore
from services.cpu_manager.docker.tiers import EnvView, Move, Tier, TierPolicy, plan
from tangram.contract import ErrorKind

if TYPE_CHECKING:
    from services.cpu_manager.docker.backend import ContainerEnv, DockerBackend

log = logging.getLogger(__name__)


class Tiering:
    """Which environments are paused or on disk, and the moves between tiers."""

    def __init__(self, backend: DockerBackend, policy: TierPolicy, tick_s: float) -> None:
        self.backend = backend
        self.policy = policy
        self.tick_s = tick_s
        self.store = SnapshotStore(backend.root / "snapshots")
        self.paused: dict[str, str] = {}  # trajectory -> its paused container's id
        self.on_disk: dict[str, SnapshotMeta] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._loop: asyncio.Task[None] | None = None

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Take back the snapshots an earlier incarnation left; start moving idle ones."""
        self.on_disk = await self.backend.call(self.store.scan)
        if self.on_disk:
            log.info("%d environments on disk taken back", len(self.on_disk))
        if self.policy.pause_after_s > 0 or self.policy.disk_after_s > 0 or self.policy.budget_mb:
            self._loop = asyncio.get_running_loop().create_task(self._run(), name="tiering")

    async def stop(self) -> None:
        """Stop moving (snapshots stay on disk for the next incarnation)."""
        if self._loop is not None:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
            self._loop = None

    async def _run(self) -> None:
        """Tick until stopped; a failed tick is logged and counted, and the next one runs
        (an environment it could not move stays where it is, whole)."""
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                await self.tick()
            except DockerFailure as exc:  # the engine is away
                self.backend.stats["tier_tick_failures"] += 1
                log.warning("tiering tick failed: %s", exc.detail)
            except Exception:
                self.backend.stats["tier_tick_failures"] += 1
                log.exception("tiering tick failed")

    # ---------------------------------------------------------------- reads

    def envs(self) -> dict[str, float]:
        """On-disk environments -> last use on the backend's monotonic clock."""
        offset = self.backend.clock() - time.time()
        return {tid: meta.last_used + offset for tid, meta in self.on_disk.items()}

    def tier_of(self, trajectory_id: str) -> Tier | None:
        if trajectory_id in self.on_disk:
            return Tier.DISK
        env = self.backend.env(trajectory_id)
        if env is None:
            return None
        return Tier.PAUSED if self._is_paused(env) else Tier.RUNNING

    def _is_paused(self, env: ContainerEnv) -> bool:
        return self.paused.get(env.trajectory_id) == env.container_id

    def _busy(self) -> set[str]:
        return {run.req.trajectory_id for run in self.backend._runs.values()}

    def views(self) -> list[EnvView]:
        busy = self._busy()
        views = [
            EnvView(tid, self.tier_of(tid) or Tier.RUNNING, e.last_used, e.memory_mb, tid in busy)
            for tid, e in self.backend._envs.items()
        ]
        on_disk = self.envs()
        return views + [
            EnvView(tid, Tier.DISK, on_disk[tid], meta.memory_mb, tid in busy)
            for tid, meta in self.on_disk.items()
        ]

    # ---------------------------------------------------------------- moves

    @contextlib.asynccontextmanager
    async def locked(self, trajectory_id: str) -> AsyncIterator[None]:
        """Hold the environment still: no move, wake or drop of it meanwhile."""
        lock = self._locks.setdefault(trajectory_id, asyncio.Lock())
        try:
            async with lock:
                yield
        finally:
            if not lock.locked() and self._locks.get(trajectory_id) is lock:
                del self._locks[trajectory_id]

    async def tick(self) -> list[Move]:
        """Make the moves the policy asks for now; returns them."""
        moves = plan(self.views(), self.backend.clock(), self.policy)
        for move in moves:
            async with self.locked(move.trajectory_id):
                if move.trajectory_id in self._busy():
                    continue  # an action arrived meanwhile
                if move.to is Tier.DISK:
                    await self._to_disk(move.trajectory_id)
                else:
                    await self._pause(move.trajectory_id)
        return moves

    async def _pause(self, tid: str) -> bool:
        env = self.backend.env(tid)
        if env is None:
            return False
        if self._is_paused(env):
            return True
        try:
            await self.backend.call(self.backend.engine.pause, env.container_id)
        except DockerFailure as exc:
            log.warning("could not pause %s: %s", env.spec.name, exc.detail)
            return False
        self.paused[tid] = env.container_id
        self.backend.stats["paused"] += 1
        return True

    async def _to_disk(self, tid: str) -> None:
        env = self.backend.env(tid)
        if env is None or not await self._pause(tid):  # frozen: no write lands mid-copy
            return
        meta = SnapshotMeta(
            trajectory_id=tid,
            image=env.image,
            memory_mb=env.memory_mb,
            network=env.spec.network,
            last_used=env.last_used - self.backend.clock() + time.time(),
        )
        try:
            meta = await self.backend.call(self.store.save, meta, env.spec.host_dir / "work")
        except OSError as exc:  # disk full, say: it stays paused, memory kept
            log.warning("could not save %s to disk: %s", env.spec.name, exc)
            self.backend.stats["snapshot_failures"] += 1
            return
        self.on_disk[tid] = meta  # complete on disk: the container may go now
        del self.backend._envs[tid]
        self.paused.pop(tid, None)
        await self.backend._remove(env)
        self.backend.stats["to_disk"] += 1

    async def wake(self, trajectory_id: str) -> ContainerEnv | None:
        """Bring an environment back for its next action: unpause it, or restore it."""
        async with self.locked(trajectory_id):
            if trajectory_id in self.on_disk:
                return await self._restore(trajectory_id)
            env = self.backend.env(trajectory_id)
            if env is not None and self._is_paused(env):
                try:
                    await self.backend.call(self.backend.engine.unpause, env.container_id)
                except DockerFailure as exc:
                    failure, detail = await self.backend.diagnose(env, exc.detail)
                    self.backend.quarantine(env, detail)
                    raise DockerFailure(failure, detail) from exc
                finally:
                    self.paused.pop(trajectory_id, None)
                self.backend.stats["unpaused"] += 1
            return env

    async def _restore(self, tid: str) -> ContainerEnv:
        meta = self.on_disk[tid]
        env = await self._container_for(meta)
        try:
            await self.backend.call(self.store.restore, tid, env.spec.host_dir)
        except SnapshotError as exc:
            await self.backend._remove(env)
            del self.on_disk[tid]
            await self.backend.call(self.store.delete, tid)
            raise DockerFailure(ErrorKind.ENVIRONMENT_LOST, f"environment lost: {exc}") from exc
        except BaseException:
            await self.backend._remove(env)  # the snapshot stays: the next action tries again
            raise
        env.trajectory_id = tid
        env.last_used = self.backend.clock()
        self.backend._envs[tid] = env
        del self.on_disk[tid]
        await self.backend.call(self.store.delete, tid)  # only now: a crash keeps one copy
        self.backend.stats["restored"] += 1
        return env

    async def _container_for(self, meta: SnapshotMeta) -> ContainerEnv:
        """A warm-pool container when there is one (no creation on the restore's path)."""
        env = None if meta.network else await self.backend.pool.take(meta.image)
        if env is None:
            return await self.backend.create(meta.image, meta.memory_mb, meta.network)
        self.backend.stats["pool_restores"] += 1
        if env.memory_mb != meta.memory_mb:
            await self.backend._resize(env, meta.memory_mb)
        return env

    async def forget(self, trajectory_id: str) -> None:
        """The environment is dropped: its snapshot goes too (call while ``locked``)."""
        self.paused.pop(trajectory_id, None)
        if self.on_disk.pop(trajectory_id, None) is not None:
            await self.backend.call(self.store.delete, trajectory_id)
