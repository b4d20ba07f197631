"""tangram-spawner (``services/cpu_manager/process/spawner``): each action a child of the agent,
in its own session, pinned before it runs, stdin /dev/null and no other fd; a failed exec
raises what ``subprocess.Popen`` raises; hostile requests answered and the spawner serving on;
a dead spawner fails what it held and the backend spawns by itself."""

from __future__ import annotations

import array
import asyncio
import errno
import os
import signal
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.cpu_manager.backend_api import ExecRequest
from services.cpu_manager.process import dropuid
from services.cpu_manager.process.backend import ProcessBackend
from services.cpu_manager.process.spawner import (
    MAX_REQUEST,
    Child,
    Spawner,
    SpawnerGone,
    binary,
    exited,
    request,
)

from ..support import eventually, process_backend

CORE = max(os.sched_getaffinity(0))
ENV = {"PATH": "/usr/bin:/bin", "X": "x-value"}


@pytest.fixture
async def spawner(tmp_path: Path) -> AsyncIterator[Spawner]:
    started, why = await Spawner.start()
    assert started is not None, why
    try:
        yield started
    finally:
        await started.close()


async def spawn(
    sp: Spawner, argv: list[str], cwd: Path, cpus: tuple[int, ...] = (CORE,)
) -> tuple[Child, int]:
    """Start ``argv``; the child and the read end of its stdout and stderr (one pipe)."""
    r, w = os.pipe()
    try:  # None while its socket is full (the backend would spawn by itself)
        [started] = await eventually(  # (in a list: eventually would await the future)
            lambda: [f] if (f := sp.spawn(argv, ENV, cwd, cpus, w, w)) else None,
            what="the spawner taking it",
        )
    finally:
        os.close(w)
    try:
        return await started, r
    except BaseException:
        os.close(r)
        raise


async def output(child: Child, r: int) -> tuple[int, str]:
    code = await exited(child)
    with os.fdopen(r, "rb") as f:
        return code, f.read().decode()


def real(path: Path) -> str:
    return os.path.realpath(path)


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def environ_of(pid: int) -> list[bytes]:
    return sorted(e for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if e)


async def spawn_error(sp: Spawner, argv: list[str], cwd: Path, cpus: tuple[int, ...]) -> OSError:
    """The error a spawn that must fail raised."""
    try:
        child, r = await spawn(sp, argv, cwd, cpus)
    except OSError as exc:
        return exc
    os.close(r)
    raise AssertionError(f"{argv} started as {child.pid}")


