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

from ..support import eventually

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


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone: it can touch nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        # ProcessLookupError: the file opened, and the process was reaped before the read.
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def pid_of(pidfile: Path) -> int:
    text = await eventually(
        lambda: pidfile.exists() and pidfile.read_text().strip(), what=f"a pid in {pidfile}"
    )
    return int(text)


async def test_timeout_kills_the_group(sock: Path, tmp_path: Path) -> None:
    marker, pidfile = tmp_path / "survived", tmp_path / "child.pid"
    script = f"sh -c 'echo $$ > {pidfile}; sleep 1; touch {marker}' & sleep 30"
    t0 = time.monotonic()
    reply = await run(sock, ["sh", "-c", script], timeout_s=0.3)
    assert reply.header["timed_out"]
    assert reply.header["signal"] == 9
    assert time.monotonic() - t0 < 3
    child = await pid_of(pidfile)
    await eventually(lambda: not alive(child), what="the background child to be killed")
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


async def test_kill_byte(sock: Path, tmp_path: Path) -> None:
    started = tmp_path / "started"
    call = executor_client.Call(sock)
    argv = ["sh", "-c", f"touch {started}; exec sleep 30"]
    task = asyncio.ensure_future(call.run(PAYLOAD | {"argv": argv}, 1024))
    await eventually(started.exists, what="the command to start")
    call.kill()
    reply = await asyncio.wait_for(task, 5)
    assert reply.header["killed"]
    assert reply.header["signal"] == 9


async def test_dropped_connection_kills_the_command(sock: Path, tmp_path: Path) -> None:
    marker, pidfile = tmp_path / "ran-on", tmp_path / "cmd.pid"
    script = f"echo $$ > {pidfile}; sleep 1; touch {marker}"
    task = asyncio.ensure_future(run(sock, ["sh", "-c", script]))
    command = await pid_of(pidfile)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: not alive(command), what="the command to be killed")
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
