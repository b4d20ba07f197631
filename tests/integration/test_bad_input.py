"""Hostile input on every surface gets an error reply naming the problem; service keeps serving."""

from __future__ import annotations

import msgspec
import nats
import pytest

from tangram import subjects
from tangram.client import Client
from tangram.contract import (
    MAX_COMMAND_BYTES,
    MAX_SUBMITS,
    Accepted,
    ActionSpec,
    Dispatch,
    ErrorReply,
    ExecAction,
    GatewayReply,
    Kill,
    NodeMessage,
    Submit,
    SubmitMany,
    Submitted,
    UnifiedAction,
    codec,
    encode,
)
from tangram.launcher import Mesh

pack = msgspec.msgpack.encode


def submit_payload(**spec: object) -> bytes:
    base: dict[str, object] = {
        "action_id": "bad-1",
        "job_id": "j",
        "trajectory_id": "t",
        "action": {"kind": "exec", "command": "true"},
    }
    base.update(spec)
    return pack({"type": "submit", "spec": base})


def submit_reply_to(subject: str) -> bytes:
    """A valid submit whose results would be pushed onto ``subject``."""
    payload = msgspec.msgpack.decode(submit_payload(action_id="bad-r"))
    return pack({**payload, "reply_subject": subject})


CASES = [
    (b"\xc1\xff not msgpack", "malformed"),
    (pack([1, 2, 3]), "Expected `object`"),
    (pack({"type": "launch_missiles"}), "launch_missiles"),
    (submit_payload(cpus="four"), "cpus"),
    (submit_payload(cpus=-2), "cpus"),
    (submit_payload(cpus=0), "cpus"),
    (submit_payload(cpus=10**9), "cpus"),
    (submit_payload(cpus=[4, 2]), "min > max"),
    (submit_payload(cpus=[1, 2, 3]), "cpus"),
    (submit_payload(memory_mb=-1), "memory_mb"),
    (submit_payload(timeout_s=0), "timeout_s"),
    (submit_payload(action={"kind": "exec", "command": ""}), "empty command"),
    (submit_payload(action={"kind": "exec", "command": []}), "empty command"),
    (submit_payload(action={"kind": "exec", "command": "   "}), "empty command"),
    (submit_payload(action={"kind": "exec", "command": "x" * (MAX_COMMAND_BYTES + 1)}), "command"),
    (submit_payload(action={"kind": "gpu", "model": "rm"}), "gpu"),
    (submit_payload(action={"kind": "exec", "command": "true", "env": {"A=B": "c"}}), "A=B"),
    (submit_payload(trajectory_id="has space"), "trajectory_id"),
    (submit_payload(action_id=""), "action_id"),
    (pack({"type": "get_result", "action_id": 5}), "action_id"),
    (submit_reply_to(subjects.SCHED_ACTIONS.subject), "tangram.v1.results.<id>"),
    (submit_reply_to(subjects.node("node0").subject), "tangram.v1.results.<id>"),
    (submit_reply_to("tangram.v1.results.>"), "no wildcards"),
    (b"\x00" * (600 * 1024), "exceeds"),
]


@pytest.mark.parametrize(("payload", "names"), CASES)
async def test_gateway_rejects_with_a_reason_and_keeps_serving(
    mesh: Mesh, client: Client, uid: str, payload: bytes, names: str
):
    reply = await client.bus.nc.request(subjects.GATEWAY.subject, payload, timeout=10)
    err = codec.decode(reply.data, GatewayReply)
    assert isinstance(err, ErrorReply)
    assert err.code == "invalid_request"
    assert names in err.message
    ok = await client.exec("echo alive", trajectory_id=uid, job_id=uid, wait_s=30)
    assert ok.stdout == "alive\n"


async def test_unknown_fields_are_accepted_for_rolling_upgrades(client: Client, uid: str):
    spec = {
        "action_id": f"{uid}-fwd",
        "job_id": uid,
        "trajectory_id": uid,
        "action": {"kind": "exec", "command": "echo fwd", "future_field": 1},
        "future": True,
    }
    payload = pack({"type": "submit", "spec": spec, "also_new": [1]})
    reply = await client.bus.nc.request(subjects.GATEWAY.subject, payload, timeout=10)
    ack = codec.decode(reply.data, GatewayReply)
    assert not isinstance(ack, ErrorReply), ack
    res = await client.result(f"{uid}-fwd", timeout=30)
    assert res.stdout == "fwd\n"


