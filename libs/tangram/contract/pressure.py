"""Scheduler → every gateway: how loaded the mesh is, for admission control.

The scheduler publishes one :class:`Pressure` per tick; a gateway refuses new submits with
``busy`` while the backlog it implies is over its bound (services/gateway/admission.py).
The values are bounded at decode time, so a garbled or hostile message is refused by the
codec and never reaches the gateway's decision.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from tangram.contract.base import _Msg

Backlog = Annotated[int, Meta(ge=0, le=10**9)]
Rate = Annotated[float, Meta(ge=0, le=1e9)]  # finite: NaN and inf fail the bounds
Window = Annotated[float, Meta(ge=0, le=3600)]


class Pressure(_Msg, tag="pressure"):
    """Accepted-but-unfinished actions the scheduler holds, and how fast they finish.

    ``queued``/``running`` count both cores (node and quota); ``finished_per_s`` is the rate
    of terminal results (0 on a cold mesh): with ``at_capacity``, measured while actions
    waited in the queue (what the mesh can finish), else over the last ``window_s`` seconds
    (what arrived, a floor of what it can); ``received_up_to`` says which admissions the
    backlog already counts."""

    epoch: Annotated[int, Meta(ge=0)] = 0
    queued: Backlog = 0
    running: Backlog = 0
    finished_per_s: Rate = 0.0
    window_s: Window = 0.0
    # the newest submission time (a gateway's wall clock) among the actions the scheduler has
    # received: a gateway's admissions up to it are in this report's backlog, the later ones
    # not yet (0: not said, an older scheduler)
    received_up_to: Annotated[float, Meta(ge=0, le=1e11)] = 0.0
    at_capacity: bool = False

    @property
    def backlog(self) -> int:
        return self.queued + self.running
