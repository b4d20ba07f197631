"""Run the reward front (``python -m services.reward_front``), configured by the environment."""

from __future__ import annotations

from services.reward_front.service import build
from tangram import runtime

if __name__ == "__main__":
    runtime.main("reward_front", build)
