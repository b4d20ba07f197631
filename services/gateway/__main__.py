"""Run the gateway service: ``python -m services.gateway``, configured by the environment."""

from __future__ import annotations

import uvloop

from services.gateway import config
from services.gateway.service import Gateway
from tangram import runtime, telemetry


async def main() -> None:
    mesh, cfg = config.load()
    telemetry.setup("tangram-gateway", mesh.otel_endpoint)
    try:
        await runtime.serve_forever(Gateway(mesh, cfg), mesh.drain_s)
    finally:
        telemetry.shutdown()


if __name__ == "__main__":
    runtime.setup_logging()
    import asyncio
    import os

    (asyncio.run if os.environ.get("TG_LOOP") == "asyncio" else uvloop.run)(main())
