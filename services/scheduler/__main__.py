"""Run the scheduler service (``python -m services.scheduler``), configured by the environment."""

from __future__ import annotations

from services.scheduler import config
from services.scheduler.service import Scheduler
from tangram import runtime
from tangram.config import MeshConfig


def build() -> tuple[MeshConfig, Scheduler]:
    mesh, cfg = config.load()
    return mesh, Scheduler(mesh, cfg)


if __name__ == "__main__":
    runtime.main("scheduler", build)
