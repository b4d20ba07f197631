"""Run the gateway service (``python -m services.gateway``), configured by the environment."""

from __future__ import annotations

from services.gateway import config
from services.gateway.service import Gateway
from tangram import runtime
from tangram.config import MeshConfig


def build() -> tuple[MeshConfig, Gateway]:
    mesh, cfg = config.load()
    return mesh, Gateway(mesh, cfg)


if __name__ == "__main__":
    runtime.main("gateway", build)
