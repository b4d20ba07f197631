"""The in-container executor, run as a plain process on the host (no Docker needed)."""

from __future__ import annotations

import asyncio
import errno
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.cpu_manager.docker import executor, executor_client

PAYLOAD = {"op": "run", "cwd": "/", "timeout_s": 10.0, "cap": 1 << 16}


@pytest.fixture
async def sock() -> AsyncIterator[Path]:
    with tempfile.TemporaryDirectory(prefix="tgx-") as d:  # short: unix socket paths are capped
        path = Path(d) / "exec.sock"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", executor.__file__, str(path)
        )
        try:
            await executor_client.wait_ready(path, 10.0)
            yield path
        finally:
            proc.kill()
            await proc.wait()


async def run(sock: Path, argv: list[str], **kw) -> executor_client.Reply:
    payload = PAYLOAD | {"argv": argv} | kw
    return await executor_client.Call(sock).run(payload, payload["cap"])


async def test_ping_and_run(sock: Path) -> None:
    assert await executor_client.ping(sock) > 0
    reply = await run(sock, ["sh", "-c", "echo out; echo err >&2; exit 4"])
    assert reply.header["exit_code"] == 4
    assert (reply.stdout, reply.stderr) == (b"out\n", b"err\n")


async def test_env_and_cwd(sock: Path, tmp_path: Path) -> None:
    reply = await run(
        sock, ["sh", "-c", "echo $FOO $HOME; pwd"], env={"FOO": "bar"}, cwd=str(tmp_path)
    )
    assert reply.stdout.decode().split() == ["bar", "/work", str(tmp_path)]


async def test_timeout_kills_the_group(sock: Path, tmp_path: Path) -> None:
    marker = tmp_path / "survived"
    script = f"(sleep 1; touch {marker}) & sleep 30"
    t0 = time.monotonic()
    reply = await run(sock, ["sh", "-c", script], timeout_s=0.3)
    assert reply.header["timed_out"]
    assert reply.header["signal"] == 9
    assert time.monotonic() - t0 < 3
    await asyncio.sleep(1.2)  # the background child would have touched the marker by now
    assert not marker.exists()


async def test_background_child_does_not_hold_the_reply(sock: Path) -> None:
    t0 = time.monotonic()
    reply = await run(sock, ["sh", "-c", "sleep 30 & echo started"])
    assert reply.header["exit_code"] == 0
    assert time.monotonic() - t0 < 2


async def test_output_cap(sock: Path) -> None:
    reply = await run(sock, ["sh", "-c", "head -c 300000 /dev/zero"], cap=100)
    assert len(reply.stdout) == 100
    assert reply.header["stdout_truncated"]
    assert not reply.header["stderr_truncated"]


async def test_kill_byte(sock: Path) -> None:
    call = executor_client.Call(sock)
    task = asyncio.ensure_future(call.run(PAYLOAD | {"argv": ["sleep", "30"]}, 1024))
    await asyncio.sleep(0.2)
    call.kill()
    reply = await asyncio.wait_for(task, 5)
    assert reply.header["killed"]
    assert reply.header["signal"] == 9


async def test_dropped_connection_kills_the_command(sock: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran-on"
    task = asyncio.ensure_future(run(sock, ["sh", "-c", f"sleep 1; touch {marker}"]))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(1.2)
    assert not marker.exists()


async def test_a_command_that_cannot_start_is_reported_by_its_errno(sock: Path) -> None:
    reply = await run(sock, ["/nonexistent/tool"])
    assert reply.header["exit_code"] is None
    assert reply.header["spawn_errno"] == errno.ENOENT
    assert reply.header["spawn_filename"] == "/nonexistent/tool"


async def test_the_reply_counts_oom_kills_where_the_cgroup_is_readable(sock: Path) -> None:
    reply = await run(sock, ["true"])
    readable = executor.oom_kills() is not None
    assert (reply.header["oom_kills"] is not None) == readable


async def test_bad_request_is_refused(sock: Path) -> None:
    with pytest.raises(executor_client.ExecutorGone, match="bad request"):
        await executor_client.Call(sock).run({"op": "run", "argv": []}, 10)


async def test_many_concurrent_actions(sock: Path) -> None:
    replies = await asyncio.gather(*(run(sock, ["sh", "-c", f"echo {i}"]) for i in range(50)))
    assert [int(r.stdout) for r in replies] == list(range(50))
