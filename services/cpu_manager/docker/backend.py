"""The Docker backend of the CPU node agent: allocate-on-execution (§5.2 of arl-tangram).

One long-lived, locked-down container per trajectory holds its state (memory reserved for the
trajectory's life); before each action the container's cpuset and CPU quota are set to exactly
the granted cores (cgroup files, or ``docker update``), and the action runs through the
in-container executor (or ``docker exec``). A warm pool per image hides container creation
from a trajectory's first action. Broken containers are quarantined; the trajectory's next
action learns its environment was lost. Docker SDK calls run on a thread pool, never the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from services.cpu_manager.action_env import action_environ
from services.cpu_manager.backend_api import ExecOutcome, ExecRequest, failed_outcome
from services.cpu_manager.docker import cgroup, executor_client
from services.cpu_manager.docker.config import DockerConfig
from services.cpu_manager.docker.engine import (
    LABEL_INCARNATION,
    LABEL_NODE,
    ContainerSpec,
    DockerFailure,
    Engine,
    ExecutorUnavailable,
    remove_dir,
)
from services.cpu_manager.docker.pool import WarmPool
from services.cpu_manager.docker.run import (
    ActionRun,
    exec_via_docker,
    exec_via_executor,
    oom_checked,
)
from services.cpu_manager.docker.tiering import Tiering
from tangram.agent.starts import Starts
from tangram.contract import ErrorKind

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_SOCKET_PATH = 107
EXIT_SEEN_S = 5.0  # how long an executor seen gone may take to be seen exited by the engine


class State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(eq=False)
class ContainerEnv:
    """One container and what the backend knows about it."""

    spec: ContainerSpec
    container_id: str
    cgroup: cgroup.ContainerCgroup | None  # read for OOM kills; written when pin_by_cgroup
    memory_mb: int
    pin_by_cgroup: bool
    init_pid: int = 0  # host pid of the container's init (the executor); 0 if not visible
    trajectory_id: str = ""
    last_used: float = 0.0
    active: dict[str, tuple[int, ...]] = field(default_factory=dict)  # action -> cores
    cpu_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # orders its `docker update`s

    @property
    def image(self) -> str:
        return self.spec.image

    @property
    def exec_mode(self) -> str:
        """How actions reach this container: "executor" or "docker_exec"."""
        return self.spec.exec_mode

    def cores(self) -> tuple[int, ...]:
        """The cores of every action running here now."""
        return tuple(sorted({c for cs in self.active.values() for c in cs}))


def _visible(pid: int) -> int:
    """``pid`` if that host pid is visible from here (same pid namespace), else 0."""
    return pid if pid > 0 and Path(f"/proc/{pid}").exists() else 0


class DockerBackend:
    """Per-trajectory Docker containers with cores pinned per action."""

    name = "docker"
    isolates = True

    def __init__(self, cfg: DockerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self.root = Path(cfg.root).resolve()
        self.engine = Engine(cfg)
        self.stats: Counter[str] = Counter()
        # Launches for the health detector (see ``run.py``): a request handed to a ready
        # container's executor. Creating, pulling, waking or pinning a container is none.
        self.starts = Starts()
        self._threads = ThreadPoolExecutor(cfg.threads, thread_name_prefix="docker")
        # The canary's own thread: not queued behind the pool, which a healthy node's
        # removals, creations and restores may hold for seconds (see ``canary``).
        self._canary_thread = ThreadPoolExecutor(1, thread_name_prefix="docker-canary")
        self._envs: dict[str, ContainerEnv] = {}
        self._creating: dict[str, asyncio.Future[ContainerEnv]] = {}
        self._lost: dict[str, str] = {}
        self._runs: dict[str, ActionRun] = {}
        self._exec_modes: dict[str, str] = {}  # image -> "docker_exec" where the executor failed
        self._cleanup: set[asyncio.Task[None]] = set()
        self.pool = WarmPool(self)
        self.tiers = Tiering(self, cfg.tier_policy(), cfg.tier_tick_s)
        self._state = State.NEW

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Connect to the engine, remove an earlier incarnation's containers, start the pool."""
        version = await self.call(self.engine.connect)
        await self.call(self.engine.install_executor, self.root)
        stale = await self._sweep(mine=False)
        log.info(
            "docker backend: engine %s, %d leftovers removed, exec via %s",
            version,
            stale,
            self.cfg.exec_mode,
        )
        await self.tiers.start()
        self._state = State.RUNNING
        self.pool.start()

    async def __aenter__(self) -> DockerBackend:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Kill running actions, remove every container of this incarnation (idempotent)."""
        if self._state in (State.CLOSING, State.CLOSED):
            return
        self._state = State.CLOSING
        await self.pool.stop()
        await self.tiers.stop()
        for action_id in list(self._runs):
            await self.kill(action_id)
        envs = [*self._envs.values(), *self.pool.drain()]
        self._envs.clear()
        await asyncio.gather(*(self._remove(env) for env in envs), return_exceptions=True)
        if self._cleanup:
            await asyncio.wait(set(self._cleanup), timeout=self.cfg.api_timeout_s)
        with contextlib.suppress(DockerFailure):
            await self._sweep(mine=True)  # anything a cancelled creation left behind
        await self.call(self.engine.close)
        self._threads.shutdown(wait=False)
        self._canary_thread.shutdown(wait=False)
        self._state = State.CLOSED

    async def _sweep(self, mine: bool) -> int:
        """Remove this node's containers (of this incarnation, or of earlier ones) and dirs."""
        found = await self.call(self.engine.containers, mine)
        for cid, name in found:
            await self.call(self.engine.remove, cid)
            if name:
                await self.call(remove_dir, self.root / name)
        return len(found)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking (Docker SDK) call on the backend's threads."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)

    async def canary(self) -> None:
        """The health detector's canary: the engine answers a ping through the client every
        action's calls take (a wedged engine never answers). On a thread of its own, not
        queued behind the pool: a mass of removals (trajectories dropped at a step's end),
        creations or restores may hold every pool thread for longer than the probe timeout
        on a healthy node, and each pool call is bounded by ``api_timeout_s`` anyway, so the
        pool cannot stay wedged. It holds no container and no core: it runs beside whatever
        runs. It does not reach the executors inside the containers: one of them wedged is
        its environment's failure (its action hangs, the container is quarantined), not
        the node's."""
        api = self.engine.api
        await asyncio.get_running_loop().run_in_executor(self._canary_thread, api.ping)

    # ---------------------------------------------------------------- Backend API

    def envs(self) -> dict[str, float]:
        """Trajectory environments (running, paused or on disk) -> monotonic time of last use."""
        return self.tiers.envs() | {tid: env.last_used for tid, env in self._envs.items()}

    def envs_on_disk(self) -> tuple[str, ...]:
        """The environments holding no memory now (saved to disk, their containers removed)."""
        return tuple(self.tiers.on_disk)

    def env(self, trajectory_id: str) -> ContainerEnv | None:
        """The environment of a trajectory, if it has one."""
        return self._envs.get(trajectory_id)

    async def run(self, req: ExecRequest) -> ExecOutcome:
        """Run one action in its trajectory's container, on exactly ``req.cores``."""
        started = time.time()
        if self._state is not State.RUNNING:
            msg = f"docker backend is {self._state.value}"
            return failed_outcome(ErrorKind.BACKEND_UNAVAILABLE, msg, started)
        if not req.cores:
            return failed_outcome(ErrorKind.INTERNAL, "no cores granted", started)
        lost = self._lost.pop(req.trajectory_id, None)
        if lost is not None:
            return failed_outcome(ErrorKind.ENVIRONMENT_LOST, lost, started)
        run = ActionRun(req)
        self._runs[req.action_id] = run  # before its container exists: a kill meanwhile counts
        try:
            env = await self._env_for(req)
            return await self._run_in(env, run)
        except DockerFailure as exc:
            if run.kill_reason is not None:
                return failed_outcome(run.kill_reason, f"killed on request ({exc.detail})", started)
            return failed_outcome(exc.failure, exc.detail, started)
        finally:
            del self._runs[req.action_id]

    async def kill(self, action_id: str, reason: ErrorKind = ErrorKind.CANCELLED) -> bool:
        """Kill a running action's process group; True if it was running."""
        run = self._runs.get(action_id)
        if run is None:
            return False
        run.kill_reason = run.kill_reason or reason
        if run.call is not None:
            run.call.kill()
        elif run.exec_id:  # before the exec exists, exec_via_docker sees kill_reason instead
            with contextlib.suppress(DockerFailure):
                await self.call(self.engine.kill_exec, run.exec_id)
        return True

    async def drop_env(self, trajectory_id: str) -> None:
        """Kill a trajectory's actions, remove its container and files; a container still being
        made for it is waited for, then removed too."""
        self._lost.pop(trajectory_id, None)
        for run in [r for r in self._runs.values() if r.req.trajectory_id == trajectory_id]:
            await self.kill(run.req.action_id)
        async with self.tiers.locked(trajectory_id):  # not mid-move: a snapshot or a restore
            pending = self._creating.get(trajectory_id)
            if pending is not None:
                await asyncio.wait({pending})  # its outcome is the creator's to report
            await self.tiers.forget(trajectory_id)
            env = self._envs.pop(trajectory_id, None)
            if env is not None:
                await self._remove(env)

    # ---------------------------------------------------------------- environments

    async def _env_for(self, req: ExecRequest) -> ContainerEnv:
        env = await self.tiers.wake(req.trajectory_id)  # paused or on disk: back first
        if env is not None:
            return env
        pending = self._creating.get(req.trajectory_id)
        if pending is not None:
            return await asyncio.shield(pending)
        if len(self._envs) + len(self._creating) >= self.cfg.max_envs:
            self.stats["cap_refusals"] += 1
            raise DockerFailure(
                ErrorKind.BACKEND_UNAVAILABLE,
                f"node {self.cfg.node_id} holds its cap of {self.cfg.max_envs} environments",
            )
        fut: asyncio.Future[ContainerEnv] = asyncio.get_running_loop().create_future()
        self._creating[req.trajectory_id] = fut
        try:
            env = await self._claim_or_create(req)
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: concurrent waiters re-raise it themselves
            raise
        finally:
            del self._creating[req.trajectory_id]
        env.trajectory_id = req.trajectory_id
        env.last_used = self.clock()
        self._envs[req.trajectory_id] = env
        fut.set_result(env)
        return env

    async def _claim_or_create(self, req: ExecRequest) -> ContainerEnv:
        image = req.image or self.cfg.image
        memory = req.memory_mb or self.cfg.pool_memory_mb
        env = None if req.network else await self.pool.take(image)
        if env is None:
            self.stats["cold_creates"] += 1
            return await self.create(image, memory, req.network)
        self.stats["pool_hits"] += 1
        if env.memory_mb != memory:
            await self._resize(env, memory)
        return env

    async def _resize(self, env: ContainerEnv, memory_mb: int) -> None:
        """Give a pool container the memory its trajectory asked for."""
        try:
            if env.cgroup is not None and env.pin_by_cgroup:
                env.cgroup.set_memory(memory_mb * 2**20)  # docker's record of it goes stale
            else:
                await self.call(self.engine.update_memory, env.container_id, memory_mb)
        except (OSError, DockerFailure) as exc:
            self.quarantine(env, f"memory update failed: {exc}")
            raise DockerFailure(ErrorKind.INTERNAL, f"memory update failed: {exc}") from exc
        env.memory_mb = memory_mb

    async def create(self, image: str, memory_mb: int, network: bool) -> ContainerEnv:
        """Make and start a new container; an image whose executor cannot start (no python3)
        gets ``docker exec`` instead, for this and every later container of it."""
        mode = self._exec_modes.get(image, self.cfg.exec_mode)
        try:
            return await self._create(image, memory_mb, network, mode)
        except ExecutorUnavailable as exc:
            log.warning("%s; environments of %s use docker exec", exc.detail, image)
            self._exec_modes[image] = "docker_exec"
            self.stats["executor_fallbacks"] += 1
            return await self._create(image, memory_mb, network, "docker_exec")

    async def _create(self, image: str, memory_mb: int, network: bool, mode: str) -> ContainerEnv:
        name = f"tg-{self.cfg.node_id[:24]}-{uuid.uuid4().hex[:10]}"
        labels = {LABEL_NODE: self.cfg.node_id, LABEL_INCARNATION: self.cfg.incarnation}
        spec = ContainerSpec(name, image, memory_mb, network, self.root / name, labels, mode)
        if len(str(spec.socket_path)) > MAX_SOCKET_PATH:
            raise DockerFailure(ErrorKind.INTERNAL, f"socket path too long: {spec.socket_path}")
        try:
            started = await self.call(self.engine.create, spec)
        except DockerFailure:
            await self._discard(name, spec.host_dir)
            raise
        try:
            found = self._locate(started.pid)
        except DockerFailure:
            await self._discard(started.container_id, spec.host_dir)
            raise
        pin = found is not None and self.cfg.cpuset_via != "docker"
        env = ContainerEnv(spec, started.container_id, found, memory_mb, pin, _visible(started.pid))
        if mode == "executor":
            await self._wait_executor(env)
        self.stats["created"] += 1
        return env

    async def _wait_executor(self, env: ContainerEnv) -> None:
        """Until the executor answers; if it exited instead, the image cannot run it."""
        try:
            await executor_client.wait_ready(
                env.spec.socket_path, self.cfg.ready_timeout_s, env.init_pid
            )
        except executor_client.ExecutorGone as exc:
            state = await self.call(self.engine.state_after_exit, env.container_id, EXIT_SEEN_S)
            logs = await self.call(self.engine.logs_tail, env.container_id)
            await self._remove(env)
            detail = f"executor in {env.image} did not start: {exc}; logs: {logs}"
            if state is not None and _exited_by_itself(state):
                raise ExecutorUnavailable(detail) from exc
            raise DockerFailure(ErrorKind.INTERNAL, detail) from exc

    def _locate(self, pid: int) -> cgroup.ContainerCgroup | None:
        found = cgroup.locate(pid, Path(self.cfg.cgroup_root))
        if found is None and self.cfg.cpuset_via == "cgroup":
            raise DockerFailure(ErrorKind.INTERNAL, "container cgroup not writable from here")
        return found

    def quarantine(self, env: ContainerEnv, reason: str, tell_next: bool = False) -> None:
        """Take a broken container out of service and remove it in the background."""
        log.warning("quarantining %s (%s): %s", env.spec.name, env.trajectory_id, reason)
        self.stats["quarantined"] += 1
        if env.trajectory_id and self._envs.get(env.trajectory_id) is env:
            del self._envs[env.trajectory_id]
            if tell_next:
                self._lost[env.trajectory_id] = f"environment lost: {reason}"
        task = asyncio.get_running_loop().create_task(self._remove(env))
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)

    async def _remove(self, env: ContainerEnv) -> None:
        await self._discard(env.container_id, env.spec.host_dir)

    async def _discard(self, container: str, host_dir: Path) -> None:
        """Remove a container (by id or name) and its host directory."""
        try:
            await self.call(self.engine.remove, container)
        except DockerFailure as exc:
            log.warning("could not remove %s: %s", container[:24], exc.detail)
        await self.call(remove_dir, host_dir)

    async def diagnose(self, env: ContainerEnv, why: str) -> tuple[ErrorKind, str]:
        """After the executor or exec failed: is the container dead, OOM-killed, or hung?"""
        state = await self.call(self.engine.state, env.container_id)
        if state is None:
            return ErrorKind.ENVIRONMENT_LOST, f"container {env.spec.name} vanished ({why})"
        if state.get("OOMKilled"):
            return ErrorKind.OOM_KILLED, f"container {env.spec.name} was OOM-killed ({why})"
        if not state.get("Running"):
            return ErrorKind.ENVIRONMENT_LOST, (
                f"container {env.spec.name} stopped with status {state.get('ExitCode')} ({why})"
            )
        return ErrorKind.ENVIRONMENT_LOST, f"container {env.spec.name} is broken ({why})"

    # ---------------------------------------------------------------- actions

    async def _run_in(self, env: ContainerEnv, run: ActionRun) -> ExecOutcome:
        req = run.req
        if run.kill_reason is not None:  # killed while its container was being made
            return failed_outcome(run.kill_reason, "killed on request before it started")
        env.active[req.action_id] = req.cores
        env.last_used = self.clock()
        try:
            await self._pin(env)
            if run.kill_reason is not None:  # killed while its cores were being set
                return failed_outcome(run.kill_reason, "killed on request before it started")
            return await self._exec(env, run)
        finally:
            env.active.pop(req.action_id, None)
            env.last_used = self.clock()
            await self._unpin(env)

    async def _exec(self, env: ContainerEnv, run: ActionRun) -> ExecOutcome:
        ooms = env.cgroup.oom_kills() if env.cgroup is not None else None
        since = time.time()
        if env.exec_mode == "executor":
            outcome = await exec_via_executor(self, env, run)
        else:
            outcome = await exec_via_docker(self, env, run)
        return await oom_checked(self, env, run, outcome, ooms, since)

    async def _pin(self, env: ContainerEnv) -> None:
        """Set the container's cpuset and quota to the cores of its running actions."""
        if env.cgroup is not None and env.pin_by_cgroup:
            try:
                env.cgroup.set_cpus(env.cores())  # a few cgroupfs writes: microseconds
            except OSError as exc:
                await self._unpinnable(env, f"cgroup write failed: {exc}", exc)
            return
        try:
            async with env.cpu_lock:  # updates of one container land in the order they were asked
                await self.call(self.engine.update_cpus, env.container_id, env.cores())
        except DockerFailure as exc:
            if exc.failure is ErrorKind.BACKEND_UNAVAILABLE:
                raise
            await self._unpinnable(env, f"docker update failed: {exc.detail}", exc)

    async def _unpinnable(self, env: ContainerEnv, why: str, cause: Exception) -> NoReturn:
        """Its cores could not be set: say why, quarantine the container, fail this action."""
        failure, detail = await self.diagnose(env, why)
        self.quarantine(env, detail)
        raise DockerFailure(failure, detail) from cause

    async def _unpin(self, env: ContainerEnv) -> None:
        """After an action: keep only the cores still in use, or park the container so that
        leftover background processes cannot run on cores granted to other actions."""
        if self._envs.get(env.trajectory_id) is not env:
            return  # quarantined or dropped: it is going away
        if not env.active and not self.cfg.park_idle:
            return
        if env.cgroup is not None and env.pin_by_cgroup:
            with contextlib.suppress(OSError):
                if env.active:
                    env.cgroup.set_cpus(env.cores())
                else:
                    env.cgroup.park()
            return
        try:
            async with env.cpu_lock:
                if env.active:
                    await self.call(self.engine.update_cpus, env.container_id, env.cores())
                else:
                    await self.call(self.engine.park, env.container_id)
        except DockerFailure as exc:  # the next action's pin finds out what is wrong
            log.info("could not park %s: %s", env.spec.name, exc.detail)

    def action_env(self, req: ExecRequest) -> dict[str, str]:
        """What the action sees: its own variables, then Tangram's (``action_env``); the
        executor or ``docker exec`` supplies the base (``PATH``, ``HOME``)."""
        return action_environ(req, self.cfg.node_id)


def _exited_by_itself(state: dict[str, object]) -> bool:
    """The executor ended on its own (no interpreter, a broken image), not killed: an OOM kill
    of a container made too small says nothing about the image."""
    return not state.get("Running") and not state.get("OOMKilled") and state.get("ExitCode") != 137
