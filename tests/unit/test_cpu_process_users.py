"""The process backend run as root: each trajectory's actions run as an unprivileged uid of
their own, and no trajectory can read or write another's directory (``process.users``)."""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psutil
import pytest

from services.cpu_manager.backend_api import ExecOutcome, ExecRequest
from services.cpu_manager.process import users
from services.cpu_manager.process.backend import ProcessBackend, ProcessConfig
from tangram.contract import ErrorKind
from tests.support import eventually

from .test_cpu_process_dropuid import _preload

CORES = tuple(sorted(os.sched_getaffinity(0)))[:1]
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")


@pytest.fixture
def open_root() -> Iterator[Path]:
    """An env root other users can reach (pytest's own temp dirs are closed to them)."""
    base = Path(tempfile.mkdtemp(prefix="tgp-", dir="/tmp"))
    os.chmod(base, 0o711)
    try:
        yield base / "envs"
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
async def backend(open_root: Path) -> AsyncIterator[ProcessBackend]:
    b = ProcessBackend(ProcessConfig(root=open_root, node_id="n-users", incarnation="users"))
    await b.start()
    try:
        yield b
    finally:
        await b.close()


async def run(b: ProcessBackend, trajectory: str, command: str) -> ExecOutcome:
    argv = ("sh", "-c", command)
    return await b.run(
        ExecRequest(f"{trajectory}-{command[:8]}", trajectory, argv, CORES, 10, 4096)
    )


@as_root
async def test_actions_run_as_a_uid_of_their_trajectory(backend: ProcessBackend) -> None:
    assert backend.run_as.per_trajectory
    a1 = await run(backend, "ta", "id -u; id -G")
    a2 = await run(backend, "ta", "id -u")
    b1 = await run(backend, "tb", "id -u")
    uid_a, groups = a1.stdout.decode().split("\n")[:2]
    assert int(uid_a) >= users.UID_BASE
    assert groups == uid_a  # its own group alone: none of root's
    assert a2.stdout.decode().strip() == uid_a
    assert b1.stdout.decode().strip() not in ("0", uid_a)


