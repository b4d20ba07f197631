"""The trajectory-static baseline (Fig. 8a): a pod per trajectory holding its cores for life."""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.policies.base import Running, Waiting, clamp_choice


class TrajectoryStaticPolicy:
    """Pod per trajectory: a trajectory holds ``units`` of this pool from its first action until
    it closes; its actions run inside that reservation at up to ``units``.

    Unlike action-level policies its grants are not a prefix: an action of a trajectory that holds
    a reservation starts even behind a new trajectory waiting for one, so ``grants`` may contain 0
    ("not now"). New trajectories get reservations in FCFS order. It keeps state per pool
    (``PerPool``): one instance per pool, told ``close_trajectory`` when an environment ends.
    """

    lookahead = True  # an action inside its reservation may start behind a blocked one

    def __init__(self, units: int) -> None:
        if units < 1:
            raise ValueError("a trajectory reservation must be ≥ 1 unit")
        self.units = units
        self.name = f"trajectory-static:{units}"
        self._held: dict[str, None] = {}

    def for_pool(self) -> TrajectoryStaticPolicy:
        """A fresh instance, holding no reservation, for another pool."""
        return TrajectoryStaticPolicy(self.units)

    def close_trajectory(self, trajectory_id: str) -> None:
        self._held.pop(trajectory_id, None)

    def held(self) -> tuple[str, ...]:
        return tuple(self._held)

    def arrange(
        self,
        waiting: Sequence[Waiting],
        free: int,
        capacity: int,
        running: Sequence[Running],
        now: float,
    ) -> list[int]:
        in_use: dict[str, int] = {}
        for b in running:
            in_use[b.trajectory_id] = in_use.get(b.trajectory_id, 0) + b.units
        grants, blocked = [], False
        for w in waiting:
            if w.trajectory_id not in self._held:
                room = capacity - self.units * len(self._held)
                if blocked or room < self.units:
                    blocked = True
                    grants.append(0)
                    continue
                self._held[w.trajectory_id] = None
            g = clamp_choice(w.choices, self.units)
            used = in_use.get(w.trajectory_id, 0)
            ok = used + g <= max(self.units, g) and g <= free
            grants.append(g if ok else 0)
            if ok:
                in_use[w.trajectory_id] = used + g
                free -= g
        while grants and grants[-1] == 0:
            grants.pop()
        return grants
