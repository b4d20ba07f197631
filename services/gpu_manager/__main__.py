"""Run the gpu_manager service (``python -m services.gpu_manager``), configured by env."""

from __future__ import annotations

from services.gpu_manager.service import build
from tangram import runtime

if __name__ == "__main__":
    runtime.main("gpu_manager", build)
