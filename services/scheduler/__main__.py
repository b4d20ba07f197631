"""Run the scheduler service (``python -m services.scheduler``), configured by the environment."""

from __future__ import annotations

from services.scheduler.service import build
from tangram import runtime

if __name__ == "__main__":
    runtime.main("scheduler", build)
