"""Duration models of §4.1 (Eq. 1: getDur(m) = T_ori / (E(m)·m)) and their online learning.

A model maps granted units of the key resource to an expected execution time. Models come from
the client's hint (T_ori and an Amdahl fraction), from a profile table, or are learned per
profile key from completed actions. An action whose elasticity is unknown is *inelastic* for the
scheduler: it gets its minimum, and its duration there is the learned mean when there is one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
DEFAULT_DURATION_S = 1.0  # what an action nothing is known of is expected to take


class DurationModel(Protocol):
    """Expected execution seconds per number of granted units; hashable (frozen), so that rows
    computed from a model can be cached on it."""

    def __hash__(self) -> int: ...

    @property
    def elastic(self) -> bool: ...

    def durations(self, units: IntArray) -> FloatArray: ...

    def at(self, units: int) -> float:
        """``durations`` of one unit count (no array made: a pass asks this per call)."""
        ...


@dataclass(frozen=True, slots=True)
class Amdahl:
    """E(m) = 1 / (m (1 - p) + p), so getDur(m) = T_ori · ((1 - p) + p / m)."""

    t_ori_s: float
    parallel_fraction: float

    @property
    def elastic(self) -> bool:
        return self.parallel_fraction > 0.0

    def durations(self, units: IntArray) -> FloatArray:
        p = self.parallel_fraction
        return self.t_ori_s * ((1.0 - p) + p / np.asarray(units, dtype=np.float64))

    def at(self, units: int) -> float:
        p = self.parallel_fraction  # the same float operations as ``durations``
        return self.t_ori_s * ((1.0 - p) + p / float(units))


@dataclass(frozen=True, slots=True)
class Constant:
    """An inelastic action: the same duration whatever it is granted."""

    seconds: float

    @property
    def elastic(self) -> bool:
        return False

    def durations(self, units: IntArray) -> FloatArray:
        return np.full(np.shape(units), self.seconds, dtype=np.float64)

    def at(self, units: int) -> float:
        return self.seconds


@dataclass(frozen=True, slots=True)
class Table:
    """A profiled table ``(units, seconds)``; between points linear in 1/m, clamped outside."""

    points: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        if not self.points or any(u <= 0 or s <= 0 for u, s in self.points):
            raise ValueError("a duration table needs positive (units, seconds) points")

    @property
    def elastic(self) -> bool:
        return len(self.points) > 1

    def durations(self, units: IntArray) -> FloatArray:
        pts = sorted(self.points, reverse=True)  # ascending in 1/m
        inv = np.array([1.0 / u for u, _ in pts])
        secs = np.array([s for _, s in pts])
        out: FloatArray = np.interp(1.0 / np.asarray(units, dtype=np.float64), inv, secs)
        return out

    def at(self, units: int) -> float:
        return float(self.durations(np.asarray([units], dtype=np.int64))[0])


@dataclass(slots=True)
class _Fit:
    """Sufficient statistics of the least-squares fit exec_s = a + b / units."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    units_seen: set[int] = field(default_factory=set)
    fitted: DurationModel | None = None  # ``model()`` until the next ``add``

    def add(self, units: int, exec_s: float, decay: float) -> None:
        self.fitted = None
        x = 1.0 / units
        self.n = self.n * decay + 1.0
        self.sx = self.sx * decay + x
        self.sy = self.sy * decay + exec_s
        self.sxx = self.sxx * decay + x * x
        self.sxy = self.sxy * decay + x * exec_s
        self.units_seen.add(units)

    def model(self) -> DurationModel:
        if self.fitted is None:
            self.fitted = self._fit()
        return self.fitted

    def _fit(self) -> DurationModel:
        mean = self.sy / self.n
        var = self.sxx - self.sx * self.sx / self.n
        if len(self.units_seen) < 2 or var <= 1e-12:
            return Constant(mean)
        b = max(0.0, (self.sxy - self.sx * self.sy / self.n) / var)
        a = max(0.0, (self.sy - b * self.sx) / self.n)
        if a + b <= 0.0:
            return Constant(mean)
        return Amdahl(a + b, b / (a + b))


MAX_PROFILES = 10_000  # learned duration models kept (~1 KB each)


class DurationLearner:
    """Learns one duration model per profile key from completed ``(units, exec_s)`` pairs.

    With one distinct unit count observed the elasticity is unknown and the model is the mean
    duration; with two or more, an Amdahl curve is fitted by least squares. ``decay`` < 1 weighs
    recent observations more (a profile's behaviour drifts as the policy learns).
    """

    def __init__(self, decay: float = 1.0, max_profiles: int = MAX_PROFILES) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError("decay must be in (0, 1]")
        self._decay = decay
        self._max = max_profiles
        self._fits: dict[str, _Fit] = {}  # least recently observed first

    def observe(self, profile: str, units: int, exec_s: float) -> None:
        """Record one completed action of ``profile`` that ran ``exec_s`` on ``units``. The
        profile is a client's string: past ``max_profiles`` the least recently observed one
        is forgotten (kept all, 100k distinct profiles held 69 MB of the scheduler)."""
        if profile and units > 0 and exec_s >= 0.0:
            fit = self._fits.pop(profile, None) or _Fit()
            fit.add(units, exec_s, self._decay)
            self._fits[profile] = fit
            if len(self._fits) > self._max:
                del self._fits[next(iter(self._fits))]

    def model(self, profile: str) -> DurationModel | None:
        """The learned model of ``profile``, or None when nothing was observed."""
        fit = self._fits.get(profile)
        return fit.model() if fit is not None else None

    def profiles(self) -> Sequence[str]:
        return sorted(self._fits)


def resolve(
    profile: str,
    t_ori_s: float | None,
    parallel_fraction: float | None,
    learner: DurationLearner | None,
) -> DurationModel | None:
    """The model for one action: the client's hint first, the learned profile second."""
    if t_ori_s is not None and parallel_fraction is not None:
        return Amdahl(t_ori_s, parallel_fraction)
    learned = learner.model(profile) if learner is not None and profile else None
    if t_ori_s is not None:
        if isinstance(learned, Amdahl):
            return Amdahl(t_ori_s, learned.parallel_fraction)
        return Constant(t_ori_s)
    if parallel_fraction is not None and isinstance(learned, Amdahl | Constant):
        base = learned.t_ori_s if isinstance(learned, Amdahl) else learned.seconds
        return Amdahl(base, parallel_fraction)
    return learned
