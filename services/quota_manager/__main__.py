"""Run the quota_manager service (``python -m services.quota_manager``), configured by env."""

from __future__ import annotations

from services.quota_manager.service import build
from tangram import runtime

if __name__ == "__main__":
    runtime.main("quota_manager", build)
