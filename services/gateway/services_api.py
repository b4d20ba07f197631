"""Model services at the gateway: register one (durable first, then prepared by the GPU nodes
through the scheduler) and list them as the scheduler sees them."""

from __future__ import annotations

import asyncpg

from tangram import subjects
from tangram.bus import BaseBus
from tangram.contract import (
    Resources,
    ResourcesQuery,
    ServiceCmd,
    Services,
    ServiceSpec,
    checked_service,
    encode,
)
from tangram.errors import InternalError

QUERY_TIMEOUT_S = 5.0

_UPSERT = """
INSERT INTO services (name, spec) VALUES ($1, $2)
ON CONFLICT (name) DO UPDATE SET spec = excluded.spec, updated_at = now()
"""


async def register(
    pool: asyncpg.Pool, bus: BaseBus, spec: ServiceSpec, timeout_s: float
) -> Services:
    """Validate, make durable, have the scheduler prepare it; its answer is the reply (an
    error naming the factory's error when no GPU node could prepare it). The scheduler answers
    once every GPU node has prepared the service or failed to, within its own prepare timeout:
    ``timeout_s`` (``GatewayConfig.register_timeout_s``) must be longer than that."""
    spec = checked_service(spec)  # decoding validated it already; a spec built here too
    await pool.execute(_UPSERT, spec.name, encode(spec))
    reply = await bus.request(subjects.SCHED_ACTIONS, ServiceCmd(spec=spec), timeout=timeout_s)
    if not isinstance(reply, Services):
        raise InternalError(f"the scheduler answered a registration with {type(reply).__name__}")
    return reply


async def resources(bus: BaseBus) -> Resources:
    """Services and quotas as the scheduler sees them now."""
    reply = await bus.request(subjects.SCHED_STATUS, ResourcesQuery(), timeout=QUERY_TIMEOUT_S)
    if not isinstance(reply, Resources):
        raise InternalError(f"the scheduler answered a resources query with {type(reply).__name__}")
    return reply


async def list_services(bus: BaseBus) -> Services:
    return Services(services=(await resources(bus)).services)
