"""Run the gateway service (``python -m services.gateway``), configured by the environment."""

from __future__ import annotations

from services.gateway.service import build
from tangram import runtime

if __name__ == "__main__":
    runtime.main("gateway", build)
