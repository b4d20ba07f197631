"""Workload traces for the simulator: seeded generators, JSONL load/save, and recording.

A trace is a list of trajectories; a trajectory is a start time and a sequence of steps, each an
LLM-generation gap followed by one action. An action's true duration on m units follows Amdahl
(``t_ori_s``, ``parallel_fraction``); whether the scheduler is told (``hinted``) is part of the
trace, as in the paper, where only reward actions were profiled in advance.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec
import numpy as np

CPU = "cpu"
GPU = "gpu"


@dataclass(frozen=True, slots=True)
class Step:
    gap_s: float  # LLM generation before the action is submitted
    profile: str
    choices: tuple[int, ...]
    t_ori_s: float
    parallel_fraction: float = 0.0
    hinted: bool = False
    pool: str = CPU  # "cpu" (the trajectory's node), "gpu", or "quota:<name>"

    def duration(self, units: int) -> float:
        p = self.parallel_fraction
        return self.t_ori_s * ((1.0 - p) + p / units)


@dataclass(frozen=True, slots=True)
class Trajectory:
    trajectory_id: str
    start_s: float
    steps: tuple[Step, ...]
    memory_mb: int = 512


Trace = list[Trajectory]


@dataclass(frozen=True, slots=True)
class CodingConfig:
    """AI coding (§6.4): multi-turn tool use, then one long-tailed parallelizable test run."""

    batch: int = 256
    turns: tuple[int, int] = (3, 8)
    gap_median_s: float = 60.0  # with the defaults: environment busy ~47% of its life (§1)
    tool_median_s: float = 2.0  # short shell commands
    reward_median_s: float = 240.0  # T_ori on one core
    reward_sigma: float = 1.0  # lognormal: long tail
    parallel: tuple[float, float] = (0.90, 0.99)
    max_dop: int = 32
    stagger_s: float = 0.0  # trajectories start spread over this window


def ai_coding(cfg: CodingConfig, seed: int) -> Trace:
    """Trajectories whose environment is busy about half of their life: with the defaults the
    actions take 47% of it on one core (``busy_fraction``), as the paper measured for AI coding
    (§1: "accessed only for 47% of its lifetime"); the long reward run dominates that time."""
    rng = np.random.default_rng(seed)
    out: Trace = []
    for i in range(cfg.batch):
        turns = int(rng.integers(cfg.turns[0], cfg.turns[1] + 1))
        steps = [
            Step(
                _lognormal(rng, cfg.gap_median_s, 0.6),
                "tool",
                (1,),
                _lognormal(rng, cfg.tool_median_s, 0.8),
            )
            for _ in range(turns)
        ]
        steps.append(
            Step(
                _lognormal(rng, cfg.gap_median_s, 0.6),
                "reward",
                tuple(range(1, cfg.max_dop + 1)),
                _lognormal(rng, cfg.reward_median_s, cfg.reward_sigma),
                float(rng.uniform(*cfg.parallel)),
                hinted=True,
            )
        )
        out.append(Trajectory(f"coding-{i}", float(rng.uniform(0, cfg.stagger_s)), tuple(steps)))
    return out


@dataclass(frozen=True, slots=True)
class MopdConfig:
    """MOPD-like: bursts of calls to many GPU teacher/reward services (DoP in {1, 2, 4, 8})."""

    batch: int = 512
    services: int = 9
    calls: tuple[int, int] = (1, 4)
    burst_period_s: float = 60.0
    call_median_s: float = 6.0
    parallel: float = 0.85


def mopd(cfg: MopdConfig, seed: int) -> Trace:
    rng = np.random.default_rng(seed)
    out: Trace = []
    for i in range(cfg.batch):
        burst = float(rng.integers(0, 4)) * cfg.burst_period_s
        steps = tuple(
            Step(
                _lognormal(rng, 2.0, 1.0),
                f"teacher-{int(rng.integers(cfg.services))}",
                (1, 2, 4, 8),
                _lognormal(rng, cfg.call_median_s, 0.5),
                cfg.parallel,
                hinted=True,
                pool=GPU,
            )
            for _ in range(int(rng.integers(cfg.calls[0], cfg.calls[1] + 1)))
        )
        out.append(Trajectory(f"mopd-{i}", burst + float(rng.exponential(2.0)), steps))
    return out


@dataclass(frozen=True, slots=True)
class SearchConfig:
    """DeepSearch-like: API calls against per-site concurrency quotas, then a GPU judge."""

    batch: int = 512
    sites: tuple[str, ...] = ("search", "fetch", "pdf")
    calls: tuple[int, int] = (4, 16)
    call_median_s: float = 1.5
    judge_s: float = 4.0


def deepsearch(cfg: SearchConfig, seed: int) -> Trace:
    rng = np.random.default_rng(seed)
    out: Trace = []
    for i in range(cfg.batch):
        steps = [
            Step(
                _lognormal(rng, 3.0, 0.7),
                site,
                (1,),
                _lognormal(rng, cfg.call_median_s, 0.9),
                pool=f"quota:{site}",
            )
            for site in rng.choice(cfg.sites, int(rng.integers(cfg.calls[0], cfg.calls[1] + 1)))
        ]
        steps.append(Step(1.0, "judge", (1, 2, 4, 8), cfg.judge_s, 0.8, hinted=True, pool=GPU))
        out.append(Trajectory(f"search-{i}", float(rng.exponential(5.0)), tuple(steps)))
    return out


def busy_fraction(trace: Trace) -> float:
    """The share of their life trajectories spend in actions when every action runs on its
    minimum and never waits (a pod per trajectory): action time / (action + generation time)."""
    busy = sum(s.duration(s.choices[0]) for t in trace for s in t.steps)
    gaps = sum(s.gap_s for t in trace for s in t.steps)
    return busy / (busy + gaps) if busy + gaps > 0 else 0.0


def _lognormal(rng: np.random.Generator, median: float, sigma: float) -> float:
    return float(median * np.exp(sigma * rng.standard_normal()))


# ------------------------------------------------------------------ JSONL


def dump(trace: Iterable[Trajectory], path: Path) -> None:
    """One trajectory per line."""
    with path.open("w") as f:
        for t in trace:
            f.write(json.dumps(asdict(t), separators=(",", ":")) + "\n")


def load(path: Path) -> Trace:
    """A JSONL trace; a malformed line raises ValueError naming the file, the line and why."""
    out: Trace = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(_checked(_DECODE(line)))
        except (msgspec.DecodeError, ValueError) as exc:
            raise ValueError(f"{path}:{n}: bad trajectory: {exc}") from exc
    return out


_DECODE = msgspec.json.Decoder(Trajectory).decode


def _checked(t: Trajectory) -> Trajectory:
    for k, s in enumerate(t.steps):
        if not s.choices or s.choices[0] < 1 or list(s.choices) != sorted(set(s.choices)):
            raise ValueError(f"step {k}: choices must be ascending whole units ≥ 1")
        if s.gap_s < 0 or s.t_ori_s <= 0 or not 0.0 <= s.parallel_fraction <= 1.0:
            raise ValueError(f"step {k}: need gap_s ≥ 0, t_ori_s > 0, 0 ≤ parallel_fraction ≤ 1")
        if s.pool not in (CPU, GPU) and not s.pool.startswith("quota:"):
            raise ValueError(f"step {k}: pool must be cpu, gpu or quota:NAME, not {s.pool!r}")
    if t.start_s < 0:
        raise ValueError("start_s must be ≥ 0")
    return t


@dataclass(frozen=True, slots=True)
class Observed:
    """One finished action of a live run, as its ActionResult timings and allocation tell it."""

    trajectory_id: str
    submitted_at: float
    started_at: float
    finished_at: float
    units: int
    choices: tuple[int, ...]
    profile: str = ""
    parallel_fraction: float | None = None


def record(observed: Sequence[Observed]) -> Trace:
    """A trace from a live run: gaps from submit times, T_ori from the exec time and units."""
    by_traj: dict[str, list[Observed]] = {}
    for o in sorted(observed, key=lambda o: (o.trajectory_id, o.submitted_at)):
        by_traj.setdefault(o.trajectory_id, []).append(o)
    t0 = min((o.submitted_at for o in observed), default=0.0)
    out: Trace = []
    for tid, obs in by_traj.items():
        steps, prev_end = [], obs[0].submitted_at
        for o in obs:
            p = o.parallel_fraction or 0.0
            t_ori = (o.finished_at - o.started_at) / ((1.0 - p) + p / o.units)
            hinted = o.parallel_fraction is not None
            steps.append(
                Step(
                    max(0.0, o.submitted_at - prev_end),
                    o.profile,
                    o.choices,
                    max(t_ori, 1e-6),
                    p,
                    hinted,
                )
            )
            prev_end = o.finished_at
        out.append(Trajectory(tid, obs[0].submitted_at - t0, tuple(steps)))
    return out
