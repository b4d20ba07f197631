"""The services a GPU node prepared: each built once from its factory, its state kept as an
invariant host copy, its device footprint measured; or the error its factory gave.

:func:`prepare` is blocking (it imports and runs user code): the executor calls it through
:func:`bounded_prepare`, in a thread of its own and bounded in time. Whatever the factory does
wrong (a stuck factory included) becomes the entry's ``error``; it is never raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.gpu_manager.batching import safe_repr
from services.gpu_manager.host_copy import HostCopy, Resident
from services.gpu_manager.residency import Placement
from services.gpu_manager.services import Handle, build_service
from services.gpu_manager.state.copy import StoredCopy
from services.gpu_manager.state.manager import StateManager
from tangram.contract import PreparedService, ServiceSpec
from tangram.errors import TangramError

log = logging.getLogger(__name__)

MB = 1 << 20


@dataclass(slots=True)
class Prepared:
    """A service ready to run (``copy`` and ``handle`` set) or failed (``error`` set);
    ``measured``: the most a run has shown one copy to hold on a device (0: none yet);
    ``state_id``: its name in the StateManager's tiers (each build its own: a late or
    replaced build never touches a newer one's state)."""

    spec: ServiceSpec
    copy: HostCopy | StoredCopy | None = None
    handle: Handle | None = None
    error: str = ""
    measured: int = 0
    state_id: str = ""

    @property
    def nbytes(self) -> int:
        """Device bytes one copy needs: its slab (alignment included), or what a run has
        shown it to hold when that is more (re-measured)."""
        return max(self.copy.nbytes if self.copy is not None else 0, self.measured)


_builds = itertools.count()


def prepare(
    spec: ServiceSpec, state: StateManager | None = None, *, pin: bool | None = None
) -> Prepared:
    """Build ``spec``'s service and capture its state: into ``state``'s tiers (deduplicated
    by content), or one host copy of its own without. Blocking; never raises for the
    factory's faults (they are the entry's error), nor when the tiers cannot hold it."""
    state_id = f"{spec.name}#{next(_builds)}"
    try:
        built = build_service(spec.factory)
        if state is None:
            copy: HostCopy | StoredCopy = HostCopy(built.model, pin=pin)
        else:
            copy = state.capture(state_id, built.model)
    except TangramError as exc:
        return Prepared(spec, error=exc.message)
    except BaseException as exc:  # a model the host copy cannot capture is the user's fault
        # too (its own overrides ran: whatever they raise)
        log.warning("service %s: cannot keep a host copy", spec.name, exc_info=True)
        why = f"service {spec.name}: cannot copy its state: {safe_repr(exc)}"
        return Prepared(spec, error=why)
    return Prepared(spec, copy, built.handle, state_id=state_id)


async def bounded_prepare(
    spec: ServiceSpec, timeout_s: float, state: StateManager | None = None
) -> Prepared:
    """``prepare`` in a thread of its own, its wait bounded by ``timeout_s`` (the
    service failed, naming the timeout, when its factory has not returned by then).

    A Python thread cannot be killed: a factory stuck in its import or build keeps its thread
    until it returns, if ever. That thread is abandoned: a daemon (it never holds up the
    process's exit), whose late result is dropped, so the service stays failed until its spec
    changes. Each build has a fresh thread, so a stuck one never holds up the next.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Prepared] = loop.create_future()

    def build() -> None:
        try:
            entry = prepare(spec, state)
        except BaseException as exc:  # whatever escapes still settles the wait
            entry = Prepared(spec, error=f"service {spec.name}: its build failed: {safe_repr(exc)}")
        if done.done() and state is not None:  # abandoned: nobody will forget its state
            state.forget(entry.state_id)
        with contextlib.suppress(RuntimeError):  # the loop closed while it built
            loop.call_soon_threadsafe(_settle, done, entry)

    threading.Thread(target=build, name=f"gpu-build-{spec.name}", daemon=True).start()
    try:
        return await asyncio.wait_for(done, timeout_s)
    except TimeoutError:
        why = (
            f"service {spec.name}: factory {spec.factory!r} did not return within the prepare "
            f"timeout of {timeout_s:g}s (TANGRAM_GPU_PREPARE_TIMEOUT_S); abandoned"
        )
        return Prepared(spec, error=why)


def _settle(fut: asyncio.Future[Prepared], entry: Prepared) -> None:
    if not fut.done():  # else the wait timed out: the late entry is dropped
        fut.set_result(entry)


def oversized(entry: Prepared, budget: int, node: str) -> str:
    """Why ``entry`` can never run on ``node``, whose largest device holds ``budget`` bytes
    (each device of a chunk holds a whole copy, so no DoP variant fits): its registration
    fails naming the sizes rather than each of its calls. Empty when it fits (or failed)."""
    if entry.error or budget <= 0 or entry.nbytes <= budget:
        return ""
    need, have = -(-entry.nbytes // MB), budget / MB
    return (
        f"service {entry.spec.name}: its state needs {need} MB on each device, more than "
        f"any device of node {node} holds ({have:g} MB)"
    )


@dataclass(slots=True)
class Ran:
    """What a variant ran since the agent started: calls, the batches they formed, and how
    many calls found it on their device already, or all in host memory."""

    calls: int = 0
    batches: int = 0
    device_hits: int = 0
    host_hits: int = 0


def variant(name: str, dop: int) -> str:
    """The residency key of a DoP variant: each is a distinct service on the devices (§5.3)."""
    return f"{name}/{dop}"


@dataclass
class Catalog:
    """Prepared services by name, and the copies restored onto devices now."""

    entries: dict[str, Prepared] = field(default_factory=dict)
    loaded: dict[Placement, Resident] = field(default_factory=dict)

    def missing(self, specs: tuple[ServiceSpec, ...] | list[ServiceSpec]) -> list[ServiceSpec]:
        """The specs not prepared as they are now (new, or changed since)."""
        return [s for s in specs if self._current(s) is None]

    def _current(self, spec: ServiceSpec) -> Prepared | None:
        entry = self.entries.get(spec.name)
        return entry if entry is not None and entry.spec == spec else None

    def put(self, entry: Prepared) -> list[Placement]:
        """Keep ``entry`` (replacing an older spec of the name); returns the placements where
        the replaced one is loaded, which the caller drops once no action uses them."""
        self.entries[entry.spec.name] = entry
        return [p for p in self.loaded if p.service.rpartition("/")[0] == entry.spec.name]

    def get(self, name: str) -> Prepared | None:
        return self.entries.get(name)

    def reports(
        self, resident: dict[str, list[tuple[int, int]]], ran: Mapping[str, Ran] | None = None
    ) -> tuple[PreparedService, ...]:
        """One report per service and DoP variant: ready with its footprint, where it is
        resident (GPU indices) and the calls and batches it ran (``ran``), or its error."""
        out: list[PreparedService] = []
        for name in sorted(self.entries):
            e = self.entries[name]
            for dop in e.spec.dops:
                chunks = resident.get(variant(name, dop), [])
                devices = tuple(sorted(d for s, n in chunks for d in range(s, s + n)))
                mb = -(-e.nbytes // MB)
                r = (ran or {}).get(variant(name, dop), Ran())
                out.append(
                    PreparedService(
                        name,
                        dop,
                        mb,
                        devices,
                        e.error,
                        r.calls,
                        r.batches,
                        device_hits=r.device_hits,
                        host_hits=r.host_hits,
                    )
                )
        return tuple(out)