def zombies() -> list[int]:
    """This process's children that exited and were never reaped."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] == "Z" and int(fields[1]) == os.getpid():
                found.append(int(entry))
    return found


async def test_an_action_is_the_agents_child_in_its_own_session_pinned_with_only_its_fds(
    spawner: Spawner, tmp_path: Path
) -> None:
    child, r = await spawn(spawner, ["sleep", "30"], tmp_path)
    try:
        assert parent_of(child.pid) == os.getpid()  # this process, not the spawner
        assert os.getsid(child.pid) == child.pid  # a session (and process group) of its own
        assert os.sched_getaffinity(child.pid) == {CORE}
        fds = f"/proc/{child.pid}/fd"  # (the dynamic loader opens libraries for a moment)
        await eventually(lambda: sorted(os.listdir(fds)) == ["0", "1", "2"], what="0-2 only")
        assert os.readlink(f"{fds}/0") == "/dev/null"
        assert os.readlink(f"/proc/{child.pid}/cwd") == real(tmp_path)
        assert environ_of(child.pid) == [b"PATH=/usr/bin:/bin", b"X=x-value"]
    finally:
        os.killpg(child.pid, signal.SIGKILL)
    assert await output(child, r) == (-signal.SIGKILL, "")
    assert child.pid not in zombies()


async def test_output_and_exit_code_reach_the_agent(spawner: Spawner, tmp_path: Path) -> None:
    child, r = await spawn(
        spawner,
        ["sh", "-c", 'grep Cpus_allowed_list /proc/self/status; echo "$X" >&2; exit 3'],
        tmp_path,
    )
    code, text = await output(child, r)
    assert code == 3
    assert text.split() == ["Cpus_allowed_list:", str(CORE), "x-value"]


def popen_error(argv: list[str], cwd: Path) -> OSError:
    try:
        subprocess.Popen(argv, cwd=cwd, env=ENV, stdin=subprocess.DEVNULL).wait()
    except OSError as exc:
        return exc
    raise AssertionError(f"{argv} started")


async def test_a_failed_exec_raises_what_popen_raises_and_leaves_no_zombie(
    spawner: Spawner, tmp_path: Path
) -> None:
    plain = tmp_path / "plain"
    plain.write_text("echo hi\n")  # no #! line, executable: ENOEXEC
    plain.chmod(0o755)
    private = tmp_path / "private"
    private.write_text("#!/bin/sh\n")  # not executable: EACCES (as root too: no x bit at all)
    cases = [
        ["/no/such/program"],
        ["no-such-program-anywhere"],
        [str(plain)],
        [str(private)],
        [str(tmp_path)],  # a directory
        ["./plain"],  # relative to the action's directory
    ]
    for argv in cases:
        expected = popen_error(argv, tmp_path)
        got = await spawn_error(spawner, argv, tmp_path, (CORE,))
        assert (got.errno, got.filename) == (expected.errno, expected.filename), argv
    await eventually(lambda: not zombies(), what="the failed children reaped")


async def test_a_missing_directory_and_an_absent_cpu_fail_the_spawn(
    spawner: Spawner, tmp_path: Path
) -> None:
    gone = tmp_path / "gone"
    got = await spawn_error(spawner, ["true"], gone, (CORE,))
    assert (got.errno, got.filename) == (errno.ENOENT, str(gone))
    got = await spawn_error(spawner, ["true"], tmp_path, (60000,))
    assert got.errno == errno.EINVAL
    assert "pin" in str(got)
    child, r = await spawn(spawner, ["true"], tmp_path, cpus=())  # not pinned: the agent's mask
    assert await output(child, r) == (0, "")
    await eventually(lambda: not zombies(), what="the failed children reaped")


def test_it_is_never_built_into_a_directory_others_may_change(tmp_path: Path) -> None:
    """Root execs it for every action where it is root's: a directory another user could
    write is refused (and nothing is built there); a file of another owner is not trusted."""
    open_dir = tmp_path / "open" / "bin"
    open_dir.mkdir(parents=True)
    open_dir.chmod(0o777)
    built, why = binary(open_dir)
    assert built is None
    assert "may be changed by" in why, why
    assert list(open_dir.iterdir()) == []
    built, why = binary(tmp_path / "own" / "bin")
    assert built is not None, why
    assert dropuid.trusted(built, os.geteuid())
    assert not dropuid.trusted(built, os.geteuid() + 1)


def test_requests_popen_would_refuse_or_too_large_are_left_to_the_backend() -> None:
    cwd = Path("/")
    assert request(1, ["true"], ENV, cwd, (0,)) is not None
    assert request(1, ["tr\0ue"], ENV, cwd, (0,)) is None
    assert request(1, ["true"], {"A=B": "1"}, cwd, (0,)) is None
    assert request(1, ["true"], {"A": "\0"}, cwd, (0,)) is None
    assert request(1, [], ENV, cwd, (0,)) is None
    assert request(1, ["true", "x" * MAX_REQUEST], ENV, cwd, (0,)) is None


def sent(sp: Spawner, data: bytes, ancillary: list[tuple[int, int, array.array[int]]]) -> bool:
    """One packet sent, False while the socket is full (the spawner reads on)."""
    try:
        sp._sock.sendmsg([data], ancillary)
    except BlockingIOError:
        return False
    return True


async def test_hostile_requests_are_refused_and_it_serves_on_without_leaking_fds(
    spawner: Spawner, tmp_path: Path
) -> None:
    fds_before = len(os.listdir(f"/proc/{spawner.pid}/fd"))
    good = request(7, ["true"], ENV, tmp_path, (CORE,))
    assert good is not None
    r, w = os.pipe()
    junk = [
        (b"", 2),
        (b"\0\0\0", 2),
        (b"1\0" + b"0-\0/\0" + b"1\0true\0" + b"0\0" + b"1\0/bin/true\0", 2),  # bad cpulist
        (b"1\0\0/\0" + b"99999\0", 2),  # an absurd count
        (b"1\0\0/\0" + b"5\0true\0", 2),  # the request ends before its fields
        (good + b"extra\0", 2),  # more than it declares
        (good, 0),  # no pipes
        (good, 1),
        (good, 5),  # more than two
        (os.urandom(4000), 2),
        (b"x" * 140_000, 2),  # more than it reads (128 KiB)
    ]
    for data, nfds in junk * 3:
        fds = array.array("i", [w] * nfds)
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)] if nfds else []
        await eventually(lambda d=data, a=ancillary: sent(spawner, d, a), what="junk sent")
    os.close(r)
    os.close(w)
    child, out = await spawn(spawner, ["echo", "still"], tmp_path)
    assert await output(child, out) == (0, "still\n")
    assert spawner.alive
    await eventually(
        lambda: len(os.listdir(f"/proc/{spawner.pid}/fd")) == fds_before,
        what="every fd the junk carried closed",
    )


async def test_a_spawn_in_flight_when_the_spawner_dies_fails_spawner_gone(
    spawner: Spawner, tmp_path: Path
) -> None:
    os.kill(spawner.pid, signal.SIGSTOP)
    r, w = os.pipe()
    started = spawner.spawn(["true"], ENV, tmp_path, (CORE,), w, w)
    os.close(w)
    os.close(r)
    assert started is not None
    os.kill(spawner.pid, signal.SIGKILL)
    with pytest.raises(SpawnerGone):
        await asyncio.wait_for(started, 10)
    assert not spawner.alive
    assert spawner.spawn(["true"], ENV, tmp_path, (CORE,), 0, 0) is None


def busy_backend_run(aid: str, tid: str, argv: tuple[str, ...]) -> ExecRequest:
    return ExecRequest(aid, tid, argv, (CORE,), timeout_s=20.0, output_cap_bytes=4096)


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[ProcessBackend]:
    async with process_backend(tmp_path, "n-spawner") as b:
        assert b._spawner is not None
        yield b


async def test_the_backend_spawns_through_it_while_actions_run_each_output_its_own(
    backend: ProcessBackend,
) -> None:
    """200 concurrent echos beside a running action (the spawner's path), each trajectory
    known first (a fresh one's first action goes to the launcher thread)."""
    assert backend._spawner is not None
    tids = [f"t{i}" for i in range(20)]
    for tid in tids:
        assert (await backend.run(busy_backend_run(f"warm-{tid}", tid, ("true",)))).exit_code == 0
    sleeper = asyncio.ensure_future(backend.run(busy_backend_run("s", "ts", ("sleep", "30"))))
    await eventually(lambda: "s" in backend._runs, what="the sleeper running")
    before = backend._spawner.sent
    outs = await asyncio.gather(
        *(
            backend.run(busy_backend_run(f"e{i}", tids[i % 20], ("sh", "-c", f"echo {i}")))
            for i in range(200)
        )
    )
    assert [o.stdout for o in outs] == [f"{i}\n".encode() for i in range(200)]
    assert backend._spawner.sent - before >= 100  # most went through the spawner
    pinned = await backend.run(
        busy_backend_run("p", "t0", ("grep", "Cpus_allowed_list", "/proc/self/status"))
    )
    assert pinned.stdout.decode().split() == ["Cpus_allowed_list:", str(CORE)]
    await backend.kill("s")
    assert (await sleeper).exit_code != 0


async def test_with_its_spawner_dead_the_backend_spawns_by_itself(
    backend: ProcessBackend,
) -> None:
    assert backend._spawner is not None
    assert (await backend.run(busy_backend_run("a", "t", ("true",)))).exit_code == 0
    os.kill(backend._spawner.pid, signal.SIGKILL)
    await eventually(lambda: not backend._spawner.alive, what="the spawner seen gone")
    sleeper = asyncio.ensure_future(backend.run(busy_backend_run("s", "t", ("sleep", "30"))))
    await eventually(lambda: "s" in backend._runs, what="the sleeper running")
    out = await backend.run(busy_backend_run("b", "t", ("echo", "by-itself")))
    assert (out.exit_code, out.stdout) == (0, b"by-itself\n")
    await backend.kill("s")
    await sleeper
