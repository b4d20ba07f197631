"""``tangram-spawner``: the process backend starts actions through a small C process.

An action runs pinned to its cores from its first instruction: a child inherits the CPU mask
of the thread that forks it, so the backend used to move its event loop's thread onto the
action's cores for each spawn. That move is a migration which waits for the target core, and
under load another process holds that core while the whole agent waits with it (py-spy at
2,000 ``true``/s offered: a quarter of the agent's samples in ``sched_setaffinity``).
``spawner.c`` instead makes each action a child of the agent (``CLONE_PARENT``) and pins it
inside the child before its ``exec``: the wait is the spawner's, and the agent's loop goes on.
The agent still reaps its actions, watches their exits (pidfd) and kills their process groups
as it did when it forked them itself; the program is looked up here, as CPython's subprocess
looks it up, and a failed ``exec`` raises the ``OSError`` ``subprocess.Popen`` would.

Built from its source with the machine's C compiler (as ``tangram-dropuid`` is; dynamically
linked: it runs as the agent, with the agent's environment) into a directory only the agent's
user may change: root's ``/run/tangram/bin``, else ``$TMPDIR/tangram-UID/bin``. It checks
itself once at start (a ``true`` through it). Without a compiler, when that check fails or
when it dies, the backend spawns from its own loop as before (logged); a spawn in flight when
it dies fails :class:`SpawnerGone` (whether it started is unknown, so it is not tried again).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from services.cpu_manager.cpulist import format_cpulist
from services.cpu_manager.process import dropuid

log = logging.getLogger(__name__)

SOURCE: Final = Path(__file__).with_name("spawner.c")
# A request larger than this is spawned by the backend itself (spawner.c reads up to 128 KiB;
# a SOCK_SEQPACKET packet must also fit the socket's send buffer).
MAX_REQUEST: Final = 60_000
CHECK_TIMEOUT_S: Final = 10.0
_STAGES: Final = {"p": "request", "k": "clone", "a": "pin", "s": "setsid", "f": "fds"}


class SpawnerGone(Exception):
    """The spawner died with this spawn in flight: whether the action started is unknown."""


@dataclass(slots=True)
class Child:
    """An action the spawner started: a child of this agent, reaped here (what the backend
    uses of ``subprocess.Popen``)."""

    pid: int
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped already: what subprocess.Popen.poll says
                self.returncode = 0
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def bin_dir() -> Path:
    """Where the agent keeps its built spawner: root's own directory, else the user's."""
    if os.geteuid() == 0:
        return dropuid.BIN_DIR
    return Path(tempfile.gettempdir()) / f"tangram-{os.geteuid()}" / "bin"


def binary(directory: Path | None = None) -> tuple[Path | None, str]:
    """The built spawner (built now if missing), or None and why not. Blocking."""
    return dropuid.installed(SOURCE, "tangram-spawner", directory or bin_dir(), static=False)


def request(
    rid: int, argv: Sequence[str], env: Mapping[str, str], cwd: Path, cpus: Sequence[int]
) -> bytes | None:
    """The request spawner.c reads (see its header), or None when the backend must spawn this
    one itself: too large, or a NUL or a bad variable name that ``subprocess.Popen`` refuses
    with its own error."""
    exe = os.fsencode(argv[0]) if argv else b""
    if os.path.dirname(exe):
        paths = [exe]
    else:  # as subprocess.Popen looks it up: each directory of the action's own PATH
        paths = [os.path.join(os.fsencode(d), exe) for d in os.get_exec_path(dict(env))]
    if any(not k or "=" in k for k in env):
        return None
    variables = [os.fsencode(k) + b"=" + os.fsencode(v) for k, v in env.items()]
    fields = [
        str(rid).encode(),
        format_cpulist(cpus).encode(),
        os.fsencode(cwd),
        str(len(argv)).encode(),
        *(os.fsencode(a) for a in argv),
        str(len(variables)).encode(),
        *variables,
        str(len(paths)).encode(),
        *paths,
    ]
    if not argv or any(b"\0" in f for f in fields):
        return None
    data = b"\0".join(fields) + b"\0"
    return data if len(data) <= MAX_REQUEST else None


class Spawner:
    """The agent's end of one ``tangram-spawner`` (see the module doc)."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self._proc = proc
        self._sock = sock
        self._next = 0
        self.sent = 0  # requests handed to it
        self._waiting: dict[int, tuple[asyncio.Future[Child], Sequence[str], Path]] = {}
        self.alive = True
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reaping: set[asyncio.Task[int]] = set()  # children that never became actions

    @classmethod
    async def start(cls, directory: Path | None = None) -> tuple[Spawner | None, str]:
        """A checked spawner, or None and why not (built first if missing)."""
        built, why = await asyncio.to_thread(binary, directory)
        if built is None:
            return None, why
        try:
            spawner = await asyncio.to_thread(cls._launch, built)
        except OSError as exc:
            return None, f"{built} did not start: {exc}"
        spawner._attach(asyncio.get_running_loop())
        why = await spawner._check()
        if why:
            await spawner.close()
            return None, why
        return spawner, ""

    @classmethod
    def _launch(cls, built: Path) -> Spawner:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen(
                [str(built), str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        return cls(proc, ours)

    def _attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self._sock.fileno(), self._readable)

    async def _check(self) -> str:
        """ "" when a ``true`` through it ran and exited 0, else why not."""
        r, w = os.pipe()
        try:
            env = {"PATH": dropuid.SYSTEM_PATH}
            started = self.spawn(["true"], env, Path("/"), (), w, w)
            if started is None:
                return "it took no request"
            child = await asyncio.wait_for(started, CHECK_TIMEOUT_S)
            code = await asyncio.wait_for(exited(child), CHECK_TIMEOUT_S)
        except (OSError, SpawnerGone, TimeoutError) as exc:
            return f"its check (true) failed: {exc!r}"
        finally:
            os.close(r)
            os.close(w)
        return "" if code == 0 else f"its check (true) exited {code}"

    @property
    def pid(self) -> int:
        return self._proc.pid

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: Path,
        cpus: Sequence[int],
        out_w: int,
        err_w: int,
    ) -> asyncio.Future[Child] | None:
        """Start ``argv`` (its stdout and stderr ``out_w`` and ``err_w``, which the caller still
        closes) pinned to ``cpus`` (none: not pinned): a future of the child, failing with the
        ``OSError`` of a failed exec or :class:`SpawnerGone`; None when the caller must spawn
        it itself (see :func:`request`, or the spawner is gone or its socket full)."""
        if not self.alive or self._loop is None:
            return None
        rid = self._next = self._next + 1
        data = request(rid, argv, env, cwd, cpus)
        if data is None:
            return None
        fds = array.array("i", [out_w, err_w])
        try:
            self._sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        except BlockingIOError:
            return None
        except OSError as exc:
            self._gone(f"its socket failed: {exc}")
            return None
        self.sent += 1
        fut: asyncio.Future[Child] = self._loop.create_future()
        self._waiting[rid] = (fut, argv, cwd)
        return fut

    def _readable(self) -> None:
        while True:
            try:
                data = self._sock.recv(256)
            except BlockingIOError:
                return
            except OSError as exc:
                self._gone(f"its socket failed: {exc}")
                return
            if not data:
                self._gone(f"it exited ({self._proc.poll()})")
                return
            self._answer(data)

    def _answer(self, data: bytes) -> None:
        try:
            rid_s, pid_s, err_s, stage = data.decode().split(" ")
            rid, pid, err = int(rid_s), int(pid_s), int(err_s)
        except ValueError:
            log.error("the spawner answered %r: not a reply", data[:100])
            return
        waiting = self._waiting.pop(rid, None)
        if waiting is None:
            log.error("the spawner answered request %d, which nothing waits for", rid)
            return
        fut, argv, cwd = waiting
        if err == 0 and not fut.done():
            fut.set_result(Child(pid))
            return
        if err == 0:  # its waiter was cancelled (the agent stopping): not left running
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        if pid > 0:  # reaped here, its parent (one that failed has exited already)
            self._reap(Child(pid))
        if err == 0 or fut.done():
            return
        if stage == "x":
            exc = OSError(err, os.strerror(err), argv[0])
        elif stage == "c":
            exc = OSError(err, os.strerror(err), str(cwd))
        else:
            exc = OSError(err, f"{os.strerror(err)} (spawner: {_STAGES.get(stage, stage)})")
        fut.set_exception(exc)

    def _reap(self, child: Child) -> None:
        assert self._loop is not None
        task = self._loop.create_task(exited(child))
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)

    def _gone(self, why: str, loud: bool = True) -> None:
        if not self.alive:
            return
        self.alive = False
        if self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
        if loud:
            log.error("spawner %d gone (%s): the agent spawns actions itself", self.pid, why)
        for fut, _, _ in self._waiting.values():
            if not fut.done():
                fut.set_exception(SpawnerGone(f"the spawner died with it in flight: {why}"))
        self._waiting.clear()

    async def close(self) -> None:
        """Stop it (it exits when it reads its socket's end) and reap it."""
        self._gone("closed", loud=False)
        for task in self._reaping:
            task.cancel()
        self._sock.close()
        await asyncio.to_thread(_stop, self._proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=1.0)
    if proc.poll() is None:  # wedged in a spawn (see Spawner): killed
        proc.kill()
        proc.wait()


async def exited(child: Child) -> int:
    """``child``'s exit code, once it exits (reaped: watched through a pidfd, never blocking)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()
    try:
        pidfd = os.pidfd_open(child.pid)
    except ProcessLookupError:
        return child.poll() or 0

    def ready() -> None:
        code = child.poll()
        if code is not None and not done.done():
            done.set_result(code)

    loop.add_reader(pidfd, ready)
    try:
        ready()
        return await done
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