@as_root
async def test_the_launcher_pins_the_action_and_no_thread_of_the_agent_moves(
    backend: ProcessBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tangram-dropuid pins the action to its cores before it runs: the spawning thread
    never moves onto them (a migration that waits for a busy core)."""
    moved: list[object] = []
    pin = os.sched_setaffinity
    monkeypatch.setattr(os, "sched_setaffinity", lambda *a: (moved.append(a), pin(*a)))
    core = max(os.sched_getaffinity(0))
    for aid in ("first", "second"):  # on the launcher thread, then on the loop
        out = await backend.run(
            ExecRequest(
                aid, "tp", ("grep", "Cpus_allowed_list", "/proc/self/status"), (core,), 10, 4096
            )
        )
        assert out.exit_code == 0, out.stderr
        assert out.stdout.decode().split() == ["Cpus_allowed_list:", str(core)]
    assert moved == []
    assert backend._spawner is None  # nothing for one to do: no spawner process at all


@as_root
async def test_a_trajectory_cannot_touch_another_ones_files(backend: ProcessBackend) -> None:
    wrote = await run(backend, "ta", "echo secret > mine && echo $HOME")
    assert wrote.exit_code == 0, wrote.stderr
    home_a = wrote.stdout.decode().strip()
    for probe in (f"cat {home_a}/mine", f"ls {home_a}", f"touch {home_a}/theirs", "ls .."):
        out = await run(backend, "tb", probe)
        assert out.exit_code != 0, f"{probe} succeeded: {out.stdout!r}"
        assert b"Permission denied" in out.stderr
    assert (Path(home_a) / "mine").read_text() == "secret\n"
    assert not (Path(home_a) / "theirs").exists()


@as_root
async def test_closing_a_trajectory_kills_what_it_left_running(backend: ProcessBackend) -> None:
    out = await run(backend, "tc", "setsid sleep 60 </dev/null >/dev/null 2>&1 & id -u")
    uid = int(out.stdout.decode().strip())

    def running() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["uids"]) if p.info["uids"].real == uid]

    await eventually(running, what="the background sleep")
    await backend.drop_env("tc")
    await eventually(lambda: not running(), what="the leftover to be killed")


async def test_a_closed_directory_on_the_way_means_the_agents_user(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    said = users.run_as(closed / "envs")
    assert not said.per_trajectory
    assert "can read each other" in said.line()
    assert users.run_as(Path("/tmp"), wanted=False) == users.RunAs(False, "trajectory_uids off")


def test_uids_are_one_per_trajectory_and_come_back_last() -> None:
    pool = users.UidPool(1000, size=3)
    a, b = pool.uid("a"), pool.uid("b")
    assert (a, b, pool.uid("a")) == (1000, 1001, 1000)
    assert pool.release("a") == 1000
    assert pool.uid("c") == 1002  # not the one just freed
    assert pool.uid("d") == 1000
    with pytest.raises(OSError, match="in use"):
        pool.uid("e")


def test_two_agents_hold_different_uid_ranges(tmp_path: Path) -> None:
    first = users.SlotClaim(Path("/same/root"), slot_dir=tmp_path)
    second = users.SlotClaim(Path("/same/root"), slot_dir=tmp_path)
    try:
        assert first.first_uid != second.first_uid
    finally:
        first.release()
        second.release()
    again = users.SlotClaim(Path("/same/root"), slot_dir=tmp_path)
    assert again.slot == first.slot  # released by the first: the same root gets it back
    again.release()


@as_root
async def test_a_missing_program_and_setuid_programs_as_a_trajectory_uid(
    backend: ProcessBackend,
) -> None:
    missing = await run(backend, "td", "x")  # sh exists; now a program that does not
    argv = ("no-such-program-h5",)
    req = ExecRequest("td-missing", "td", argv, CORES, 10, 4096)
    out = await backend.run(req)
    assert (out.exit_code, out.stderr) == (127, b"no-such-program-h5: command not found\n")
    assert missing.exit_code == 127  # sh's own "x: not found"
    status = await run(backend, "td", "grep NoNewPrivs /proc/self/status")
    assert status.stdout.split() == [b"NoNewPrivs:", b"1"]  # su, sudo: no way back to root


@as_root
async def test_a_new_incarnation_kills_what_the_last_one_left_under_its_uids(
    open_root: Path,
) -> None:
    def config(incarnation: str) -> ProcessConfig:
        return ProcessConfig(root=open_root, node_id="n-users", incarnation=incarnation)

    first = ProcessBackend(config("one"))
    await first.start()
    try:  # shed the variables leftovers are recognised by, and the process group
        out = await run(first, "te", "env -i setsid sleep 60 </dev/null >/dev/null 2>&1 & id -u")
    finally:
        await first.close()
    uid = int(out.stdout.decode().strip())

    def running() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["uids"]) if p.info["uids"].real == uid]

    await eventually(running, what="the escaped sleep")
    second = ProcessBackend(config("two"))
    await second.start()
    try:
        await eventually(lambda: not running(), what="the escaped sleep to be killed")
    finally:
        await second.close()


@as_root
@pytest.mark.skipif(users.SETPRIV is None, reason="no setpriv")
async def test_the_setpriv_fallback_runs_an_action_as_its_uid(backend: ProcessBackend) -> None:
    """Where tangram-dropuid cannot be built, setpriv drops root the same way."""
    assert users.SETPRIV is not None
    backend.run_as = users.RunAs(True, "no tangram-dropuid: test", launcher=users.SETPRIV)
    out = await run(backend, "tf", "id -u; id -G; grep NoNewPrivs /proc/self/status")
    assert out.exit_code == 0, out.stderr
    uid, groups, no_new_privs = out.stdout.decode().splitlines()
    assert int(uid) >= users.UID_BASE
    assert groups == uid
    assert no_new_privs.split() == ["NoNewPrivs:", "1"]


@as_root
async def test_an_actions_ld_preload_never_runs_as_root(
    backend: ProcessBackend, open_state: Path
) -> None:
    """The backend hands the launcher the action's loader variables as arguments, never in
    its own environment: a library of the action's loads in its uid's processes alone."""
    os.chmod(open_state, 0o777)
    lib, note = _preload(open_state), open_state / "note"
    env = {"LD_PRELOAD": str(lib), "NOTE": str(note)}
    out = await backend.run(ExecRequest("tp-pre", "tp", ("true",), CORES, 10, 4096, env=env))
    assert out.exit_code == 0, out.stderr
    uid = (await run(backend, "tp", "id -u")).stdout.decode().strip()
    assert note.read_text().split() == [uid]  # loaded once: in the action, as its uid


def _deep(top: Path, depth: int) -> None:
    """``depth`` nested directories in ``top`` (by fd: no path grows with them)."""
    fd = os.open(top, os.O_RDONLY)
    try:
        for _ in range(depth):
            os.mkdir("a", dir_fd=fd)
            inner = os.open("a", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = inner
    finally:
        os.close(fd)


async def test_a_tree_deeper_than_pythons_recursion_goes_at_drop_and_at_restart(
    open_root: Path,
) -> None:
    """shutil.rmtree recurses once a level: such a tree, one mkdir loop in an action, raised
    RecursionError out of drop_env and out of every later start of the agent."""
    b = ProcessBackend(ProcessConfig(root=open_root, node_id="n-users", incarnation="deep1"))
    await b.start()
    try:
        for tid in ("tdeep", "tkept"):
            assert (await run(b, tid, "true")).exit_code == 0
            _deep(b.workdir(tid), sys.getrecursionlimit() + 100)
        await b.drop_env("tdeep")
        assert not b.workdir("tdeep").exists()
    finally:
        await b.close()
    again = ProcessBackend(ProcessConfig(root=open_root, node_id="n-users", incarnation="deep2"))
    await again.start()  # wipes what the last incarnation left: tkept's tree
    try:
        assert os.listdir(open_root) == []
    finally:
        await again.close()


HOP = """import fcntl, os, sys, time
held = open(sys.argv[1])  # every generation holds it: free once none lives
fcntl.flock(held, fcntl.LOCK_EX)
end = time.time() + 60
while time.time() < end:
    time.sleep(0.002)
    if os.fork():
        os._exit(0)
"""


def _held(lock: Path) -> bool:
    with open(lock) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False


@as_root
async def test_a_process_that_keeps_changing_pid_is_gone_before_its_uid_comes_back(
    backend: ProcessBackend, open_state: Path
) -> None:
    """A process that forks and lets its parent exit every few ms escapes any scan of the
    process table (``users.kill_uids``, at drop_env and at start); its uid, handed to a new
    trajectory (here the very next one: a pool of one uid; after a restart, the first), would
    give it that trajectory's files. The new holder is first rid of it: kill(-1) as the uid."""
    assert backend._uids is not None
    backend._uids = users.UidPool(backend._uids.first, size=1)
    os.chmod(open_state, 0o777)
    (open_state / "hop.py").write_text(HOP)
    lock = open_state / "held"
    lock.touch(mode=0o644)
    hop = f"setsid python3 {open_state}/hop.py {lock} </dev/null >/dev/null 2>&1 & id -u"
    uid = (await run(backend, "th", hop)).stdout.decode().strip()
    try:
        await eventually(lambda: _held(lock), what="the hopping process")
        await backend.drop_env("th")
        assert (await run(backend, "tv", "id -u")).stdout.decode().strip() == uid
        await eventually(lambda: not _held(lock), what="the hopping process gone", timeout_s=5)
    finally:
        kill = (backend.run_as.launcher, uid, uid, "--", "sh", "-c", "kill -KILL -1")
        await asyncio.to_thread(subprocess.run, kill, env={"PATH": "/usr/bin:/bin"})


@as_root
async def test_another_trajectorys_files_cannot_be_told_from_missing_ones(
    backend: ProcessBackend,
) -> None:
    """The program is looked up as the action's uid: a lookup as root (it once was) answered
    126 for a file in another trajectory's closed directory and 127 for a missing one."""
    home = (await run(backend, "tx", "touch present; chmod 700 present; pwd")).stdout.decode()
    said = {}
    for name in ("present", "absent"):
        for argv, env in (((f"{home.strip()}/{name}",), {}), ((name,), {"PATH": home.strip()})):
            req = ExecRequest(f"ty-{name}-{len(env)}", "ty", argv, CORES, 10, 4096, env=env)
            out = await backend.run(req)
            said[name, len(env)] = (out.exit_code, out.stderr.replace(name.encode(), b"NAME"))
    assert said["present", 0] == said["absent", 0]
    assert said["present", 1] == said["absent", 1]
    assert said["present", 0][0] == 126


@as_root
async def test_an_environment_dropped_under_a_running_action_stays_dropped(
    backend: ProcessBackend,
) -> None:
    """The action's end once listed the environment again (its directory and uid gone)."""
    running = asyncio.create_task(run(backend, "tz", "echo up; exec sleep 30"))
    await eventually(lambda: backend._runs, what="the action running")
    await backend.drop_env("tz")
    assert (await running).failure is not None
    assert "tz" not in backend.envs()


@as_root
def test_a_state_dir_under_a_directory_another_user_can_change_means_the_agents_user(
    open_state: Path,
) -> None:
    """Root makes and chowns each trajectory's directory: under a directory someone else can
    change (swap in a symlink), it would follow their link, so it runs actions as itself."""
    theirs = open_state / "theirs"
    theirs.mkdir()
    os.chown(theirs, 60001, 60001)
    said = users.run_as(theirs / "envs")
    assert not said.per_trajectory
    assert f"{theirs} is not a directory of root's" in said.why
    shared = open_state / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # writable by all, no sticky bit
    assert "may be changed by users other than root" in users.run_as(shared / "envs").why
    os.chmod(shared, 0o1777)  # as /tmp: others cannot replace root's entries
    assert users.run_as(shared / "envs").per_trajectory


async def test_two_first_actions_of_a_trajectory_at_once_both_run(backend: ProcessBackend) -> None:
    """Its directory is made on the launcher thread: the second action, there before it is,
    must not take it for vanished."""
    both = await asyncio.gather(run(backend, "tw", "echo one"), run(backend, "tw", "echo two"))
    assert [(o.exit_code, o.failure, o.stdout) for o in both] == [
        (0, None, b"one\n"),
        (0, None, b"two\n"),
    ]


@as_root
async def test_an_action_queued_for_the_launcher_when_its_trajectory_is_dropped_never_starts(
    backend: ProcessBackend, open_state: Path
) -> None:
    """Its uid is released by the drop (and may be another trajectory's by the time the
    launcher thread reaches it): it ends cancelled, with no directory made and nothing run."""
    os.chmod(open_state, 0o777)
    wedge = threading.Event()
    loop = asyncio.get_running_loop()
    held = loop.run_in_executor(backend._launcher, wedge.wait)  # the launcher thread, busy
    marker = open_state / "ran"
    queued = asyncio.create_task(run(backend, "tq", f"touch {marker}"))
    await eventually(lambda: any(t == "tq" for t in backend._spawning.values()), what="queued")
    await backend.drop_env("tq")
    wedge.set()
    await held
    out = await queued
    assert out.failure is ErrorKind.CANCELLED
    assert not marker.exists()
    assert not backend.workdir("tq").exists()
    assert (await run(backend, "tq", "true")).exit_code == 0  # a new life of it runs


@as_root
async def test_a_new_trajectorys_uid_is_rid_of_leftovers_beside_the_launcher_thread(
    backend: ProcessBackend,
) -> None:
    """The kill (``tangram-dropuid -k``) is spawned from the loop as the action arrives: a
    burst of new trajectories no longer waits for one kill after another on the launcher
    thread. The thread still waits for it before the directory and the spawn."""
    assert backend._uids is not None
    backend._uids = users.UidPool(backend._uids.first, size=1)  # the next trajectory's uid
    uid = str(backend._uids.first)
    leftover = await asyncio.create_subprocess_exec(
        backend.run_as.launcher,
        uid,
        uid,
        "--",
        "sh",
        "-c",
        "echo up; exec sleep 60",
        stdout=subprocess.PIPE,
    )
    assert leftover.stdout is not None
    assert await leftover.stdout.readline() == b"up\n"  # running as the uid
    wedge = threading.Event()
    held = asyncio.get_running_loop().run_in_executor(backend._launcher, wedge.wait)
    try:
        queued = asyncio.create_task(run(backend, "tr", "id -u"))
        assert await asyncio.wait_for(leftover.wait(), 15) == -9  # killed, the thread held
        assert not queued.done()  # behind the held thread
    finally:
        wedge.set()
        await held
        if leftover.returncode is None:
            leftover.kill()
            await leftover.wait()
    out = await queued
    assert (out.exit_code, out.stdout.decode().strip()) == (0, uid)


@as_root
async def test_a_uid_that_cannot_be_rid_of_leftovers_is_the_nodes_failure_and_nothing_runs(
    backend: ProcessBackend, open_state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(users, "kill_argv", lambda uid, launcher: (("/bin/false",), {}))
    os.chmod(open_state, 0o777)
    marker = open_state / "ran"
    out = await run(backend, "tf", f"touch {marker}")
    assert out.failure is ErrorKind.INTERNAL
    assert "could not rid uid" in out.detail
    assert not marker.exists()
