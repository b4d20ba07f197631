"""Run the cpu_manager service (``python -m services.cpu_manager``), configured by env."""

from __future__ import annotations

from services.cpu_manager import config
from services.cpu_manager.service import CpuManager
from tangram import runtime
from tangram.config import MeshConfig


def build() -> tuple[MeshConfig, CpuManager]:
    mesh, cfg = config.load()
    return mesh, CpuManager(mesh, cfg)


if __name__ == "__main__":
    runtime.main("cpu_manager", build)
