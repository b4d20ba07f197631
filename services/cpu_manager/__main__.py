"""Run the cpu_manager service (``python -m services.cpu_manager``), configured by env."""

from __future__ import annotations

import uvloop

from services.cpu_manager import config
from services.cpu_manager.service import CpuManager
from tangram import runtime, telemetry


async def main() -> None:
    mesh, cfg = config.load()
    telemetry.setup("tangram-cpu_manager", mesh.otel_endpoint)
    try:
        await runtime.serve_forever(CpuManager(mesh, cfg), mesh.drain_s)
    finally:
        telemetry.shutdown()


if __name__ == "__main__":
    runtime.setup_logging()
    import asyncio
    import os

    (asyncio.run if os.environ.get("TG_LOOP") == "asyncio" else uvloop.run)(main())
