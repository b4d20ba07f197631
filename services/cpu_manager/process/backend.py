"""The ``process`` backend: plain subprocesses pinned to their granted cores. It does NOT isolate
beyond file ownership.

One working directory per trajectory (its HOME and cwd) keeps state across that trajectory's
actions. Run as root, each trajectory's actions run as an unprivileged uid of its own that alone
owns its directory (``users``). Each action runs in its own session so a timeout kills the whole
process group. Pinning without a fork-unsafe ``preexec_fn``: run as root, the launcher that
drops root (``tangram-dropuid -c``) pins itself to the granted cores before it execs the action,
so the action runs there from its first instruction and no thread of the agent moves; otherwise
(not root, or setpriv) the spawning thread sets its own CPU affinity to the granted cores and
spawns, so the child inherits exactly that mask. Moving the thread is a migration that waits for
the action's core (here busy with the mesh's own processes): under load a quarter of the event
loop's time (py-spy at 2,000/s offered). Pinned by the launcher, the secure mesh went from
960-999 to 1,109-1,157 actions/s (bench.secure_mesh --actions 4000 --trajectories 32,
interleaved). Actions as the agent's user have no launcher; one only to pin them (an exec more,
+0.17 ms of CPU per action) gave bench.throughput 1,011-1,128 against 991-1,063 actions/s, not
enough for its CPU, and nothing where the mesh does not share the node's cores. A
trajectory's first action (its directory is made, its uid rid of what an earlier holder left) is
spawned on a dedicated launcher thread, and so is every action while that thread has work, in
order; any other is spawned on the event loop itself (which, where it must pin itself for the
spawn, takes its own mask back at once). Handing every spawn to the thread cost a wake-up of the
thread and one of the loop per action: under load the launch took 1.3-1.6 ms (bench.throughput
at 2,000/s offered, interleaved: 826-845 actions/s and 0.50 ms of agent CPU per action; spawned
on the loop, 881-883/s and 0.43). The price: a spawn that hangs in the kernel (its program on a
hung mount) holds the loop, so the agent falls silent and is failed as a silent node, where a
wedged launcher thread fails only its canary. The exit is watched through a pidfd on the event
loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import psutil

from services.cpu_manager.action_env import action_environ
from services.cpu_manager.backend_api import ExecOutcome, ExecRequest, failed_outcome
from services.cpu_manager.process import users
from services.cpu_manager.process.spawner import Child, Spawner, SpawnerGone
from services.cpu_manager.process.spawner import exited as exited_code
from services.cpu_manager.spawn_failure import spawn_failed
from tangram.agent.starts import Starts
from tangram.contract import ErrorKind

log = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")

DRAIN_AFTER_EXIT_S = 0.5  # background children may hold the pipes; stop reading after this
SPILL_PAUSE_S = 0.01  # past its cap, a pipe is drained at most this often (see CappedSink)
SPILL_READ = 1 << 20  # ... a pipe's worth at a time (Linux's default pipe-max-size)
RM = shutil.which("rm", path="/usr/bin:/bin")  # coreutils: removes a tree of any depth
KILL_TIMEOUT_S = 30.0  # a uid's kill (tangram-dropuid -k) as users.kill_uid bounds it
QUIET = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
AGENT_TAG = "TANGRAM_AGENT_INCARNATION"
ROOT_TAG = "TANGRAM_ENV_ROOT"  # leftovers are recognised by the env root they ran under


@dataclass(frozen=True, slots=True)
class ProcessConfig:
    root: Path
    node_id: str = "node"
    incarnation: str = ""
    path: str = "/usr/local/bin:/usr/bin:/bin"
    trajectory_uids: bool = True  # as root: each trajectory as a uid of its own (``users``)
    spawner: bool = True  # actions started through ``tangram-spawner`` (see ``spawner``)


class CappedSink:
    """Reads one pipe on the event loop: keeps ``cap`` bytes, flags the rest, owns the fd.

    Past the cap it drains the pipe (the action must not block on a full pipe) at most every
    ``SPILL_PAUSE_S``, a pipe's worth at a time: an action writing as fast as it can (``cat
    /dev/zero``) took 45% of a core of the agent's event loop at 64 KiB a read; now ~5%, and a
    chatty action still drains at up to ~100 MB/s."""

    def __init__(self, fd: int, cap: int) -> None:
        self.fd = fd
        self.cap = cap
        self.chunks: list[bytes] = []
        self.size = 0
        self.truncated = False
        self.eof = asyncio.get_running_loop().create_future()
        self._resume: asyncio.TimerHandle | None = None
        os.set_blocking(fd, False)
        asyncio.get_running_loop().add_reader(fd, self._readable)

    def _readable(self) -> bool:
        """One read; whether the pipe may hold more now (False: empty, at its end or paused)."""
        try:
            data = os.read(self.fd, SPILL_READ if self.truncated else 65536)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            self.close()
            return False
        room = self.cap - self.size
        if room > 0:
            self.chunks.append(data[:room])
            self.size += min(len(data), room)
        if len(data) > room:
            if not self.truncated:
                self.truncated = True
                with contextlib.suppress(OSError):  # a larger pipe: fewer, larger spills
                    fcntl.fcntl(self.fd, fcntl.F_SETPIPE_SZ, SPILL_READ)
            loop = asyncio.get_running_loop()
            loop.remove_reader(self.fd)
            self._resume = loop.call_later(SPILL_PAUSE_S, self._read_again)
            return False
        return True

    def read_now(self) -> bool:
        """Read what the pipe holds now (up to the cap: past it, the pause holds); whether it
        is at its end (then closed). Never reads once closed: its fd number may be another
        pipe's by then (the next action's, spawned meanwhile)."""
        while not self.eof.done() and self._resume is None and self._readable():
            pass
        return self.eof.done()

    def _read_again(self) -> None:
        self._resume = None
        if not self.eof.done():
            asyncio.get_running_loop().add_reader(self.fd, self._readable)

    def close(self) -> None:
        """Stop reading and close the fd (once)."""
        if self.eof.done():
            return
        if self._resume is not None:
            self._resume.cancel()
        asyncio.get_running_loop().remove_reader(self.fd)
        os.close(self.fd)
        self.eof.set_result(None)

    def value(self) -> bytes:
        return b"".join(self.chunks)


Proc = subprocess.Popen[bytes] | Child  # an action's process: forked here, or by the spawner


@dataclass
class _Run:
    proc: Proc
    trajectory_id: str
    out_fd: int
    err_fd: int
    killed: ErrorKind | None = None
    exited: asyncio.Future[int] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


def env_dirname(trajectory_id: str) -> str:
    """A filesystem-safe, collision-free directory name for a trajectory id."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in trajectory_id)[:48]
    return f"{safe}-{hashlib.sha256(trajectory_id.encode()).hexdigest()[:12]}"


