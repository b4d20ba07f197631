"""Heartbeats of the mesh's services (gateways, schedulers) and how the leader reports them.

A service publishes a :class:`ServiceBeat` every ``TANGRAM_HEARTBEAT_S`` (default 1 s) on the
subject of its role (``subjects.BEATS``), fire-and-forget; the leading scheduler keeps the last
one of each instance and answers them, judged, as :class:`ServiceRow` in its status. (Node
agents report with ``NodeReport``, which the health detector judges.)
"""

from __future__ import annotations

from typing import Annotated, Final

from msgspec import Meta

from tangram.contract.base import Timestamp, _Msg

MAX_COUNTERS: Final = 16

Word = Annotated[str, Meta(min_length=1, max_length=32, pattern=r"^[a-z][a-z0-9_]*$")]
InstanceId = Annotated[
    str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
]


class ServiceBeat(_Msg, tag="service_beat"):
    """One heartbeat: who sends it (``service`` must be the role of the subject it comes on),
    which phase it is in, and its progress counters (monotonic within one instance)."""

    service: Word  # gateway / scheduler
    instance: InstanceId  # one per process incarnation
    pid: Annotated[int, Meta(ge=0)] = 0
    host: Annotated[str, Meta(max_length=64)] = ""
    started_at: Timestamp = 0.0
    phase: Word = "serving"  # gateway: serving/draining; scheduler: leading/standby/stopping
    epoch: Annotated[int, Meta(ge=0)] = 0  # a leading scheduler's epoch
    busy: bool = False  # it has work whose counters should move (else: an idle member)
    counters: Annotated[dict[Word, Annotated[int, Meta(ge=0)]], Meta(max_length=MAX_COUNTERS)] = {}
    sent_at: Timestamp = 0.0  # the sender's clock (shown, never judged: clocks differ)


class ServiceRow(_Msg):
    """One service instance in a status reply, as the leader last heard it."""

    service: str
    instance: str
    host: str = ""
    pid: int = 0
    # healthy / silent (no beat for TANGRAM_HEALTH_SILENT_S) / stalled (busy, counters still)
    # / stopped (said so on its way out)
    health: str = ""
    phase: str = ""
    epoch: int = 0
    heard_s: float | None = None  # seconds since its last heartbeat
    last_progress_s: float | None = None  # seconds since its counters last moved
    counters: dict[str, int] = {}
