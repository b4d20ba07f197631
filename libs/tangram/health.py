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
- *not starting* (the start phase): a member with launches under way (``Progress.spawning``:
  actions that hold what they need and are being started, see ``tangram.agent.starts``) whose
  ``spawned`` count has not moved for ``start_s`` becomes suspect, whatever its actions'
  durations: starting an action takes milliseconds (a wedged launcher is suspect after
  ``start_s``, not after twice a 600 s timeout). What may take long before a start -- a
  container created or restored, a model restored onto its GPUs, a wait for a core -- is
  no launch, so it never counts here. The window counts only time the member was heard:
  it is judged only while the last report is under ``start_s / 2`` old, and a report after
  a longer gap (the member paused, its reports held up) starts it again, so a pause is
  judged by the silence rule alone.
- a suspect is *probed*, each step answered within ``probe_timeout_s`` or it is *fenced*:
  first a ping on its own command subject (is its bus loop alive?), then, when it is
  suspect for want of progress (not for silence), a *canary*:
  a trivial action through the agent's real execution path (a process spawned as its actions
  are, a no-op on the thread that runs its model calls), answered only once it completed. An
  executor wedged while the bus loop still answers pings fails the second step. Both carry
  the incarnation probed: an answer of another incarnation of the node never counts for it.
  Fenced, its reports are refused from then on, so its start lease (see
  ``tangram.agent.core``) is not renewed.
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
    ``..._SUSPECT_S``, ``..._EXPECTED_FACTOR``, ``..._PROBE_TIMEOUT_S``, ``..._LEASE_S``,
    ``..._CHECK_S``, ``..._CANARY`` and (the history in ``health_events``)
    ``..._EVENTS_KEEP_S``, ``..._EVENTS_KEEP_ROWS`` and ``..._PRUNE_S``. Defaults (issue 14):
    agents report every 1 s (``TANGRAM_CPU_HEARTBEAT_S`` and the like), suspect after 3 s,
    probe timeout 2 s: a stopped agent is failed ~5 s after its last report, a pause shorter
    than that costs nothing; an executor wedged under a live bus loop is fenced two probe
    timeouts after it became suspect (ping, then canary), failed once its lease ran out.
    ``TANGRAM_HEALTH_START_S`` (3 s) bounds the start phase: a member whose launches have
    not moved for that long is suspect (a wedged launcher: failed within ~10 s of the
    dispatch, whatever the action's timeout). Keep the agents' heartbeat under half of it:
    a longer gap between reports restarts the window (a 2 s heartbeat with the default
    would never let it fill)."""

    silent_s: float = 3.0  # no report for this long: suspect (every member)
    suspect_s: float = 3.0  # the floor of the no-progress bound (members with work)
    expected_factor: float = 2.0  # the bound is this many times the longest expected run
    start_s: float = 3.0  # launches under way and none ended for this long: suspect
    probe_timeout_s: float = 2.0  # a suspect that does not answer its ping within: fenced
    lease_s: float = 3.0  # the agents' start lease; a fenced member fails once it ran out
    check_s: float = 0.25  # how often the shell asks the detector
    canary: bool = True  # after its ping, a stalled suspect runs a canary (off: ping alone)
    # health_events: transitions older than this are pruned (fenced ones of the last day are
    # kept whatever this says: a new leader fences them again), and beyond this many rows
    events_keep_s: float = 7 * 24 * 3600.0
    events_keep_rows: int = 100_000
    prune_s: float = 3600.0  # how often the leading scheduler prunes them

    def __post_init__(self) -> None:
        values = (self.silent_s, self.suspect_s, self.expected_factor, self.probe_timeout_s)
        kept = (self.events_keep_s, self.events_keep_rows, self.prune_s)
        if min(*values, self.start_s, self.lease_s, self.check_s, *kept) <= 0:
            raise ValueError("TANGRAM_HEALTH_*: every bound must be positive")


class Health(enum.StrEnum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"  # probed (see Step), answer awaited
    FENCED = "fenced"  # did not answer: refused from now on, failed once its lease ran out
    FAILED = "failed"  # recovered: its role is the supervisor's to restart


class Step(enum.Enum):
    """Where a suspect's probe is: its ping awaited, then its canary."""

    PING = "ping"
    CANARY = "canary"


@dataclass(frozen=True, slots=True)
class Probe:
    """Ping this member on its command subject (with ``canary``: have it run its canary and
    answer once that completed); report :meth:`Detector.answered`."""

    node_id: str
    incarnation: str
    probe: int
    canary: bool = False


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
    spawned: int = 0  # the start phase (see ``report``): launches ended so far
    spawning: int = 0  # launches under way at its last report
    last_start: float = 0.0  # when its start window last (re)started
    health: Health = Health.HEALTHY
    busy: bool = False  # work is assigned to it
    expected_s: float = 0.0  # the longest expected duration of that work
    probe: int = 0
    step: Step = Step.PING  # a suspect: what it was asked last
    stalled: bool = False  # a suspect for want of progress (not silence): its canary is due
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
        gap, m.last_report = now - m.last_report, now
        progress = progress or Progress()
        counters = (progress.started, progress.finished)
        if counters != m.counters:
            m.counters, m.last_progress = counters, now
        self._starts(m, progress, gap, now)
        if m.health is Health.SUSPECT and m.why.startswith("silent"):
            m.last_start = now  # back from silence: a fresh start window
            return [self._set(m, Health.HEALTHY, "reported again", now)]
        return []

    def _starts(self, m: Member, progress: Progress, gap: float, now: float) -> None:
        """The start window opens when launches appear, restarts whenever one ends, and
        after a gap in the member's reports (time it was not heard says nothing of its
        launcher)."""
        if not m.spawning or progress.spawned != m.spawned or gap > self.cfg.start_s / 2:
            m.last_start = now
        m.spawned, m.spawning = progress.spawned, progress.spawning

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
        """A suspect answered its probe (this incarnation, this probe: an answer of another
        incarnation of the node never counts). An answered ping asks for the canary, within
        a probe timeout of its own; an answered canary makes it healthy: its no-progress
        window starts again. The answered ping renews nothing else: its start lease is
        renewed by answered reports alone, so a fenced member's deadline stays sound."""
        m = self.members.get(node_id)
        if m is None or m.incarnation != incarnation or m.health is not Health.SUSPECT:
            return []
        if m.probe != probe:
            return []
        if m.step is Step.PING and m.stalled and self.cfg.canary:
            return [self._ask(m, Step.CANARY, now)]
        m.last_progress = m.last_report = m.last_start = now
        why = "answered its ping and canary" if m.step is Step.CANARY else "answered its probe"
        return [self._set(m, Health.HEALTHY, why, now)]

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
            m.last_report = m.last_progress = m.last_start = now
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
            if m.spawning and now - m.last_start > cfg.start_s and self._heard(m, now):
                why = (
                    f"{m.spawning} launches under way and none ended for {now - m.last_start:.1f}s"
                )
                return self._suspect(m, why, now, stalled=True)
            if m.busy and now - m.last_progress > m.bound(cfg):
                why = f"no progress for {now - m.last_progress:.1f}s with work assigned"
                return self._suspect(m, why, now, stalled=True)
        elif m.health is Health.SUSPECT and now >= m.deadline:
            m.deadline = max(now, m.last_report + cfg.lease_s)
            what = "no answer to its ping" if m.step is Step.PING else "its canary did not complete"
            why = f"{m.why}; {what} within {cfg.probe_timeout_s:g}s"
            return [self._set(m, Health.FENCED, why, now), *self._judge(m, now)]
        elif m.health is Health.FENCED and now >= m.deadline:
            del self.members[m.node_id]
            return [
                self._set(m, Health.FAILED, m.why, now),
                Failed(m.node_id, m.incarnation, m.why),
            ]
        return []

    def _heard(self, m: Member, now: float) -> bool:
        """Whether the member is heard now (its last report is within half the start bound):
        time it was not heard (a pause) never fills its start window."""
        return now - m.last_report <= self.cfg.start_s / 2

    def _suspect(self, m: Member, why: str, now: float, stalled: bool = False) -> list[Effect]:
        """Probe it. Only a stalled one runs the canary after its ping: a silent one is
        healthy again once it reports (the ping says whether it is alive at all), and a
        canary that queued behind calls running within their bounds (a GPU node's runner
        threads) would fail a live node for a pause of its heartbeats."""
        m.stalled = stalled
        changed = self._set(m, Health.SUSPECT, why, now)
        return [changed, self._ask(m, Step.PING, now)]

    def _ask(self, m: Member, step: Step, now: float) -> Probe:
        """A new probe (an answer to an earlier one no longer counts), due in a timeout."""
        self._probes += 1
        m.probe, m.step, m.deadline = self._probes, step, now + self.cfg.probe_timeout_s
        return Probe(m.node_id, m.incarnation, m.probe, canary=step is Step.CANARY)

    def _set(self, m: Member, new: Health, why: str, now: float) -> Changed:
        old, m.health, m.why = m.health, new, why
        return Changed(m.node_id, m.incarnation, m.role, old, new, why, now)
