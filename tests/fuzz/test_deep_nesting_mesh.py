"""Deep nesting sent to every subject a live mesh serves gets an ``invalid_request`` reply naming
it, and every service keeps serving (issue 17: before, msgspec's RecursionError left such a
request unanswered)."""

from __future__ import annotations

import pytest

from tangram import subjects
from tangram.bus import MAX_NESTING
from tangram.client import Client
from tangram.contract import ErrorReply, Reconcile, codec, encode
from tangram.launcher import Mesh

pytestmark = pytest.mark.slow

# The probe of the issue: 1,033 bytes, an unknown field nested 1,000 deep.
DEEP_UNKNOWN = b"\x83\xa4type\xaaget_result\xa9action_id\xa1x\xa2zz" + b"\x91" * 1000 + b"\x01"
DEEP_BODY = b"\x81\xa1k" * 2000 + b"\x01"
SUBJECTS = [
    subjects.GATEWAY.subject,
    subjects.SCHED_ACTIONS.subject,
    subjects.SCHED_STATUS.subject,
    subjects.sched_node("node0").subject,
    subjects.node("node0").subject,
    subjects.NODES_BROADCAST.subject,
]


@pytest.mark.parametrize("subject", SUBJECTS)
@pytest.mark.parametrize("payload", [DEEP_UNKNOWN, DEEP_BODY], ids=["unknown-field", "body"])
async def test_deep_nesting_is_refused_and_the_mesh_keeps_serving(
    mesh: Mesh, client: Client, uid: str, subject: str, payload: bytes
):
    assert len(DEEP_UNKNOWN) == 1033
    reply = await client.bus.nc.request(subject, payload, timeout=10)
    err = codec.decode(reply.data, ErrorReply)
    assert err.code == "invalid_request"
    assert f"nested deeper than {MAX_NESTING}" in err.message
    # Every hop still serves: gateway, scheduler actions and nodes, the node's commands...
    ok = await client.exec("echo alive", trajectory_id=uid, job_id=uid, wait_s=30)
    assert ok.stdout == "alive\n"
    # ... and the broadcast subject (a stale epoch is refused, so it changes nothing).
    stale = await client.bus.nc.request(
        subjects.NODES_BROADCAST.subject, encode(Reconcile(epoch=0)), timeout=10
    )
    assert "stale scheduler epoch" in codec.decode(stale.data, ErrorReply).message
