"""The GPU node's executor: model calls on the node's devices, by evict-on-execution.

Each dispatched call waits in a lane (its service's DoP variant on its granted chunk, or on
any chunk when the dispatch names none). Whenever a lane's chunk is free, up to ``max_batch``
of its calls run as one forward pass: the residency core grants the chunk (at most one batch
per device at a time), plans the LRU evictions that make room, and says whether the service
must be restored from its host copy. The scheduler sends calls of a service to a chunk that
runs it (up to ``max_batch`` at a time): those that arrive while a batch runs form the next.
Everything torch does runs in worker threads (one per device); the event loop only moves calls
and results. Each variant's calls and batches are counted and reported in heartbeats.

After every pass the service is re-measured by what it holds on the device (a handler may grow
its state); a pass that left a CPU stand-in over its budget is that device's out of memory.
Services are built one at a time, each bounded by ``prepare_timeout_s`` (``catalog``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from nats.aio.msg import Msg

from services.gpu_manager import catalog, devices
from services.gpu_manager.arenas import Arenas
from services.gpu_manager.bandwidth import measure_bandwidth, measure_gather, sync
from services.gpu_manager.batching import Batch, BatchFormer, Call, Output, fault_of, run_batch
from services.gpu_manager.catalog import Catalog, Prepared, Ran, variant
from services.gpu_manager.config import GpuManagerConfig
from services.gpu_manager.host_copy import Resident, held_bytes
from services.gpu_manager.outcomes import outcome_of, refused
from services.gpu_manager.prefetch import Prefetcher
from services.gpu_manager.residency import Grant, Placement, Residency, snapshot
from services.gpu_manager.state.manager import StateManager
from services.gpu_manager.state.tiers import TierFull
from tangram import metrics
from tangram.agent import Launch, Starts
from tangram.chunks import Chunk, chunk_of
from tangram.contract import (
    Ack,
    Dispatch,
    ErrorKind,
    InferAction,
    Inventory,
    Outcome,
    PreparedService,
    ServiceSpec,
    kind_of,
)
from tangram.contract.state import Prefetch
from tangram.errors import InvalidRequest, TangramError

log = logging.getLogger(__name__)

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Lane:
    """Calls of one DoP variant of a service that run on ``chunk`` (any chunk when None)."""

    name: str
    dop: int
    chunk: Chunk | None

    @property
    def key(self) -> str:
        where = "*" if self.chunk is None else str(self.chunk.start)
        return f"{variant(self.name, self.dop)}@{where}"


class GpuExecutor:
    """The agent runtime's Executor (with the Prepares and Reports hooks) for model calls."""

    def __init__(self, cfg: GpuManagerConfig, *, clock: Clock = time.time) -> None:
        self.cfg = cfg
        self.clock = clock
        self.catalog = Catalog()
        self.former = BatchFormer(cfg.max_queued)
        self.devices = devices.Inventory("none", ())
        self.residency = Residency(())
        self.arenas = Arenas(0)  # what evicted copies freed, for the next restores (arenas.py)
        self.lanes: dict[str, Lane] = {}
        self.ran: dict[str, Ran] = {}  # variant -> calls and batches run (in heartbeats)
        self._waiters: dict[str, asyncio.Future[Outcome]] = {}
        self._batches: set[asyncio.Task[None]] = set()
        self._ids = itertools.count()
        self._prep_lock = asyncio.Lock()
        self._runner: concurrent.futures.ThreadPoolExecutor | None = None
        self.state = StateManager(cfg.state())
        self.prefetcher = Prefetcher(self, enabled=cfg.prefetch)
        # Launches for the health detector: a granted batch until its runner thread takes
        # it up. Its restore comes after (in the runner): progress of its own, no launch.
        self.starts = Starts()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> Inventory:
        if self.cfg.torch_threads:
            torch.set_num_threads(self.cfg.torch_threads)
        self.devices = await asyncio.to_thread(devices.discover, self.cfg.devices())
        stored = await asyncio.to_thread(self.state.start)
        if stored:
            log.info("node %s: %d tensors in the state store", self.cfg.node_id, stored)
        gbps = await asyncio.to_thread(measure_bandwidth, self.devices)
        gather = await asyncio.to_thread(measure_gather, self.devices)
        self.residency = Residency(tuple(d.budget_bytes for d in self.devices.devices))
        self.arenas = Arenas(sum(d.budget_bytes for d in self.devices.devices))
        n = max(1, len(self.devices.devices))
        self._runner = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="gpu-run")
        log.warning(
            "node %s: %s, restore %.1f GB/s per link, %d link(s)",
            *(self.cfg.node_id, self.describe(), gbps, self.devices.links),
        )
        return self.devices.offer(gbps, gather)

    def describe(self) -> str:
        return self.devices.describe()

    async def canary(self) -> None:
        """The health detector's canary: a no-op on the runner threads model calls run on. It
        takes no chunk and waits only for a thread: it is asked of a node none of whose calls
        finished within twice the longest's expected duration, or whose granted batch has not
        entered a runner thread for the start bound, so every thread it could wait for is
        held past its bound (a wedged call); a node with a thread free answers at once."""
        if self._runner is not None:
            await asyncio.get_running_loop().run_in_executor(self._runner, _noop)

    async def close(self) -> None:
        await self.prefetcher.close()
        for call_id in list(self._waiters):
            self._cancel_queued(call_id, ErrorKind.NODE_DIED, "the gpu_manager stopped")
        for task in list(self._batches):
            task.cancel()
        await asyncio.gather(*self._batches, return_exceptions=True)
        now = self.clock()
        stopped = Outcome(
            failure=ErrorKind.NODE_DIED,
            detail="the gpu_manager stopped during the call",
            started_at=now,
            finished_at=now,
        )
        for call_id in list(self._waiters):  # taken into a batch that will not finish now
            self._resolve(call_id, stopped)
        if self._runner is not None:
            self._runner.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ services

    async def prepare(self, services: Sequence[ServiceSpec]) -> None:
        """Build what is new or changed, one at a time, each bounded by the prepare timeout."""
        async with self._prep_lock:
            for spec in self.catalog.missing(list(services)):
                timeout_s = self.cfg.prepare_timeout_s
                await self._keep(await catalog.bounded_prepare(spec, timeout_s, self.state))

    async def _keep(self, entry: Prepared) -> None:
        entry = await self._fitting(entry)
        if entry.error:
            log.warning("service %s: %s", entry.spec.name, entry.error)
        busy = {g.placement for g in self.residency.running.values()}
        old = self.catalog.get(entry.spec.name)
        if old is not None and old.state_id:  # its restores in flight keep their keys pinned
            await asyncio.to_thread(self.state.forget, old.state_id)
        for p in self.catalog.put(entry):  # the replaced spec's copies, where idle
            if p not in busy:
                self._drop(p, old)
                self.residency.cached.pop(p, None)

    async def _fitting(self, entry: Prepared) -> Prepared:
        """``entry``, or its failure when no device here could ever hold one copy of it."""
        budgets = [d.budget_bytes for d in self.devices.devices]
        why = catalog.oversized(entry, max(budgets, default=0), self.cfg.node_id)
        if not why:
            return entry
        if entry.state_id:
            await asyncio.to_thread(self.state.forget, entry.state_id)
        return Prepared(entry.spec, error=why)

    def services(self) -> tuple[PreparedService, ...]:
        return self.catalog.reports(snapshot(self.residency), self.ran)

    # ------------------------------------------------------------------ calls

    async def run(self, dispatch: Dispatch) -> Outcome:
        spec = dispatch.action.spec
        action = spec.action
        if not isinstance(action, InferAction):
            why = f"a GPU node runs infer actions, not {kind_of(action)}"
            return refused(why, self.clock())
        lane = await self._lane(dispatch, action)
        if isinstance(lane, Outcome):
            return lane
        try:
            self.former.submit(Call(spec.action_id, lane.key, action.payload, self.clock()))
        except TangramError as exc:
            return refused(exc.message, self.clock())
        fut = asyncio.get_running_loop().create_future()
        self._waiters[spec.action_id] = fut
        self.lanes[lane.key] = lane
        self._pump()
        return await self._outcome(spec.action_id, fut, spec.timeout_s)

    async def _lane(self, d: Dispatch, action: InferAction) -> Lane | Outcome:
        """Where the call runs, preparing its service first if the dispatch brings a spec
        this node has not prepared; or why it cannot run here."""
        if d.service is not None and d.service.name != action.service:
            return refused(f"dispatch of {action.service} carries service {d.service.name}", 0)
        if d.service is not None and self.catalog.missing([d.service]):
            await self.prepare([d.service])
        entry = self.catalog.get(action.service)
        now = self.clock()
        if entry is None:
            known = ", ".join(sorted(self.catalog.entries)) or "none"
            return refused(
                f"service {action.service!r} is not prepared here (prepared: {known})", now
            )
        if entry.error:
            return refused(entry.error, now)
        chunk = chunk_of(d.gpus, len(self.devices.devices)) if d.gpus else None
        if d.gpus and chunk is None:
            return refused(f"GPUs {list(d.gpus)} are not a chunk of this node", now)
        dop = len(d.gpus) if d.gpus else entry.spec.dops[0]
        if dop not in entry.spec.dops:
            return refused(f"service {entry.spec.name} has no DoP-{dop} variant", now)
        return Lane(entry.spec.name, dop, chunk)

    async def _outcome(
        self, call_id: str, fut: asyncio.Future[Outcome], timeout_s: float
    ) -> Outcome:
        """The call's outcome, or a timeout's (a timer, not ``wait_for``: the outcome
        reaches the caller on the loop's next turn, not three turns later)."""
        timer = asyncio.get_running_loop().call_later(timeout_s, self._expire, call_id, timeout_s)
        try:
            return await fut
        finally:
            timer.cancel()
            self._waiters.pop(call_id, None)

    def _expire(self, call_id: str, timeout_s: float) -> None:
        """A call with no outcome by its timeout fails; if still queued it never runs."""
        now = self.clock()
        why = f"no output within the action's timeout of {timeout_s}s"
        self._resolve(
            call_id,
            Outcome(failure=ErrorKind.EXEC_TIMEOUT, detail=why, started_at=now, finished_at=now),
        )
        self.former.cancel(call_id)  # a running batch finishes; its outcome comes too late

    async def kill(self, action_id: str) -> None:
        """A queued call is cancelled; a running one finishes (its batch is one pass)."""
        self._cancel_queued(action_id, ErrorKind.CANCELLED, "cancelled before it ran")

    def _cancel_queued(self, call_id: str, kind: ErrorKind, why: str) -> None:
        if self.former.cancel(call_id) is None:
            return
        now = self.clock()
        self._resolve(call_id, Outcome(failure=kind, detail=why, started_at=now, finished_at=now))

    def _resolve(self, call_id: str, outcome: Outcome) -> None:
        fut = self._waiters.get(call_id)
        if fut is not None and not fut.done():
            fut.set_result(outcome)

    async def drop_env(self, trajectory_id: str) -> None:
        """Model calls keep no environment."""

    def envs(self) -> Mapping[str, float]:
        return {}

    # ------------------------------------------------------------------ batches

    def _pump(self) -> None:
        """Start a batch on every lane whose chunk is free (oldest waiting lane first)."""
        for key in self.former.waiting():
            lane = self.lanes[key]
            entry = self.catalog.get(lane.name)
            if entry is None or entry.copy is None:
                self._fail_lane(key, "the service is no longer prepared here")
                continue
            grant = self._acquire(lane, entry)
            if grant is None:
                continue
            batch = self.former.take(key, entry.spec.max_batch)
            if batch is None:  # cannot happen: the lane was waiting
                self.residency.release(grant.action_id, self.clock(), resident=False)
                continue
            task = asyncio.get_running_loop().create_task(self._run_batch(grant, entry, batch))
            self._batches.add(task)
            task.add_done_callback(self._batches.discard)
            task.add_done_callback(_log_failure)

    def _acquire(self, lane: Lane, entry: Prepared) -> Grant | None:
        batch_id = f"batch-{next(self._ids)}"
        key = variant(lane.name, lane.dop)
        try:
            return self.residency.acquire(
                batch_id, key, lane.dop, entry.nbytes, self.clock(), lane.chunk
            )
        except TangramError as exc:
            self._fail_lane(lane.key, exc.message)
            return None

    def _fail_lane(self, key: str, why: str) -> None:
        batch = self.former.take(key, len(self.former) or 1)
        for call in batch.calls if batch else ():
            self._resolve(call.call_id, refused(why, self.clock()))

    async def _run_batch(self, grant: Grant, entry: Prepared, batch: Batch) -> None:
        """Evict, restore if needed and run the batch in the worker thread; the catalog's
        copies change only here, on the event loop."""
        started = self.clock()
        loop = asyncio.get_running_loop()
        for p in grant.evict:
            self._drop(p, self.catalog.get(p.service.rpartition("/")[0]))
        resident = self.catalog.loaded.get(grant.placement)
        arena = self._arena(grant, entry) if resident is None else None
        launch = self.starts.begin(len(batch.calls))
        try:
            done = await loop.run_in_executor(
                self._runner, self._work, grant, entry, resident, batch, launch, arena
            )
        except Exception as exc:  # the restore failed (out of memory, a lost device)
            log.warning("restore of %s failed", grant.placement, exc_info=True)
            done = Pass(0.0, None, _restore_failed(batch, exc))
        finally:
            launch.done()
        restored = None if resident is not None else done.resident is not None
        service = grant.placement.service
        metrics.gpu_pass(self.cfg.node_id, service, len(grant.evict), restored, done.restore_s)
        done = self._remeasured(grant, entry, done)
        # A spec replaced while this batch ran: its copy is not kept for the next call.
        keep = done.resident is not None and self.catalog.get(entry.spec.name) is entry
        self.residency.release(grant.action_id, self.clock(), resident=keep)
        if keep and done.resident is not None:
            self.catalog.loaded[grant.placement] = done.resident
        else:
            self.catalog.loaded.pop(grant.placement, None)
        if done.resident is not None:
            self._count(grant.placement.service, len(batch.calls), done.found)
        # the call's own time, taken in the worker: the hops to and from it are the system's
        began, ended = done.ran if done.ran is not None else (started, self.clock())
        times = {"started": began, "finished": ended, "restore_s": done.restore_s}
        for out in done.outs:
            self._resolve(out.call_id, outcome_of(out, entry.spec, **times))
        self._pump()

    def _count(self, key: str, calls: int, found: str) -> None:
        ran = self.ran.setdefault(key, Ran())
        ran.calls, ran.batches = ran.calls + calls, ran.batches + 1
        ran.device_hits += calls if found in ("device", "device only") else 0
        ran.host_hits += calls if found in ("device", "host") else 0

    def _remeasured(self, grant: Grant, entry: Prepared, done: Pass) -> Pass:
        """Re-measure the service by what the pass left on its device (reported from now on,
        and what its next grants make room for). On CPU stand-ins, where nothing stops an
        allocation past a device's budget, a pass that left the device over it is that
        device's out of memory (CUDA raises its own): the outputs and the copy are dropped and
        the calls fail ``device_oom``, which the scheduler retries once on a larger chunk."""
        if done.resident is None or done.held <= entry.nbytes:
            return done
        log.warning(
            "service %s holds %d bytes per device, not %d: re-measured",
            grant.placement.service,
            done.held,
            entry.nbytes,
        )
        entry.measured = done.held
        over = self.residency.remeasure(grant.placement, done.held)
        if over == 0 or self.devices.kind != "cpu":
            return done
        devices = list(grant.placement.chunk.positions())
        why = (
            f"device out of memory: service {entry.spec.name} held {done.held} bytes on "
            f"devices {devices} after its pass, {over} bytes over their budget "
            f"(re-measured; it was {entry.copy.nbytes if entry.copy else 0} when prepared)"
        )
        oom = [Output(o.call_id, error=why, fault="oom") for o in done.outs]
        return Pass(done.restore_s, None, oom, done.held, ran=done.ran)

    def _work(
        self,
        grant: Grant,
        entry: Prepared,
        resident: Resident | None,
        batch: Batch,
        launch: Launch,
        arena: torch.Tensor | None = None,
    ) -> Pass:
        """In a worker thread: restore if not ``resident`` (into ``arena`` if given), run the
        batch, measure what the service holds on the device after it. The caller keeps the
        copy."""
        launch.done()  # the calls entered the runner
        began = self.clock()
        restore_s, found = 0.0, "device"
        if resident is None:
            t0 = time.perf_counter()
            resident, found = self._restore(grant, entry, arena)
            restore_s = time.perf_counter() - t0
        elif not self.state.in_host(entry.state_id):
            found = "device only"  # the host copy went to disk since; the arena is intact
        cuda = resident.device.type == "cuda"
        base = _peak_reset(resident.device) if cuda else 0
        outs = _isolated(resident.model, entry, batch)
        ended = self.clock()
        held = held_bytes(resident)
        if cuda:  # pragma: no cover - needs a GPU: the pass's working memory at its peak
            held += max(0, torch.cuda.max_memory_allocated(resident.device) - base)
        return Pass(restore_s, resident, outs, held, found, (began, ended))

    def _restore(
        self, grant: Grant, entry: Prepared, arena: torch.Tensor | None = None
    ) -> tuple[Resident, str]:
        """In a worker thread: the service onto the grant's chunk (into ``arena``, memory an
        evicted copy freed, if given), promoted from disk to host memory first if needed (and
        pinned there while it copies); where it was found."""
        assert entry.copy is not None, "only a prepared service is restored"
        # one slice per device of the chunk, each through that device's own link; the model
        # runs on the first
        paths = self._paths(grant)
        if not entry.state_id:  # a copy of its own (not in the tiers)
            return entry.copy.restore(paths[0], arena, paths=paths), "host"
        held = self.state.acquire(entry.state_id)
        try:
            resident = entry.copy.restore(paths[0], arena, paths=paths)
            sync(resident.device)
        finally:
            self.state.release(held)
        return resident, "host" if held.was_host else "disk"

    def _paths(self, grant: Grant) -> list[str]:
        return [self.devices.devices[p].torch_device for p in grant.placement.chunk.positions()]

    def _arena(self, grant: Grant, entry: Prepared) -> torch.Tensor | None:
        """Memory an evicted copy freed, of the size this restore needs (arenas.py)."""
        if entry.copy is None:
            return None
        return self.arenas.take(self._paths(grant)[0], entry.copy.nbytes)

    def _drop(self, placement: Placement, entry: Prepared | None) -> None:
        """Let an idle copy of ``entry`` go, nothing written back (the host copy is
        invariant); its arena is kept for a later restore once its model no longer views it
        (``release``; a tensor its handler kept still does: then the arena is not kept)."""
        resident = self.catalog.loaded.pop(placement, None)
        if resident is not None and entry is not None and entry.copy is not None:
            arena = entry.copy.release(resident)
            del resident
            self.arenas.give(arena)

    # ------------------------------------------------------------------ prefetch

    def entry(self, name: str) -> Prepared | None:
        return self.catalog.get(name)

    def busy(self) -> set[str]:
        """The services with calls waiting for a device or running here."""
        waiting = {self.lanes[k].name for k in self.former.waiting() if k in self.lanes}
        running = {g.placement.service.rpartition("/")[0] for g in self.residency.running.values()}
        return waiting | running

    async def on_prefetch(self, hint: Prefetch, msg: Msg) -> Ack:
        """A scheduler's hint (see ``prefetch.py``); names not prepared here are refused,
        the others prefetched."""
        unknown = self.prefetcher.hint([(i.name, i.dop) for i in hint.services])
        if unknown:
            known = ", ".join(sorted(self.catalog.entries)) or "none"
            raise InvalidRequest(
                f"prefetch: services not prepared here: {', '.join(unknown)} (prepared: {known})"
            )
        return Ack()

    async def warm(self, name: str, dop: int) -> bool:
        """Restore ``name``'s ``dop`` variant onto a free chunk ahead of its calls: only while
        no call waits for a device, only where it fits beside what is cached (nothing is
        evicted, so nothing a running action uses); True if it is resident now."""
        entry = self.catalog.get(name)
        if entry is None or entry.copy is None or len(self.former) or dop not in entry.spec.dops:
            return False
        aid, key = f"warm-{next(self._ids)}", variant(name, dop)
        grant = self.residency.warm(aid, key, dop, entry.nbytes, self.clock())
        if grant is None:
            return False
        loop = asyncio.get_running_loop()
        arena = self._arena(grant, entry)
        try:
            resident, _ = await loop.run_in_executor(
                self._runner, self._restore, grant, entry, arena
            )
        except Exception:  # a hint is never an error: its calls will restore it themselves
            log.warning("prefetch of %s onto %s failed", key, grant.placement, exc_info=True)
            self.residency.release(aid, self.clock(), resident=False)
            self._pump()
            return False
        keep = self.catalog.get(name) is entry
        self.residency.release(aid, self.clock(), resident=keep)
        if keep:
            self.catalog.loaded[grant.placement] = resident
        self._pump()
        return keep


