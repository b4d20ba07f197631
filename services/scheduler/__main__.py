"""Run the scheduler service: ``python -m services.scheduler``, configured by the environment."""

from __future__ import annotations

import uvloop

from services.scheduler import config
from services.scheduler.service import Scheduler
from tangram import runtime, telemetry


async def main() -> None:
    mesh, cfg = config.load()
    telemetry.setup("tangram-scheduler", mesh.otel_endpoint)
    try:
        await runtime.serve_forever(Scheduler(mesh, cfg), mesh.drain_s)
    finally:
        telemetry.shutdown()


if __name__ == "__main__":
    runtime.setup_logging()
    import asyncio
    import os

    (asyncio.run if os.environ.get("TG_LOOP") == "asyncio" else uvloop.run)(main())