async def test_scheduler_and_node_subjects_reject_garbage(mesh: Mesh, client: Client, uid: str):
    nc = client.bus.nc
    for subject in (
        subjects.SCHED_ACTIONS.subject,
        subjects.sched_node("node0").subject,
        subjects.node("node0").subject,
    ):
        reply = await nc.request(subject, b"\x92\x01", timeout=10)
        err = codec.decode(reply.data, ErrorReply)
        assert err.code == "invalid_request"
    bad_completion = pack(
        {
            "type": "completion",
            "node_id": "node0",
            "incarnation": "x",
            "attempt": "one",
            "result": {},
        }
    )
    reply = await nc.request(subjects.sched_node("node0").subject, bad_completion, timeout=10)
    assert "attempt" in codec.decode(reply.data, NodeMessage | ErrorReply).message
    bad_goodbye = pack(
        {"type": "node_leaving", "node_id": "node0", "incarnation": "x", "started": [1, 2]}
    )
    reply = await nc.request(subjects.sched_node("node0").subject, bad_goodbye, timeout=10)
    assert "started" in codec.decode(reply.data, NodeMessage | ErrorReply).message
    # batches: one bad item names itself and nothing of the batch is taken
    bad_batch = pack({"type": "completions", "items": [{"type": "completion", "node_id": 3}]})
    reply = await nc.request(subjects.sched_node("node0").subject, bad_batch, timeout=10)
    assert "items" in codec.decode(reply.data, NodeMessage | ErrorReply).message
    nested = pack({"type": "commands", "epoch": 1, "items": [{"type": "commands", "items": []}]})
    reply = await nc.request(subjects.node("node0").subject, nested, timeout=10)
    assert "items" in codec.decode(reply.data, ErrorReply).message
    bad_enqueue = pack({"type": "enqueue_many", "actions": [{"spec": 1}]})
    reply = await nc.request(subjects.SCHED_ACTIONS.subject, bad_enqueue, timeout=10)
    assert "actions" in codec.decode(reply.data, ErrorReply).message
    ok = await client.exec("echo alive", trajectory_id=uid, job_id=uid, wait_s=30)
    assert ok.ok


async def test_node_refuses_a_deposed_schedulers_epoch(mesh: Mesh, client: Client, uid: str):
    spec = ActionSpec(
        action_id=f"{uid}-e", job_id=uid, trajectory_id=uid, action=ExecAction(command="true")
    )
    action = UnifiedAction(
        spec=spec, demands=(), key_resource="cpu", env_memory_mb=1, submitted_at=0.0
    )
    for cmd in (Dispatch(action=action, cores=(0,), epoch=0), Kill(action_id="x", epoch=0)):
        reply = await client.bus.nc.request(subjects.node("node0").subject, encode(cmd), timeout=10)
        err = codec.decode(reply.data, ErrorReply)
        assert "stale scheduler epoch" in err.message


async def test_a_client_sees_typed_errors(client: Client):
    from tangram import InvalidRequest

    with pytest.raises(InvalidRequest, match="empty command"):
        await client.exec("", trajectory_id="t", job_id="j")
    with pytest.raises(InvalidRequest, match="min > max"):
        await client.submit(
            ActionSpec(
                action_id="z",
                job_id="j",
                trajectory_id="t",
                action=ExecAction(command="true"),
                cpus=[3, 1],
            )
        )


async def test_oversized_payload_for_nats_is_refused_by_the_client_library(mesh: Mesh):
    nc = await nats.connect(mesh.nats_url)
    try:
        with pytest.raises(nats.errors.MaxPayloadError):
            await nc.request(subjects.GATEWAY.subject, b"x" * (2 * 1024 * 1024), timeout=5)
    finally:
        await nc.close()


def test_submit_struct_roundtrip_is_stable():
    spec = ActionSpec(
        action_id="a",
        job_id="j",
        trajectory_id="t",
        action=ExecAction(command=["ls", "-l"]),
        cpus=[1, 4],
    )
    assert codec.decode(encode(Submit(spec=spec)), Submit).spec == spec


async def test_a_batch_of_submits_is_answered_item_by_item(client: Client, uid: str):
    nc = client.bus.nc
    garbled = pack({"type": "submit_many", "items": [{"type": "submit", "spec": 1}]})
    reply = await nc.request(subjects.GATEWAY.subject, garbled, timeout=10)
    err = codec.decode(reply.data, ErrorReply)
    assert (err.code, "items" in err.message) == ("invalid_request", True)
    good = ActionSpec(
        action_id=f"{uid}-ok", job_id=uid, trajectory_id=uid, action=ExecAction(command="true")
    )
    too_many = SubmitMany(items=(Submit(spec=good),) * (MAX_SUBMITS + 1))
    reply = await nc.request(subjects.GATEWAY.subject, encode(too_many), timeout=10)
    assert "length" in codec.decode(reply.data, ErrorReply).message
    too_big = msgspec.structs.replace(good, action_id=f"{uid}-big", memory_mb=1_000_000)
    batch = SubmitMany(items=(Submit(spec=good), Submit(spec=too_big)))
    reply = await nc.request(subjects.GATEWAY.subject, encode(batch), timeout=10)
    answer = codec.decode(reply.data, GatewayReply)
    assert isinstance(answer, Submitted)
    ok, refused = answer.items
    assert isinstance(ok, Accepted)
    assert ok.action_id == f"{uid}-ok"
    assert isinstance(refused, ErrorReply)
    assert refused.code == "invalid_request"
    assert "memory" in refused.message
    assert (await client.result(f"{uid}-ok", timeout=30)).ok  # the good one ran
