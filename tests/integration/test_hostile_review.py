"""Hostile (and unlucky) messages at the gateway, found by review: every request with a reply
subject is answered (a typed error when it cannot be served), the gateway keeps serving, and
nothing it accepted is lost."""

from __future__ import annotations

import asyncio
import time

import msgspec

from tangram import subjects
from tangram.client import Client
from tangram.contract import (
    MAX_SUBMITS,
    Accepted,
    ActionResult,
    ActionSpec,
    ErrorReply,
    ExecAction,
    GatewayReply,
    GetResult,
    Submit,
    SubmitMany,
    Submitted,
    codec,
    encode,
)
from tangram.launcher import Mesh

from ..support import eventually

pack = msgspec.msgpack.encode
CAP = 256 * 1024  # the largest output cap: a result of ~512 KiB (stdout and stderr)


def spec(**kw: object) -> dict[str, object]:
    base: dict[str, object] = {
        "action_id": "h-1",
        "job_id": "j",
        "trajectory_id": "t",
        "action": {"kind": "exec", "command": "true"},
    }
    return base | kw


def submit(**kw: object) -> bytes:
    return pack({"type": "submit", "spec": spec(**kw)})


async def ask(client: Client, payload: bytes, headers: dict[str, str] | None = None) -> object:
    nc = client.bus.nc
    reply = await nc.request(subjects.GATEWAY.subject, payload, timeout=10, headers=headers)
    return codec.decode(reply.data, GatewayReply)


def deep(levels: int) -> object:
    nested: object = []
    for _ in range(levels):
        nested = [nested]
    return nested


def many(*items: dict[str, object]) -> bytes:
    return pack({"type": "submit_many", "items": [{"type": "submit", "spec": i} for i in items]})


NAN, INF = float("nan"), float("inf")
# (payload, the error code, words the message names): each request refused with a reason
REFUSED = [
    (b"", "invalid_request", "truncated"),
    (pack(None), "invalid_request", "Expected `object`"),
    (pack({}), "invalid_request", "missing required field `type`"),
    (pack({"type": None}), "invalid_request", "$.type"),
    (pack({"type": "submit", 1: 2, "spec": spec()}), "invalid_request", "key"),
    (submit(timeout_s=NAN), "invalid_request", "timeout_s"),
    (submit(timeout_s=INF), "invalid_request", "timeout_s"),
    (submit(timeout_s=-1.0), "invalid_request", "timeout_s"),
    (submit(queue_timeout_s=NAN), "invalid_request", "queue_timeout_s"),
    (submit(duration={"t_ori_s": NAN}), "invalid_request", "t_ori_s"),
    (submit(duration={"parallel_fraction": INF}), "invalid_request", "parallel_fraction"),
    (submit(memory_mb=2**63), "invalid_request", "memory_mb"),
    (submit(cpus=2**64 - 1), "invalid_request", "cpus"),
    (submit(cpus=True), "invalid_request", "cpus"),
    (submit(cpus=1.5), "invalid_request", "cpus"),
    (submit(cpus=[1, 10**6]), "invalid_request", "cpus"),
    (submit(action_id="h-\u00e9"), "invalid_request", "action_id"),
    (submit(action_id="h-\n1"), "invalid_request", "action_id"),
    (submit(action_id="x" * 129), "invalid_request", "action_id"),
    (submit(job_id=""), "invalid_request", "job_id"),
    (submit(trajectory_id="t\x01"), "invalid_request", "trajectory_id"),
    (submit(trajectory_id=""), "invalid_request", "trajectory_id"),
    (submit(profile="p" * 400_000), "invalid_request", "profile"),
    (submit(image="a b"), "invalid_request", "image"),
    (submit(action={"kind": "exec", "command": ["x"] * 5000}), "invalid_request", "command"),
    (submit(action={"kind": "exec", "command": "a\x00b"}), "invalid_request", "NUL"),
    (submit(action={"kind": "exec", "command": "true", "env": {"": "x"}}), "invalid_request", "''"),
    # its name echoed as repr: 4x its 300 KB, over the broker's max payload, so no answer
    (
        submit(action={"kind": "exec", "command": "true", "env": {"\x01" * 300_000 + "=": ""}}),
        "invalid_request",
        "environment variable",
    ),
    (
        submit(action={"kind": "exec", "command": "true", "output_cap_bytes": -1}),
        "invalid_request",
        "output_cap_bytes",
    ),
    (
        submit(action={"kind": "infer", "service": "s", "payload": deep(40)}),
        "invalid_request",
        "nested",
    ),
    (submit(action={"kind": "lease", "quota": "q", "ttl_s": NAN}), "invalid_request", "ttl_s"),
    (
        pack({"type": "submit", "spec": spec(), "reply_subject": "tangram.v1.results.a\tb"}),
        "invalid_request",
        "reply_subject",
    ),
    (
        pack({"type": "submit", "spec": spec(), "reply_subject": "tangram.v1.sched.actions"}),
        "invalid_request",
        "reply_subject",
    ),
    (pack({"type": "get_result", "action_id": "a\x00"}), "invalid_request", "action_id"),
    (pack({"type": "get_result", "action_id": "h-none"}), "not_found", "h-none"),
    (pack({"type": "cancel", "action_id": ""}), "invalid_request", "action_id"),
    (pack({"type": "close_env", "trajectory_id": ["t"]}), "invalid_request", "trajectory_id"),
    (
        pack({"type": "release_lease", "lease_id": "l", "retry_after_s": NAN}),
        "invalid_request",
        "retry_after_s",
    ),
    (pack({"type": "release_lease", "lease_id": "l", "status": 99}), "invalid_request", "status"),
    (pack({"type": "set_quota", "spec": {"name": "q"}}), "invalid_request", "limit"),
    (pack({"type": "register_service", "spec": {"name": "s"}}), "invalid_request", "factory"),
    (pack({"type": "submit_many", "items": [spec()]}), "invalid_request", "items"),
    (
        many(*[spec(action_id=f"h-m{i}") for i in range(MAX_SUBMITS + 1)]),
        "invalid_request",
        "length",
    ),
]


