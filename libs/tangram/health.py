"""Role- and phase-aware failure detection (robustrl §4), as a pure core.

No I/O and no clock of its own: every method takes ``now`` (the detector's clock, seconds) and
returns effects for its shell (services/scheduler/health.py). A member is one incarnation of
a node agent; it reports every ``heartbeat_s`` with progress counters (dispatches started and
finished). The rules:

- *silent*: no report for ``silent_s`` makes any member suspect, busy or idle (a dead idle
  agent must not keep being offered new trajectories).
- *stalled*: a member with work assigned whose counters have not moved for its bound --
  ``max(suspect_s, expected_factor * the longest expected duration of what it runs)`` --
  becomes suspect. An idle member is never stalled, however quiet; a slow action only makes
  its member suspect once its own expected duration is long past, and the probe then clears it.
- a suspect is *probed* (a ping on its own command subject); an answer within
  ``probe_timeout_s`` makes it healthy again, no answer makes it *fenced*: its reports are
  refused from then on, so its start lease (see ``tangram.agent.core``) is not renewed.
- a fenced member is *failed* once its lease has surely run out: ``lease_s`` after its last
  report was read. Only then is it recovered (its possibly started actions end ``node_died``):
  nothing it was sent can start after that.
- losing the broker is not a node failure: while the detector itself is cut off it judges
  nobody, and once back it gives every member a fresh window (its reports, its probes) before
  any silence counts again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import msgspec

from tangram.contract import Progress


class HealthConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The detector's bounds, read by the scheduler from ``TANGRAM_HEALTH_SILENT_S``,
    ``..._SUSPECT_S``, ``..._EXPECTED_FACTOR``, ``..._PROBE_TIMEOUT_S``, ``..._LEASE_S`` and
    ``..._CHECK_S``. Defaults (issue 14): agents report every 1 s (``TANGRAM_CPU_HEARTBEAT_S``
    and the like), suspect after 3 s, probe timeout 2 s: a stopped agent is failed ~5 s after
    its last report, a pause shorter than that costs nothing."""

    silent_s: float = 3.0  # no report for this long: suspect (every member)
    suspect_s: float = 3.0  # the floor of the no-progress bound (members with work)
    expected_factor: float = 2.0  # the bound is this many times the longest expected run
    probe_timeout_s: float = 2.0  # a suspect that does not answer its ping within: fenced
    lease_s: float = 3.0  # the agents' start lease; a fenced member fails once it ran out
    check_s: float = 0.25  # how often the shell asks the detector

    def __post_init__(self) -> None:
        values = (self.silent_s, self.suspect_s, self.expected_factor, self.probe_timeout_s)
        if min(*values, self.lease_s, self.check_s) <= 0:
            raise ValueError("TANGRAM_HEALTH_*: every bound must be positive")


