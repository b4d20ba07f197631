"""The scheduler shell's part in service registration: registrations waiting for their answer
(``ServiceSettled`` from the core), and the registered services in Postgres (the gateway writes
them; a restarted scheduler reads them back)."""

from __future__ import annotations

import asyncio

import asyncpg

from services.scheduler.core.effects import ServiceSettled
from tangram.contract import Services, ServiceSpec, codec
from tangram.errors import InvalidRequest


class Registrations:
    """Callers waiting for a registration's answer, by service name."""

    def __init__(self) -> None:
        self._waiting: dict[str, list[asyncio.Future[Services]]] = {}

    def wait(self, name: str) -> asyncio.Future[Services]:
        """A future for the next answer about ``name`` (call before the core registers it)."""
        fut: asyncio.Future[Services] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(name, []).append(fut)
        return fut

    def settle(self, e: ServiceSettled) -> None:
        """Answer every caller waiting for ``e.name``: its state, or why no node prepared it."""
        for fut in self._waiting.pop(e.name, []):
            if fut.done():
                continue
            if e.error:
                fut.set_exception(InvalidRequest(e.error))
            else:
                fut.set_result(Services(services=(e.state,)))


async def load_services(pool: asyncpg.Pool) -> list[ServiceSpec]:
    """Every registered service (its latest spec)."""
    rows = await pool.fetch("SELECT spec FROM services ORDER BY name")
    return [codec.decode(r["spec"], ServiceSpec) for r in rows]