async def big_result(client: Client, uid: str) -> ActionSpec:
    """A finished action whose stored result is ~512 KiB (full stdout and stderr)."""
    fill = f"head -c {CAP} /dev/zero | tr '\\0'"
    big = ActionSpec(
        action_id=f"{uid}-big",
        job_id=uid,
        trajectory_id=uid,
        action=ExecAction(command=f"{fill} a; {fill} b >&2", output_cap_bytes=CAP),
    )
    res = await client.run(big, wait_s=30)
    assert res.ok, res
    assert len(res.stdout) > CAP // 2

    async def stored() -> bool:  # a result is pushed before its record commits
        return isinstance(
            await ask(client, encode(GetResult(action_id=big.action_id))), ActionResult
        )

    await eventually(stored, what="the big result to be stored")
    return big


async def test_a_batch_of_finished_duplicates_is_answered(mesh: Mesh, client: Client, uid: str):
    """A batch resubmitting finished actions (a trainer replaying its ids after a restart)
    was answered with every stored result inline: over the broker's max payload, so no answer
    at all (the requester timed out; the client stalled a whole try, 2 s). Now the results
    that do not fit come back as duplicates, which the client then asks for one by one."""
    big = await big_result(client, uid)
    fresh = ActionSpec(
        action_id=f"{uid}-fresh", job_id=uid, trajectory_id=uid, action=ExecAction(command="true")
    )
    items = (Submit(spec=big),) * 3 + (Submit(spec=fresh),)
    answer = await ask(client, encode(SubmitMany(items=items)))
    assert isinstance(answer, Submitted), answer
    assert [a.action_id for a in answer.items] == [big.action_id] * 3 + [fresh.action_id]  # type: ignore[union-attr]
    assert all(isinstance(a, Accepted | ActionResult) for a in answer.items)
    assert any(
        isinstance(a, Accepted) and a.duplicate and a.status == "succeeded" for a in answer.items
    )
    assert (await client.result(fresh.action_id, timeout=30)).ok  # the new one was kept
    # and through the client: a replay of a finished batch costs no timed-out try
    t0 = time.monotonic()
    again = await asyncio.gather(*(client.run(big, wait_s=30) for _ in range(3)))
    assert [len(r.stdout) for r in again] == [len((await client.result(big.action_id)).stdout)] * 3
    assert time.monotonic() - t0 < 1.5, "a try timed out: the batch's answer did not come"


async def test_hostile_requests_get_typed_errors_and_nothing_accepted_is_lost(
    mesh: Mesh, client: Client, uid: str
):
    """The sweep: every refused request answered with its code and the field it names; what
    was accepted alongside (hostile but valid values, a batch at its size limit, one id twice
    in a batch, requests without a reply subject) runs once; the gateway keeps serving."""
    kept = [
        spec(action_id=f"{uid}-u", trajectory_id=uid, profile="\u00e9\x00\n\u202e"),
        spec(
            action_id=f"{uid}-e",
            trajectory_id=uid,
            action={"kind": "exec", "command": 'echo "$A"', "env": {"A": "x\ny", "\u00e9 b": "1"}},
        ),
        spec(action_id=f"{uid}-q", trajectory_id=uid, queue_timeout_s=1e-300),
    ]
    for one in kept:
        assert isinstance(await ask(client, pack({"type": "submit", "spec": one})), Accepted)
    for payload, code, names in REFUSED:
        err = await ask(
            client, payload, headers={"traceparent": "\x01garbage", "baggage": "b" * 4000}
        )
        assert isinstance(err, ErrorReply), (payload[:80], err)
        assert err.code == code, (payload[:80], err)
        assert names in err.message, (payload[:80], err)
    # a batch at its limit, one id twice in it: each item answered, the id taken once
    batch = [spec(action_id=f"{uid}-b{i}", trajectory_id=uid) for i in range(MAX_SUBMITS - 1)]
    answer = await ask(client, many(*batch, batch[0]))
    assert isinstance(answer, Submitted)
    assert [type(a) for a in answer.items] == [Accepted] * MAX_SUBMITS
    assert [a.duplicate for a in answer.items].count(True) == 1  # type: ignore[union-attr]
    # no reply subject: nothing to answer, a valid one still taken, garbage dropped
    nc = client.bus.nc
    await nc.publish(subjects.GATEWAY.subject, submit(action_id=f"{uid}-n", trajectory_id=uid))
    await nc.publish(subjects.GATEWAY.subject, b"\xc1")
    await nc.publish(subjects.GATEWAY.subject, submit(timeout_s=NAN))
    alive = await client.exec("echo alive", trajectory_id=f"{uid}-a", job_id=uid, wait_s=30)
    assert alive.stdout == "alive\n"
    done = {
        a: await client.result(a, timeout=30)
        for a in [k["action_id"] for k in kept + batch] + [f"{uid}-n"]
    }
    assert all(r.ok for a, r in done.items() if a != f"{uid}-q"), done
    assert done[f"{uid}-e"].stdout == "x\ny\n"
    assert done[f"{uid}-q"].status in ("succeeded", "failed")  # ran at once, or timed out queued
