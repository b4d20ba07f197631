"""The warm pool: pre-created, ready containers per image, so that a new trajectory's first
action does not wait for container creation. A refill task tops it up whenever it runs low."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import TYPE_CHECKING

from services.cpu_manager.docker import executor_client
from services.cpu_manager.docker.engine import DockerFailure

if TYPE_CHECKING:
    from services.cpu_manager.docker.backend import ContainerEnv, DockerBackend

log = logging.getLogger(__name__)


class WarmPool:
    """Ready containers per image; ``take`` is O(1) plus one executor ping."""

    def __init__(self, backend: DockerBackend) -> None:
        self.backend = backend
        self.target = backend.cfg.warm_pool
        self.images = backend.cfg.images_to_pool()
        self._ready: dict[str, deque[ContainerEnv]] = {image: deque() for image in self.images}
        self._wanted = asyncio.Event()
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    def size(self, image: str | None = None) -> int:
        """Ready containers for ``image`` (default image when None)."""
        return len(self._ready.get(image or self.backend.cfg.image, ()))

    def start(self) -> None:
        """Start filling (owned task; stopped by ``stop``)."""
        if self.target > 0:
            self._wanted.set()
            self._task = asyncio.get_running_loop().create_task(self._refill_loop(), name="pool")

    async def stop(self) -> None:
        """Stop refilling (ready containers stay until ``drain``)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def drain(self) -> list[ContainerEnv]:
        """Hand every ready container over (for removal)."""
        envs = [env for ready in self._ready.values() for env in ready]
        for ready in self._ready.values():
            ready.clear()
        return envs

    async def take(self, image: str) -> ContainerEnv | None:
        """A ready container for ``image``, or None (then the caller creates one cold)."""
        ready = self._ready.get(image)
        while ready:
            env = ready.popleft()
            self._wanted.set()
            if await self._alive(env):
                return env
            self.backend.quarantine(env, "warm-pool container died while idle")
        if ready is not None:
            self.backend.stats["pool_misses"] += 1
        return None

    async def _alive(self, env: ContainerEnv) -> bool:
        if env.exec_mode != "executor":
            return True  # docker_exec mode finds out on its first exec
        try:
            await executor_client.ping(env.spec.socket_path, env.init_pid)
        except executor_client.ExecutorGone:
            return False
        return True

    async def wait_full(self, image: str | None = None, timeout_s: float = 60.0) -> None:
        """Wait until the pool of ``image`` holds its target (tests, benchmarks, warm start)."""
        image = image or self.backend.cfg.image
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(lambda: self.size(image) >= self.target)

    async def _refill_loop(self) -> None:
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            for image in self.images:
                missing = self.target - len(self._ready[image])
                if missing <= 0:
                    continue
                results = await asyncio.gather(
                    *(self._make(image) for _ in range(missing)), return_exceptions=True
                )
                if any(isinstance(r, BaseException) for r in results):
                    await asyncio.sleep(self.backend.cfg.pool_retry_s)  # back off, then retry
                    self._wanted.set()

    async def _make(self, image: str) -> None:
        cfg = self.backend.cfg
        try:
            env = await self.backend.create(image, cfg.pool_memory_mb, network=False)
        except DockerFailure as exc:
            self.backend.stats["pool_errors"] += 1
            log.warning("warm pool: cannot create a container of %s: %s", image, exc.detail)
            raise
        if env.cgroup is not None and env.pin_by_cgroup and cfg.park_idle:
            with contextlib.suppress(OSError):
                env.cgroup.park()
        self._ready[image].append(env)
        async with self._changed:
            self._changed.notify_all()