@dataclass(frozen=True, slots=True)
class Pass:
    """What one forward pass gave: its outputs, the copy on the device (None: dropped, the
    restore or the device failed), the bytes it held there after the pass, where the
    service was when the batch was granted (``device``, ``host``, ``disk``), and when the
    worker began it and its forward pass ended (the calls' execution, restore included)."""

    restore_s: float
    resident: Resident | None
    outs: list[Output]
    held: int = 0
    found: str = ""
    ran: tuple[float, float] | None = None


def _noop() -> None:
    """The canary's work (see :meth:`GpuExecutor.canary`)."""


def _peak_reset(device: torch.device) -> int:  # pragma: no cover - needs a GPU
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _isolated(model: torch.nn.Module, entry: Prepared, batch: Batch) -> list[Output]:
    """The batch's outputs. A batch the handler failed as a whole is run again one call at a
    time, so one call's bad payload never fails the calls coalesced with it."""
    assert entry.handle is not None, "a batch runs only for a prepared service"
    outs = run_batch(model, entry.handle, batch)
    if len(batch.calls) < 2 or not all(o.error and o.fault == "handler" for o in outs):
        return outs
    return [run_batch(model, entry.handle, Batch(batch.service, (c,)))[0] for c in batch.calls]


def _restore_failed(batch: Batch, exc: Exception) -> list[Output]:
    if isinstance(exc, TierFull):  # host memory, not the device: never a lost GPU
        why = f"restoring the service failed: {exc.message}"
        return [Output(c.call_id, error=why, fault="oom") for c in batch.calls]
    fault = fault_of(exc)
    why = f"restoring the service failed: {exc!r}"
    return [
        Output(c.call_id, error=why, fault=fault if fault != "handler" else "device")
        for c in batch.calls
    ]


def _log_failure(task: asyncio.Task[None]) -> None:
    """A batch that died of a bug says so at once (its calls end at their timeout)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("a forward pass failed", exc_info=task.exception())
