"""What a node's report proves about a dispatch it does not list (pure; both cores use it).

A dispatch the report leaves out either never ran there (queue it again), or may still sit
unread in the agent's socket (send the same one again: the agent runs an action once however
often its dispatch comes). Only proof moves it back to the queue: the agent's read mark
(``NodeReport.seen``) covering it, or, for a run restored from Postgres, a report made under
this scheduler's epoch.
"""

from __future__ import annotations

import enum
from typing import Protocol

from services.scheduler.core.effects import StartOnNode
from tangram.contract import NodeReport


class Sent(Protocol):
    """A dispatched action or quota call, as the books keep it."""

    started_at: float
    sent_at: float | None
    sent: StartOnNode | None
    restored: bool
    kill_by: float | None  # being cancelled: never sent again


class Verdict(enum.Enum):
    WAIT = "wait"  # within its grace, or being killed: nothing yet
    REDO = "redo"  # it never ran there: queue it again
    RESEND = "resend"  # unread: the same dispatch once more


def judge(report: NodeReport, run: Sent, now: float, epoch: int, grace_s: float) -> Verdict:
    """The verdict on ``run``, which ``report`` (from its node, this incarnation) omits."""
    if run.restored and report.seen_epoch == epoch:
        # from this epoch on the agent refuses the replaced scheduler's dispatches, so none
        # can start it after this report; an older report proves nothing (the replaced
        # scheduler, if alive, may still dispatch it)
        return Verdict.REDO
    sent_at = run.started_at if run.sent_at is None else run.sent_at
    if now - sent_at <= grace_s:
        return Verdict.WAIT
    sent = run.sent
    if sent is not None and report.seen_epoch == epoch and report.seen >= sent.issued:
        return Verdict.REDO  # read, and unlisted: the agent refused it
    if sent is not None and run.kill_by is None:
        return Verdict.RESEND
    return Verdict.WAIT
