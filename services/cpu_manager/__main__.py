"""Run the cpu_manager service (``python -m services.cpu_manager``), configured by env."""

from __future__ import annotations

from services.cpu_manager.service import build
from tangram import runtime

if __name__ == "__main__":
    runtime.main("cpu_manager", build)
