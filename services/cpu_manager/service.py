"""The CPU node agent shell: registers the node, runs dispatched actions on its backend, and
reports completions until the scheduler acknowledges them.

Facts it owns: which actions run here (and on which cores) and which environments exist.
Dispatches carry the scheduler's epoch; once a newer epoch has been seen, older ones are
refused (a deposed scheduler cannot start work). Heartbeats carry everything running or
finished-but-unacknowledged, which is what a restarted scheduler rebuilds from.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg

from services.cpu_manager import inventory
from services.cpu_manager.backend import Backend, EnvFailure, ExecOutcome, ExecRequest
from services.cpu_manager.backends import make_backend
from services.cpu_manager.config import CpuManagerConfig
from services.cpu_manager.dop import substitute_dop
from services.cpu_manager.outcome import to_outcome
from services.cpu_manager.process_backend import ProcessBackend, ProcessConfig
from tangram import subjects
from tangram.bus import Bus
from tangram.config import MeshConfig
from tangram.contract import (
    Ack,
    Completion,
    Dispatch,
    DropEnv,
    EnvExpired,
    ErrorKind,
    Inventory,
    Kill,
    NodeCommand,
    NodeLeaving,
    NodeReport,
    Reconcile,
    RunningAction,
)
from tangram.errors import InvalidRequest, TangramError
from tangram.runtime import Service

log = logging.getLogger(__name__)

COMPLETION_TIMEOUT_S = 5.0


@dataclass
class _Active:
    attempt: int
    trajectory_id: str
    cores: tuple[int, ...]
    kill_reason: ErrorKind | None = None


class CpuManager(Service):
    name = "cpu_manager"

    def __init__(self, mesh: MeshConfig, cfg: CpuManagerConfig, backend: Backend | None = None):
        super().__init__()
        self.mesh = mesh
        self.cfg = cfg
        self.node_id = cfg.node_id
        self.incarnation = uuid.uuid4().hex
        self._given_backend = backend
        self.backend: Backend = backend or ProcessBackend(
            ProcessConfig(root=cfg.env_root(), node_id=self.node_id, incarnation=self.incarnation)
        )
        self.inventory: Inventory = inventory.read("none", False, cfg.cores, cfg.memory_mb)
        self.bus: Bus | None = None
        self.epoch = 0
        self.active: dict[str, _Active] = {}
        self.outbox: dict[str, Completion] = {}
        self.outbox_trajectory: dict[str, str] = {}
        self.cores_in_use: set[int] = set()
        self.overlaps = 0
        self._seq = 0
        self._runs: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ lifecycle

    async def on_start(self) -> None:
        if self._given_backend is None:
            self.backend, line = await make_backend(self.cfg, self.incarnation)
            log.warning("node %s: %s", self.node_id, line)
        await self.backend.start()
        if not self.backend.isolates:
            log.warning(
                "node %s: the %s backend does NOT isolate trajectories (same user, "
                "same filesystem, same network)",
                self.node_id,
                self.backend.name,
            )
        self.inventory = inventory.read(
            self.backend.name, self.backend.isolates, self.cfg.cores, self.cfg.memory_mb
        )
        self.bus = await Bus.connect(self.mesh.nats_url, f"cpu_manager.{self.node_id}")
        self.bus.serve(
            subjects.node(self.node_id), NodeCommand, self.on_command, max_in_flight=100_000
        )
        self.bus.serve(subjects.NODES_BROADCAST, NodeCommand, self.on_command, max_in_flight=16)
        await self.bus.start()
        await self.report()
        self.spawn(self._heartbeat_loop(), "heartbeat")
        self.spawn(self._resend_loop(), "resend")
        self.spawn(self._ttl_loop(), "env-ttl")

    async def on_stop(self, grace_s: float) -> None:
        await self._leave(draining=True)
        if self.bus is not None:
            await self.bus.stop_serving(0.1)
        if self._runs:
            await asyncio.wait(set(self._runs), timeout=grace_s)
        for aid in list(self.active):
            self.active[aid].kill_reason = ErrorKind.NODE_DIED
            await self.backend.kill(aid)
        if self._runs:
            await asyncio.wait(set(self._runs), timeout=2.0)
        await self._cancel_tasks()  # no heartbeat may follow the goodbye and revive this node
        await self._flush_outbox()
        started, envs = (*self.active, *self.outbox), tuple(self.backend.envs())
        await self.backend.close()
        await self._leave(draining=False, started=started, envs=envs)
        if self.bus is not None:
            await self.bus.close()

    async def _leave(
        self,
        *,
        draining: bool,
        started: tuple[str, ...] | None = None,
        envs: tuple[str, ...] | None = None,
    ) -> None:
        """Tell the scheduler we are draining, or gone with what we started and still hold
        (best effort: it may be down)."""
        if self.bus is None:
            return
        msg = NodeLeaving(
            node_id=self.node_id,
            incarnation=self.incarnation,
            draining=draining,
            started=started,
            envs=envs,
        )
        with contextlib.suppress(TangramError):
            await self.bus.request(subjects.SCHED_NODES, msg, Ack, timeout=2.0)

    # ------------------------------------------------------------------ commands

    async def on_command(self, cmd: Any, msg: Msg) -> Any:
        if cmd.epoch < self.epoch:
            raise InvalidRequest(f"stale scheduler epoch {cmd.epoch} < {self.epoch}")
        self.epoch = cmd.epoch
        match cmd:
            case Dispatch(incarnation=inc) if inc and inc != self.incarnation:
                raise InvalidRequest(
                    f"dispatch meant for incarnation {inc}, not {self.incarnation}"
                )
            case Dispatch():
                self._start(cmd)
            case Kill(action_id=aid, reason=reason):
                if aid in self.active:
                    self.active[aid].kill_reason = reason
                    await self.backend.kill(aid)
            case DropEnv(trajectory_id=tid):
                for a in self.active.values():
                    if a.trajectory_id == tid:
                        a.kill_reason = ErrorKind.CANCELLED
                await self.backend.drop_env(tid)
            case Reconcile():
                await self.report()
                self._resend(0.0)
        return Ack()

    def _start(self, d: Dispatch) -> None:
        aid = d.action.spec.action_id
        if aid in self.active or aid in self.outbox:
            return  # a duplicate dispatch: the first one is running or done
        overlap = self.cores_in_use & set(d.cores)
        if overlap:
            self.overlaps += 1
            log.error("dispatch of %s overlaps busy cores %s", aid, sorted(overlap))
        self.cores_in_use |= set(d.cores)
        self.active[aid] = _Active(d.action.attempt, d.action.spec.trajectory_id, d.cores)
        task = asyncio.get_running_loop().create_task(self._run(d))
        self._runs.add(task)
        task.add_done_callback(self._runs.discard)

    async def _run(self, d: Dispatch) -> None:
        action = d.action
        aid = action.spec.action_id
        outcome = await self._outcome(d)
        active = self.active.pop(aid)
        self.cores_in_use -= set(active.cores)
        completion = Completion(
            node_id=self.node_id,
            incarnation=self.incarnation,
            action_id=aid,
            attempt=action.attempt,
            outcome=to_outcome(outcome, active.kill_reason),
        )
        self.outbox[aid] = completion
        self.outbox_trajectory[aid] = active.trajectory_id
        await self._send(completion)

    async def _outcome(self, d: Dispatch) -> ExecOutcome:
        aid = d.action.spec.action_id
        if self.active[aid].kill_reason is not None:  # killed before its task got to run
            return _failed_outcome(EnvFailure.KILLED, "killed on request before it started")
        try:
            return await self.backend.run(self._request(d))
        except TangramError as exc:
            return _failed_outcome(EnvFailure.INTERNAL, str(exc))
        except Exception as exc:
            log.exception("backend failed running %s", aid)
            return _failed_outcome(EnvFailure.INTERNAL, f"{type(exc).__name__}: {exc}")

    def _request(self, d: Dispatch) -> ExecRequest:
        spec = d.action.spec
        cmd = spec.action.command
        argv = ("sh", "-c", cmd) if isinstance(cmd, str) else tuple(cmd)
        return ExecRequest(
            action_id=spec.action_id,
            trajectory_id=spec.trajectory_id,
            argv=substitute_dop(argv, len(d.cores)),
            cores=d.cores,
            timeout_s=spec.timeout_s,
            output_cap_bytes=spec.action.output_cap_bytes,
            env=dict(spec.action.env),
            memory_mb=spec.memory_mb,
            image=spec.image,
            network=spec.network,
        )

    # ------------------------------------------------------------------ reporting

    async def _send(self, c: Completion) -> None:
        assert self.bus is not None
        try:
            await self.bus.request(subjects.SCHED_NODES, c, Ack, timeout=COMPLETION_TIMEOUT_S)
        except TangramError as exc:
            log.info("completion of %s not acknowledged yet: %s", c.action_id, exc)
            return
        self.outbox.pop(c.action_id, None)
        self.outbox_trajectory.pop(c.action_id, None)

    def _resend(self, older_than_s: float) -> None:
        for c in list(self.outbox.values()):
            finished = c.outcome.finished_at or 0.0
            if time.time() - finished >= older_than_s:
                task = asyncio.get_running_loop().create_task(self._send(c))
                self._runs.add(task)
                task.add_done_callback(self._runs.discard)

    def node_report(self) -> NodeReport:
        running = [
            RunningAction(
                action_id=aid, attempt=a.attempt, trajectory_id=a.trajectory_id, cores=a.cores
            )
            for aid, a in self.active.items()
        ]
        running += [
            RunningAction(
                action_id=aid,
                attempt=c.attempt,
                trajectory_id=self.outbox_trajectory.get(aid, ""),
                cores=(),
            )
            for aid, c in self.outbox.items()
        ]
        self._seq += 1
        return NodeReport(
            node_id=self.node_id,
            incarnation=self.incarnation,
            inventory=self.inventory,
            running=tuple(running),
            envs=tuple(self.backend.envs()),
            seq=self._seq,
            full=True,
        )

    async def report(self) -> None:
        assert self.bus is not None
        await self.bus.publish(subjects.SCHED_NODES, self.node_report())

    async def _flush_outbox(self) -> None:
        """Last sends of unacknowledged completions before leaving, bounded; none outlives it."""
        if not self.outbox:
            return
        sends = [asyncio.ensure_future(self._send(c)) for c in list(self.outbox.values())]
        _, pending = await asyncio.wait(sends, timeout=2.0)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    # ------------------------------------------------------------------ loops

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_s)
            await self.report()

    async def _resend_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self._resend(1.0)

    async def _ttl_loop(self) -> None:
        """Remove environments idle longer than the TTL and tell the scheduler."""
        assert self.bus is not None
        while True:
            await asyncio.sleep(max(0.05, self.cfg.env_ttl_s / 4))
            busy = {a.trajectory_id for a in self.active.values()}
            now = time.monotonic()
            for tid, last in self.backend.envs().items():
                if tid not in busy and now - last > self.cfg.env_ttl_s:
                    await self.backend.drop_env(tid)
                    msg = EnvExpired(
                        node_id=self.node_id, incarnation=self.incarnation, trajectory_id=tid
                    )
                    await self.bus.publish(subjects.SCHED_NODES, msg)


def _failed_outcome(failure: EnvFailure, detail: str) -> ExecOutcome:
    now = time.time()
    return ExecOutcome(None, b"", b"", False, False, now, now, failure, detail)
