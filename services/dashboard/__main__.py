"""Run the dashboard (``python -m services.dashboard``), configured by the environment."""

from __future__ import annotations

from services.dashboard.service import build
from tangram import runtime

if __name__ == "__main__":
    runtime.main("dashboard", build)
