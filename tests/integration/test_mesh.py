"""Submit → result through the real mesh: gateway, scheduler, cpu_manager, NATS, Postgres."""

from __future__ import annotations

import asyncio
import itertools
import os
from pathlib import Path

import psutil
import pytest

from tangram import ActionSpec, ErrorKind, ExecAction, SyncClient
from tangram.client import Client
from tangram.launcher import Mesh

from ..support import eventually


async def test_exec_returns_output_exit_code_allocation_and_timings(client: Client, uid: str):
    res = await client.exec(
        "echo out; echo err >&2; exit 3", trajectory_id=f"{uid}-t", job_id=uid, wait_s=30
    )
    assert res.status == "failed"
    assert res.exit_code == 3
    assert res.stdout == "out\n"
    assert res.stderr == "err\n"
    assert res.error is not None
    assert res.error.kind is ErrorKind.COMMAND_FAILED
    assert not res.infrastructure_failure
    assert res.allocation is not None
    assert len(res.allocation.cores) == 1
    t = res.timings
    assert t is not None
    assert t.submitted_at <= t.started_at <= t.finished_at  # type: ignore[operator]
    assert t.exec_s >= 0
    assert t.overhead_s >= 0
    ok = await client.exec(["echo", "argv", "list"], trajectory_id=f"{uid}-t", job_id=uid)
    assert ok.ok
    assert ok.stdout == "argv list\n"


async def test_action_runs_pinned_to_exactly_its_granted_cores(client: Client, uid: str):
    res = await client.exec(
        "grep Cpus_allowed_list /proc/self/status", trajectory_id=uid, job_id=uid, wait_s=30
    )
    assert res.ok
    allowed = res.stdout.split(":")[1].strip()
    assert res.allocation is not None
    assert allowed == ",".join(map(str, res.allocation.cores))


async def test_trajectory_files_persist_and_are_invisible_to_other_trajectories(
    client: Client, uid: str
):
    a, b = f"{uid}-a", f"{uid}-b"
    w = await client.exec("echo secret > notes.txt", trajectory_id=a, job_id=uid)
    assert w.ok
    r = await client.exec("cat notes.txt", trajectory_id=a, job_id=uid)
    assert r.stdout == "secret\n"
    other = await client.exec("cat notes.txt", trajectory_id=b, job_id=uid)
    assert other.exit_code != 0
    assert "secret" not in other.stdout


async def test_duplicate_action_id_runs_once(client: Client, uid: str):
    spec = ActionSpec(
        action_id=f"{uid}-dup",
        job_id=uid,
        trajectory_id=uid,
        action=ExecAction(command="echo run >> runs.log; sleep 0.2"),
    )
    first, second = await asyncio.gather(client.submit(spec), client.submit(spec))
    assert sorted([first.duplicate, second.duplicate]) == [False, True]
    res = await client.result(spec.action_id, timeout=30)
    assert res.ok
    again = await client.run(spec)  # after it finished: the stored result, not a second run
    assert again.ok
    count = await client.exec("wc -l < runs.log", trajectory_id=uid, job_id=uid)
    assert count.stdout.strip() == "1"


async def test_hundreds_of_concurrent_actions_never_share_a_core(client: Client, uid: str):
    n_traj, per_traj = 30, 10
    ids = itertools.count()

    async def trajectory(t: int) -> list:
        out = []
        for _ in range(per_traj):
            out.append(
                await client.exec(
                    "grep Cpus_allowed_list /proc/self/status; sleep 0.005",
                    trajectory_id=f"{uid}-{t}",
                    job_id=uid,
                    action_id=f"{uid}-{next(ids)}",
                    wait_s=120,
                )
            )
        return out

    batches = await asyncio.gather(*(trajectory(t) for t in range(n_traj)))
    results = [r for b in batches for r in b]
    assert len(results) == n_traj * per_traj
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    spans = []
    for r in results:
        assert r.allocation is not None
        assert r.timings is not None
        cores = set(r.allocation.cores)
        seen = {int(c) for c in r.stdout.split(":")[1].strip().split(",")}
        assert seen == cores
        spans.append((r.timings.started_at, r.timings.finished_at, cores))
    spans.sort()
    for i, (_s1, e1, c1) in enumerate(spans):
        for s2, _e2, c2 in spans[i + 1 :]:
            if s2 >= e1:
                break
            assert not (c1 & c2), "two overlapping actions shared a core"


