"""The fixed-DoP baseline (Fig. 9): FCFS where every elastic action gets the same DoP."""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.policies.base import Running, Waiting, clamp_choice


class FixedDopPolicy:
    """FCFS where every elastic action gets DoP k (clamped into its allowed set)."""

    lookahead = True

    def __init__(self, k: int) -> None:
        if k < 1:
            raise ValueError("fixed DoP must be ≥ 1")
        self.k = k
        self.name = f"fixed-dop:{k}"

    def arrange(
        self,
        waiting: Sequence[Waiting],
        free: int,
        capacity: int,
        running: Sequence[Running],
        now: float,
    ) -> list[int]:
        grants: list[int] = []
        for w in waiting:
            g = clamp_choice(w.choices, self.k)
            if g > free:
                break
            grants.append(g)
            free -= g
        return grants