class Health(enum.StrEnum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"  # probed, answer awaited
    FENCED = "fenced"  # did not answer: refused from now on, failed once its lease ran out
    FAILED = "failed"  # recovered: its role is the supervisor's to restart


@dataclass(frozen=True, slots=True)
class Probe:
    """Ping this member on its command subject; report :meth:`Detector.answered`."""

    node_id: str
    incarnation: str
    probe: int


@dataclass(frozen=True, slots=True)
class Failed:
    """Recover this member's role now (fence it in the books, end or re-queue its work)."""

    node_id: str
    incarnation: str
    why: str


@dataclass(frozen=True, slots=True)
class Changed:
    """A health transition, to record (Postgres, a span, the log)."""

    node_id: str
    incarnation: str
    role: str
    old: Health
    new: Health
    why: str
    at: float


Effect = Probe | Failed | Changed


@dataclass
class Member:
    node_id: str
    incarnation: str
    role: str
    last_report: float
    last_progress: float  # when its counters last moved (or its window last restarted)
    counters: tuple[int, int] = (0, 0)
    health: Health = Health.HEALTHY
    busy: bool = False  # work is assigned to it
    expected_s: float = 0.0  # the longest expected duration of that work
    probe: int = 0
    deadline: float = 0.0  # suspect: the probe's; fenced: when it fails
    why: str = ""

    def bound(self, cfg: HealthConfig) -> float:
        return max(cfg.suspect_s, cfg.expected_factor * self.expected_s)


class Detector:
    """Members' health; every decision returns effects."""

    def __init__(self, cfg: HealthConfig | None = None) -> None:
        self.cfg = cfg or HealthConfig()
        self.members: dict[str, Member] = {}  # node_id -> its current incarnation
        self.offline = False  # the detector's own link to the broker is down
        self._probes = 0

    # ------------------------------------------------------------------ inputs

    def report(
        self, node_id: str, incarnation: str, role: str, progress: Progress | None, now: float
    ) -> list[Effect]:
        """A member's report; a new incarnation of a node replaces the old one (the books
        end the old one's work)."""
        m = self.members.get(node_id)
        if m is None or m.incarnation != incarnation:
            m = self.members[node_id] = Member(node_id, incarnation, role, now, now)
        if m.health in (Health.FENCED, Health.FAILED):
            return []  # the shell refuses it
        m.last_report = now
        counters = (progress.started, progress.finished) if progress is not None else (0, 0)
        if counters != m.counters:
            m.counters, m.last_progress = counters, now
        if m.health is Health.SUSPECT and m.why.startswith("silent"):
            return [self._set(m, Health.HEALTHY, "reported again", now)]
        return []

    def work(self, node_id: str, busy: bool, expected_s: float, now: float) -> None:
        """What the books assign the member: work or none, and how long it should take. Work
        newly assigned starts its no-progress window."""
        m = self.members.get(node_id)
        if m is None:
            return
        if busy and not m.busy:
            m.last_progress = max(m.last_progress, now)
        m.busy, m.expected_s = busy, expected_s

    def answered(self, node_id: str, incarnation: str, probe: int, now: float) -> list[Effect]:
        """A suspect answered its probe: it is alive; its no-progress window starts again."""
        m = self.members.get(node_id)
        if m is None or m.incarnation != incarnation or m.health is not Health.SUSPECT:
            return []
        if m.probe != probe:
            return []
        m.last_progress = m.last_report = now
        return [self._set(m, Health.HEALTHY, "answered its probe", now)]

    def left(self, node_id: str, incarnation: str) -> None:
        """A member said goodbye: nothing more to judge."""
        m = self.members.get(node_id)
        if m is not None and m.incarnation == incarnation:
            del self.members[node_id]

    def disconnected(self) -> None:
        """The detector lost the broker: silence says nothing now."""
        self.offline = True

    def reconnected(self, now: float) -> list[Effect]:
        """Back on the broker: every member gets a fresh window; pending probes are void."""
        self.offline = False
        effects: list[Effect] = []
        for m in self.members.values():
            if m.health in (Health.FENCED, Health.FAILED):
                continue
            m.last_report = m.last_progress = now
            if m.health is Health.SUSPECT:
                effects.append(self._set(m, Health.HEALTHY, "the detector reconnected", now))
        return effects

    def fenced(self, node_id: str, incarnation: str) -> bool:
        m = self.members.get(node_id)
        return m is not None and m.incarnation == incarnation and m.health is Health.FENCED

    # ------------------------------------------------------------------ time

    def tick(self, now: float) -> list[Effect]:
        """Suspect, fence and fail as the bounds say (nobody while the detector is offline)."""
        if self.offline:
            return []
        effects: list[Effect] = []
        for m in list(self.members.values()):
            effects += self._judge(m, now)
        return effects

    def _judge(self, m: Member, now: float) -> list[Effect]:
        cfg = self.cfg
        if m.health is Health.HEALTHY:
            if now - m.last_report > cfg.silent_s:
                return self._suspect(m, f"silent for {now - m.last_report:.1f}s", now)
            if m.busy and now - m.last_progress > m.bound(cfg):
                why = f"no progress for {now - m.last_progress:.1f}s with work assigned"
                return self._suspect(m, why, now)
        elif m.health is Health.SUSPECT and now >= m.deadline:
            m.deadline = max(now, m.last_report + cfg.lease_s)
            why = f"{m.why}; no answer to its probe within {cfg.probe_timeout_s:g}s"
            return [self._set(m, Health.FENCED, why, now), *self._judge(m, now)]
        elif m.health is Health.FENCED and now >= m.deadline:
            del self.members[m.node_id]
            return [
                self._set(m, Health.FAILED, m.why, now),
                Failed(m.node_id, m.incarnation, m.why),
            ]
        return []

    def _suspect(self, m: Member, why: str, now: float) -> list[Effect]:
        self._probes += 1
        m.probe, m.deadline = self._probes, now + self.cfg.probe_timeout_s
        return [self._set(m, Health.SUSPECT, why, now), Probe(m.node_id, m.incarnation, m.probe)]

    def _set(self, m: Member, new: Health, why: str, now: float) -> Changed:
        old, m.health, m.why = m.health, new, why
        return Changed(m.node_id, m.incarnation, m.role, old, new, why, now)