async def test_timeout_kills_the_whole_process_group(client: Client, uid: str):
    res = await client.exec(
        "sleep 300 & sleep 300; echo never",
        trajectory_id=uid,
        job_id=uid,
        timeout_s=0.5,
        action_id=f"{uid}-slow",
        wait_s=30,
    )
    assert res.status == "failed"
    assert res.error is not None
    assert res.error.kind is ErrorKind.EXEC_TIMEOUT
    assert res.infrastructure_failure
    assert "never" not in res.stdout

    def left() -> list[psutil.Process]:
        return [
            p
            for p in psutil.process_iter(["environ"])
            if (p.info["environ"] or {}).get("TANGRAM_ACTION_ID") == f"{uid}-slow"
        ]

    # The group is SIGKILLed; its processes are gone once the kernel has reaped them.
    await eventually(lambda: not left(), what="the action's processes to be gone", timeout_s=5)


async def test_output_is_capped_and_truncation_flagged(client: Client, uid: str):
    res = await client.exec(
        "head -c 300000 /dev/zero | tr '\\0' x",
        trajectory_id=uid,
        job_id=uid,
        output_cap_bytes=1000,
    )
    assert res.ok
    assert len(res.stdout) == 1000
    assert res.stdout_truncated
    assert not res.stderr_truncated


async def test_dop_is_substituted_with_the_granted_core_count(client: Client, uid: str):
    res = await client.exec("echo dop={dop}", trajectory_id=uid, job_id=uid, cpus=(1, 2))
    assert res.ok
    assert res.allocation is not None
    assert res.stdout.strip() == f"dop={len(res.allocation.cores)}"


async def test_close_env_removes_state_and_a_reused_id_starts_fresh(client: Client, uid: str):
    await client.exec("touch here", trajectory_id=uid, job_id=uid)
    await client.close_env(uid)
    res = await client.exec("ls here", trajectory_id=uid, job_id=uid, wait_s=30)
    assert res.exit_code != 0


async def test_cancel_a_running_action(client: Client, uid: str, tmp_path: Path):
    marker = tmp_path / "running"
    spec = ActionSpec(
        action_id=f"{uid}-c",
        job_id=uid,
        trajectory_id=uid,
        action=ExecAction(command=f"touch {marker}; sleep 30"),
    )
    await client.submit(spec)
    await eventually(marker.exists, what="the action to be running")  # not still queued
    await client.cancel(spec.action_id)
    res = await client.result(spec.action_id, timeout=30)
    assert res.status == "cancelled"
    assert res.error is not None
    assert res.error.kind is ErrorKind.CANCELLED


async def test_queue_timeout_is_an_infrastructure_failure(
    mesh: Mesh, client: Client, uid: str, tmp_path: Path
):
    cores = len(os.sched_getaffinity(0))
    blockers = [
        asyncio.ensure_future(
            client.exec(
                f"touch {tmp_path}/b{i}; sleep 1.5", trajectory_id=f"{uid}-b{i}", job_id=uid
            )
        )
        for i in range(cores)
    ]
    await eventually(
        lambda: len(list(tmp_path.glob("b*"))) == cores, what="every core to be busy", timeout_s=10
    )
    res = await client.exec(
        "true", trajectory_id=f"{uid}-q", job_id=uid, queue_timeout_s=0.3, wait_s=30
    )
    assert res.status == "failed"
    assert res.error is not None
    assert res.error.kind is ErrorKind.QUEUE_TIMEOUT
    assert all(r.ok for r in await asyncio.gather(*blockers))


async def test_result_by_id_from_another_client(mesh: Mesh, client: Client, uid: str):
    spec = ActionSpec(
        action_id=f"{uid}-x",
        job_id=uid,
        trajectory_id=uid,
        action=ExecAction(command="echo shared"),
    )
    await client.submit(spec)
    async with Client.connect(mesh.nats_url) as other:
        res = await other.result(spec.action_id, timeout=30)
    assert res.stdout == "shared\n"


def test_sync_client(mesh: Mesh, uid: str):
    with SyncClient(mesh.nats_url) as c:
        res = c.exec("echo sync", trajectory_id=uid, job_id=uid)
    assert res.stdout == "sync\n"


@pytest.mark.parametrize("cpus", [0, -1, 10**6])
async def test_absurd_resources_are_refused_by_the_client_contract(client: Client, cpus: int):
    from tangram import InvalidRequest

    with pytest.raises(InvalidRequest, match="cpus"):
        await client.exec("true", trajectory_id="t", job_id="j", cpus=cpus)