class ProcessBackend:
    """Subprocess execution in per-trajectory directories; no isolation between trajectories."""

    name = "process"
    isolates = False

    def __init__(self, cfg: ProcessConfig) -> None:
        self.cfg = cfg
        self._launcher = Launcher()
        self._runs: dict[str, _Run] = {}
        self._mask: set[int] | None = None  # the event loop thread's own CPU affinity
        # Actions waiting for the launcher thread, and those of them killed meanwhile: a
        # spawn queued behind a wedged launcher (its node fenced, its actions ended
        # node_died) must not run once the launcher frees up.
        self._spawning: dict[str, str] = {}  # action -> its trajectory
        self._doomed: dict[str, ErrorKind] = {}
        # ... and of those, the ones whose trajectory was dropped meanwhile: its uid may be
        # another's by the time they reach the thread, so nothing of them is done there
        self._dropped: set[str] = set()
        # Launches for the health detector: from a spawn handed to the launcher thread to
        # its process (or its failure) back; milliseconds, unless the launcher is wedged.
        self.starts = Starts()
        self._envs: dict[str, float] = {}
        self._making: set[str] = set()  # new trajectories whose directory the launcher makes
        self.run_as = users.RunAs(False, "not started")
        self._claim: users.SlotClaim | None = None
        self._uids: users.UidPool | None = None  # None: actions run as this agent's user
        self._spawner: Spawner | None = None  # None: spawned from this process

    async def start(self) -> None:
        await asyncio.to_thread(self._clean_leftovers)
        wanted = self.cfg.trajectory_uids
        self.run_as = await asyncio.to_thread(partial(users.run_as, self.cfg.root, wanted=wanted))
        if self.run_as.per_trajectory:
            self._claim = await asyncio.to_thread(users.SlotClaim, self.cfg.root)
            self._uids = users.UidPool(self._claim.first_uid)
            await asyncio.to_thread(users.kill_uids, self._claim.first_uid, users.SLOT_SIZE)
        log.info("process backend: %s; NOT isolated further", self.run_as.line())
        # Every action of a trajectory's own uid is pinned by its launcher: no spawner needed.
        pinned = self._uids is not None and users.pins(self.run_as.launcher)
        if self.cfg.spawner and not pinned:
            self._spawner, why = await Spawner.start()
            if self._spawner is None:
                log.warning("actions are spawned by the agent itself (no spawner: %s)", why)

    def _clean_leftovers(self) -> None:
        """Kill processes an earlier incarnation of this node left, and wipe its directories.

        Only processes that ran under this node's own env root count: other meshes on the same
        machine (another state dir) are left alone.
        """
        for proc in psutil.process_iter(["pid"]):
            with contextlib.suppress(psutil.Error):
                env = proc.environ()
                if env.get(ROOT_TAG) == str(self.cfg.root) and env.get(AGENT_TAG) != (
                    self.cfg.incarnation
                ):
                    log.warning("killing leftover action process %d", proc.pid)
                    proc.kill()
        remove_tree(self.cfg.root)
        self.cfg.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.cfg.root, 0o711)  # others may pass through, never list the trajectories

    async def close(self) -> None:
        for aid in (*self._runs, *self._spawning):
            await self.kill(aid, ErrorKind.CANCELLED)
        self._launcher.shutdown(cancel_futures=True)  # never waits (see Launcher)
        if self._spawner is not None:
            await self._spawner.close()
        if self._claim is not None:
            self._claim.release()

    def envs(self) -> dict[str, float]:
        return dict(self._envs)

    def workdir(self, trajectory_id: str) -> Path:
        return self.cfg.root / env_dirname(trajectory_id)

    async def kill(self, action_id: str, reason: ErrorKind = ErrorKind.CANCELLED) -> bool:
        run = self._runs.get(action_id)
        if run is None:
            if action_id in self._spawning:  # never spawned now (see run)
                self._doomed.setdefault(action_id, reason)
                return True
            return False
        run.killed = run.killed or reason
        _killpg(run.proc.pid)
        return True

    async def drop_env(self, trajectory_id: str) -> None:
        for aid, run in list(self._runs.items()):
            if run.trajectory_id == trajectory_id:
                await self.kill(aid, ErrorKind.CANCELLED)
        for aid, tid in list(self._spawning.items()):
            if tid == trajectory_id:
                self._dropped.add(aid)
                await self.kill(aid, ErrorKind.CANCELLED)
        self._envs.pop(trajectory_id, None)
        uid = self._uids.release(trajectory_id) if self._uids is not None else None
        if uid is not None:  # its background processes too (again when the uid is handed out)
            await asyncio.to_thread(users.kill_uid, uid, self.run_as.launcher)
        await asyncio.to_thread(remove_tree, self.workdir(trajectory_id))

    async def run(self, req: ExecRequest) -> ExecOutcome:
        workdir = self.workdir(req.trajectory_id)
        uid = self._uids.uid(req.trajectory_id) if self._uids is not None else None
        fresh = req.trajectory_id not in self._envs  # its directory is made before its spawn
        rid: Future[int] | None = None
        if fresh:
            self._making.add(req.trajectory_id)  # a second action meanwhile: not vanished
            if uid is not None and users.pins(self.run_as.launcher):
                rid = self._rid(uid)
        elif req.trajectory_id not in self._making and not workdir.is_dir():
            return _lost(f"working directory of {req.trajectory_id} vanished")
        self._envs[req.trajectory_id] = time.monotonic()
        loop = asyncio.get_running_loop()
        started = time.time()
        self._spawning[req.action_id] = req.trajectory_id
        proc: Proc
        try:
            with self.starts.begin():
                if fresh or self._launcher.busy:  # in order behind what the thread has
                    proc, out_fd, err_fd = await loop.run_in_executor(
                        self._launcher, self._spawn, req, workdir, uid, fresh, rid
                    )
                else:
                    proc, out_fd, err_fd = await self._spawn_here(req, workdir, uid)
        except OSError as exc:
            return _spawn_failure(exc, req.argv, workdir, started)
        except SpawnerGone as exc:
            return failed_outcome(ErrorKind.INTERNAL, f"could not start: {exc}", started)
        except _Doomed as exc:
            return failed_outcome(exc.reason, "killed before it started", started)
        finally:
            self._spawning.pop(req.action_id, None)
            self._dropped.discard(req.action_id)
        run = _Run(proc, req.trajectory_id, out_fd, err_fd)
        run.killed = self._doomed.pop(req.action_id, None)  # killed as it was being spawned
        if run.killed is not None:
            _killpg(proc.pid)
        self._runs[req.action_id] = run
        try:
            return await self._supervise(req, run, started)
        finally:
            self._runs.pop(req.action_id, None)
            if req.trajectory_id in self._envs:  # not if dropped meanwhile: it is gone
                self._envs[req.trajectory_id] = time.monotonic()

    async def canary(self) -> None:
        """``true`` spawned on the launcher thread, its exit watched as an action's is: a
        wedged launcher (or fork, or exit watch) never answers, and while the launcher has
        work every action waits for it (a spawn on the event loop that hangs silences the
        whole agent instead, see the module's docstring).

        It takes no core of its own and needs no free one: it runs, for a millisecond, on the
        launcher thread's mask (the agent's cores, or those of the last action the thread
        pinned itself for), beside what runs. A
        node whose cores are all held by long actions that progress is never suspect (its
        counters move within the bound), so a canary that waited for a free core would only
        wrongly fail a busy node; as the agent's own user, in the env root (no trajectory's).

        Then, while the agent has a spawner, a second ``true`` through it (unpinned): a wedged
        spawner holds every action handed to it under load, and answers no canary either."""
        loop = asyncio.get_running_loop()
        proc = await loop.run_in_executor(self._launcher, self._spawn_canary)
        exited: asyncio.Future[int] = loop.create_future()
        self._watch_exit(proc, exited)
        code = await exited
        if code != 0:
            raise RuntimeError(f"the canary (true) exited {code}")
        spawner = self._spawner
        if spawner is not None and spawner.alive:
            await self._spawner_canary(spawner)

    async def _spawner_canary(self, spawner: Spawner) -> None:
        env = {"PATH": self.cfg.path, AGENT_TAG: self.cfg.incarnation, ROOT_TAG: str(self.cfg.root)}
        null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        try:
            started = spawner.spawn(("true",), env, self.cfg.root, (), null, null)
        finally:
            os.close(null)
        if started is None:  # its socket is full, or it died meanwhile: nothing held there
            return
        try:
            code = await exited_code(await started)
        except SpawnerGone:
            return  # gone: the agent spawns by itself from now on
        if code != 0:
            raise RuntimeError(f"the spawner's canary (true) exited {code}")

    def _spawn_canary(self) -> subprocess.Popen[bytes]:
        env = {"PATH": self.cfg.path, AGENT_TAG: self.cfg.incarnation, ROOT_TAG: str(self.cfg.root)}
        return subprocess.Popen(
            ("true",),
            cwd=self.cfg.root,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _rid(self, uid: int) -> Future[int]:
        """Start ridding a new trajectory's uid of whatever an earlier holder left running
        (``tangram-dropuid -k``): spawned from the loop now, its exit code in the future
        returned, which the launcher thread waits for before it makes the directory. Run on
        that thread, one after another, these kills took ~1.2 ms of its time each, the pace of
        a burst of new trajectories; now they run beside it."""
        done: Future[int] = Future()  # read on the launcher thread
        argv, env = users.kill_argv(uid, self.run_as.launcher)
        try:
            pid = os.posix_spawn(argv[0], argv, env, file_actions=QUIET, setsid=True)
        except OSError as exc:
            done.set_exception(exc)
        else:
            self._watch_exit(Child(pid), done)
        return done

    def _spawn(
        self,
        req: ExecRequest,
        workdir: Path,
        uid: int | None,
        fresh: bool = False,
        rid: Future[int] | None = None,
    ) -> tuple[subprocess.Popen[bytes], int, int]:
        """Pin this thread, then spawn (the child inherits it): on the launcher thread, or on
        the event loop's for an action of a known trajectory (see :meth:`_spawn_here`).

        The pipes are plain fds owned by the caller, so exactly one party ever closes them.
        ``uid`` (None: this agent's own) is taken on by the launcher (``tangram-dropuid``, else
        setpriv) right before the action's program (see ``users.as_uid``). A ``fresh``
        trajectory's directory is made here, after the uid is rid of whatever an earlier holder
        left running (a process that kept changing pid escapes every scan; by ``rid`` where
        the loop started that, see :meth:`_rid`): on this thread, before any other action of
        the trajectory can start as that uid.
        """
        argv, env = self._prepare(req, workdir, uid, fresh, rid)
        if not self._launcher_pins(uid, req):
            os.sched_setaffinity(0, req.cores)
        return self._popen(req, workdir, argv, env)

    def _prepare(
        self,
        req: ExecRequest,
        workdir: Path,
        uid: int | None,
        fresh: bool = False,
        rid: Future[int] | None = None,
    ) -> tuple[Sequence[str], dict[str, str]]:
        """What to run and its environment, once the action is known to go ahead (and a
        ``fresh`` trajectory's directory is made: see :meth:`_spawn`)."""
        if rid is not None:  # even if dropped: once past here its kill is over, and the uid's
            # next holder, whose first spawn is behind this on the thread, is not killed by it
            code = rid.result(timeout=KILL_TIMEOUT_S)
            if code != 0:
                raise OSError(errno.EPERM, f"could not rid uid {uid} of its processes ({code})")
        if req.action_id in self._dropped:  # its uid may be another trajectory's by now
            raise _Doomed(self._doomed.pop(req.action_id, ErrorKind.CANCELLED))
        if fresh:  # even for an action killed meanwhile: the next one finds its directory
            try:
                if uid is not None and rid is None:
                    users.kill_uid(uid, self.run_as.launcher)
                workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
                if uid is not None:
                    users.own_dir(workdir, uid)
            finally:
                self._making.discard(req.trajectory_id)
        doomed = self._doomed.pop(req.action_id, None)
        if doomed is not None:
            raise _Doomed(doomed)
        env = self._environ(req, workdir)
        argv: Sequence[str] = req.argv
        if uid is not None:
            argv, env = users.as_uid(uid, req.argv, env, self.run_as.launcher, req.cores)
        return argv, env

    def _popen(
        self, req: ExecRequest, workdir: Path, argv: Sequence[str], env: dict[str, str]
    ) -> tuple[subprocess.Popen[bytes], int, int]:
        """Fork and exec from this thread (the child has its mask)."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            proc = subprocess.Popen(
                argv,
                cwd=workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out_w,
                stderr=err_w,
                start_new_session=True,
            )
        except BaseException:
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        if req.action_id in self._doomed:  # killed meanwhile: its run may be gone (closed)
            _killpg(proc.pid)
        return proc, out_r, err_r

    def _launcher_pins(self, uid: int | None, req: ExecRequest) -> bool:
        """Whether the action's launcher pins it (``tangram-dropuid -c``), so that the spawning
        thread stays where it is."""
        return uid is not None and users.pins(self.run_as.launcher) and bool(req.cores)

    async def _spawn_here(
        self, req: ExecRequest, workdir: Path, uid: int | None
    ) -> tuple[Proc, int, int]:
        """:meth:`_spawn` from the event loop: through the spawner, which pins the child
        itself (see ``spawner``), where this thread would have to move to the action's cores
        while other actions run; else on the loop's own thread. The spawner costs a hop: on a
        node with nothing running the move to an idle core is quick, and a launcher that pins
        (``tangram-dropuid -c``) needs no move at all."""
        argv, env = self._prepare(req, workdir, uid)
        pins = not self._launcher_pins(uid, req)
        spawner = self._spawner
        if pins and self._runs and spawner is not None and spawner.alive:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            try:
                started = spawner.spawn(argv, env, workdir, req.cores, out_w, err_w)
            finally:  # sent with the request (the spawner holds its own copies), or not at all
                os.close(out_w)
                os.close(err_w)
            if started is not None:
                try:
                    proc = await started
                except BaseException:
                    os.close(out_r)
                    os.close(err_r)
                    raise
                if req.action_id in self._doomed:  # killed meanwhile
                    _killpg(proc.pid)
                return proc, out_r, err_r
            os.close(out_r)
            os.close(err_r)
        if not pins:
            return self._popen(req, workdir, argv, env)
        if self._mask is None:
            self._mask = os.sched_getaffinity(0)
        try:
            os.sched_setaffinity(0, req.cores)
            return self._popen(req, workdir, argv, env)
        finally:
            try:
                os.sched_setaffinity(0, self._mask)
            except OSError as exc:  # none of its CPUs is allowed now: pinned, never lost
                log.warning("the event loop keeps the cores of %s: %s", req.action_id, exc)

    def _environ(self, req: ExecRequest, workdir: Path) -> dict[str, str]:
        """A minimal base, the action's own variables, then Tangram's (see ``action_env``) and
        the tags that recognise leftovers of this node."""
        base = {"PATH": self.cfg.path, "HOME": str(workdir), "TMPDIR": str(workdir)}
        base["LANG"] = "C.UTF-8"
        tags = {AGENT_TAG: self.cfg.incarnation, ROOT_TAG: str(self.cfg.root)}
        return action_environ(req, self.cfg.node_id, base, tags)

    async def _supervise(self, req: ExecRequest, run: _Run, started: float) -> ExecOutcome:
        out = CappedSink(run.out_fd, req.output_cap_bytes)
        err = CappedSink(run.err_fd, req.output_cap_bytes)
        self._watch_exit(run.proc, run.exited)
        # A timer, not wait_for(shield(...)): each of those layers costs a turn of the loop
        # between the exit and the next spawn on the freed core (see _drain).
        timer = asyncio.get_running_loop().call_later(req.timeout_s, _time_out, run)
        try:
            code = await run.exited
        finally:
            timer.cancel()
        finished = time.time()
        await self._drain(run, out, err)
        return _outcome(run, code, out, err, started, finished, req.timeout_s)

    def _watch_exit(self, proc: Proc, exited: asyncio.Future[int] | Future[int]) -> None:
        loop = asyncio.get_running_loop()
        pidfd = os.pidfd_open(proc.pid)

        def on_exit() -> None:
            code = proc.poll()
            if code is None:
                return
            loop.remove_reader(pidfd)
            os.close(pidfd)
            if not exited.done():
                exited.set_result(code)

        loop.add_reader(pidfd, on_exit)

    async def _drain(self, run: _Run, out: CappedSink, err: CappedSink) -> None:
        """Read what is left; a background child holding the pipes open is killed.

        Most actions' pipes are at their end by the exit (the kernel closes a process's files
        before it signals its exit): read here and now, the action ends on the turn of the loop
        that saw its exit, where waiting on the sinks would cost two turns more before its core
        takes the next action (at 2,000 actions/s offered, before this, a core turned over
        every ~2.4 ms while a `true` took ~1.5 ms from spawn to exit: ~0.9 ms between)."""
        if out.read_now() and err.read_now():
            return
        done, _ = await asyncio.wait([out.eof, err.eof], timeout=DRAIN_AFTER_EXIT_S)
        if len(done) < 2:
            _killpg(run.proc.pid)
            await asyncio.wait([out.eof, err.eof], timeout=DRAIN_AFTER_EXIT_S)
        out.close()
        err.close()


class Launcher(Executor):
    """The launcher thread: what is submitted runs on one daemon thread, in order; ``busy``
    while anything submitted has not been taken off its queue and run (or skipped).

    Not a ``ThreadPoolExecutor``: a launcher wedged in a spawn (a program or a directory on a
    hung mount, exactly what the health detector's canary finds) must not keep the fenced
    agent from exiting, so that its supervisor starts a new incarnation. ``shutdown`` never
    waits for it, and the interpreter does not join it at exit (it joins every pool thread).
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None]
        self._jobs = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        # one writer each (the submitting thread, the launcher thread): no lock needed
        self._submitted = 0
        self._done = 0

    @property
    def busy(self) -> bool:
        return self._submitted != self._done

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        if self._closed:
            raise RuntimeError("the launcher is shut down")
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="launcher", daemon=True)
            self._thread.start()
        fut: Future[T] = Future()
        self._submitted += 1
        self._jobs.put((fut, partial(fn, *args, **kwargs)))
        return fut

    def shutdown(self, wait: bool = False, *, cancel_futures: bool = False) -> None:
        """Stop taking work; with ``cancel_futures`` what waits never runs. ``wait`` is
        ignored: a wedged launcher would hold the caller (the event loop) for good."""
        self._closed = True
        while cancel_futures:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, fn = job
            try:
                if fut.set_running_or_notify_cancel():
                    fut.set_result(fn())
            except BaseException as exc:  # the caller's to see, as a pool thread hands it on
                fut.set_exception(exc)
            finally:
                self._done += 1


class _Doomed(Exception):
    """An action killed while its spawn waited for the launcher thread: it never starts."""

    def __init__(self, reason: ErrorKind) -> None:
        super().__init__(reason)
        self.reason = reason


def remove_tree(path: Path) -> None:
    """Remove a tree an action built, however deep, never following its links. Blocking.

    ``shutil.rmtree`` recurses once a level: a tree ~1000 deep raises RecursionError through
    ``ignore_errors`` (it stopped ``drop_env`` and then every start of the agent). What it
    leaves goes to ``rm -rf`` (fts: any depth, no link followed)."""
    with contextlib.suppress(RecursionError):
        shutil.rmtree(path, ignore_errors=True)
    if RM is not None and os.path.lexists(path):
        quiet = subprocess.DEVNULL
        argv = (RM, "-rf", "--one-file-system", "--", str(path))
        subprocess.run(argv, env={"PATH": "/usr/bin:/bin"}, stdin=quiet, stdout=quiet, stderr=quiet)


def _time_out(run: _Run) -> None:
    run.killed = run.killed or ErrorKind.EXEC_TIMEOUT
    _killpg(run.proc.pid)


def _killpg(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _spawn_failure(
    exc: OSError, argv: tuple[str, ...], workdir: Path, started: float
) -> ExecOutcome:
    """Why a spawn failed: the action's program (see ``spawn_failure``), its vanished
    directory, or the node itself."""
    failed = os.fsdecode(exc.filename) if exc.filename is not None else None
    if failed == str(workdir):
        return _lost(f"working directory {workdir} vanished")
    if argv and failed == argv[0] and exc.errno is not None:
        own = spawn_failed(argv[0], exc.errno, started)
        if own is not None:
            return own
    return failed_outcome(ErrorKind.INTERNAL, f"could not start: {exc}", started)


def _lost(detail: str) -> ExecOutcome:
    return failed_outcome(ErrorKind.ENVIRONMENT_LOST, detail)


def _outcome(
    run: _Run,
    code: int,
    out: CappedSink,
    err: CappedSink,
    started: float,
    finished: float,
    timeout_s: float,
) -> ExecOutcome:
    detail = ""
    if run.killed is ErrorKind.EXEC_TIMEOUT:
        detail = f"killed after the {timeout_s:g}s timeout"
    elif run.killed is not None:
        detail = "killed on request"
    return ExecOutcome(
        exit_code=code,
        stdout=out.value(),
        stderr=err.value(),
        stdout_truncated=out.truncated,
        stderr_truncated=err.truncated,
        started_at=started,
        finished_at=finished,
        failure=run.killed,
        detail=detail,
    )
