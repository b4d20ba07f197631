"""Unprivileged uids for the process backend's actions: one per live trajectory.

An agent running as root runs each trajectory's actions as a uid of its own (no passwd entry
is needed to setuid), owning that trajectory's directory with mode 0700, so one trajectory can
neither read nor write another's files. The uids come from a range this agent alone holds on
the machine: a *slot* of :data:`SLOT_SIZE` uids above :data:`UID_BASE`, claimed with a lock
file the kernel releases when the agent dies, so two agents (of one mesh or of two) never hand
out the same uid. Within the slot uids are handed out in turn, so a uid comes back only after
the whole slot has been used; its leftover processes are killed when its trajectory closes.

Not root, or an env root other users cannot reach, means actions run as the agent's own user
(the startup line says so). Nothing else is isolated: network, processes, memory and the rest
of the filesystem are shared with the host.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import stat
import subprocess
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final

import psutil

from services.cpu_manager.cpulist import format_cpulist
from services.cpu_manager.process import dropuid

UID_BASE: Final = 0x4000_0000  # far above what useradd, systemd or subuid ranges hand out
SLOT_SIZE: Final = 65_536
SLOTS: Final = 4096
SLOT_DIR: Final = Path("/run/tangram/uid-slots")  # root's own: nobody else can hold a slot
log = logging.getLogger(__name__)
SETPRIV: Final = shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")  # util-linux
ENV: Final = shutil.which("env", path="/usr/bin:/bin")  # coreutils
KILL_ALL: Final = "kill -KILL -1 2>/dev/null; :"  # all of the caller's uid's processes but it
# What glibc drops from a setuid program's environment (sysdeps/generic/unsecvars.h) besides
# LD_*: honoured by a root process that is not setuid, as the launcher is until it drops root.
ROOT_UNSAFE: Final = frozenset(
    {
        "GCONV_PATH",
        "GETCONF_DIR",
        "GLIBC_TUNABLES",
        "HOSTALIASES",
        "LOCALDOMAIN",
        "LOCPATH",
        "MALLOC_ARENA_MAX",
        "MALLOC_ARENA_TEST",
        "MALLOC_MMAP_MAX_",
        "MALLOC_MMAP_THRESHOLD_",
        "MALLOC_PERTURB_",
        "MALLOC_TOP_PAD_",
        "MALLOC_TRACE",
        "MALLOC_TRIM_THRESHOLD_",
        "NIS_PATH",
        "NLSPATH",
        "RESOLV_HOST_CONF",
        "RES_OPTIONS",
        "TMPDIR",
        "TZDIR",
    }
)


@dataclass(frozen=True, slots=True)
class RunAs:
    """Whom actions run as: per-trajectory uids, or the agent's own user and why."""

    per_trajectory: bool
    why: str = ""
    launcher: str = ""  # what drops root before an action: tangram-dropuid, else setpriv

    def line(self) -> str:
        """The words of the startup line about users."""
        if self.per_trajectory:
            how = "tangram-dropuid" if self.launcher != SETPRIV else f"setpriv: {self.why}"
            return f"each trajectory as its own unprivileged uid ({how}), its directory closed"
        return f"actions as this agent's user ({self.why}), trajectories can read each other"


def run_as(root: Path, *, wanted: bool = True, bin_dir: Path = dropuid.BIN_DIR) -> RunAs:
    """Whether actions under ``root`` can run as their own uids here (and are ``wanted`` to),
    and through what (builds ``tangram-dropuid`` into ``bin_dir`` if missing: blocking)."""
    if not wanted:
        return RunAs(False, "trajectory_uids off")
    if os.geteuid() != 0:
        return RunAs(False, "not root: cannot switch users")
    unfit = _unfit_ancestor(root)
    if unfit:
        return RunAs(False, unfit)
    built, why = dropuid.launcher(bin_dir)
    if built is not None:
        return RunAs(True, launcher=str(built))
    if SETPRIV is None:
        return RunAs(False, f"no tangram-dropuid ({why}) and no setpriv (util-linux)")
    log.warning("actions drop root through setpriv (~1 ms more CPU each): %s", why)
    return RunAs(True, f"no tangram-dropuid: {why}", launcher=SETPRIV)


def _unfit_ancestor(path: Path) -> str:
    """Why trajectories' uids cannot work under ``path`` ("" when they can): a directory on
    the way that other users cannot pass through, or one (``path`` itself included) that
    someone other than root could change, swapping in a symlink root would then follow into
    a chown. What does not exist yet the agent creates, as root."""
    real = path.resolve()
    for p in (*reversed(real.parents), real):
        try:
            st = p.lstat()
        except FileNotFoundError:
            return ""
        if p != real and not st.st_mode & stat.S_IXOTH:
            return f"{p} is closed to other users; use a state dir outside it"
        unsafe = dropuid.root_only(p, st)
        if unsafe:
            return f"{unsafe}; use a state dir only root can change"
    return ""


class UidPool:
    """The uids of one claimed slot, one per live trajectory, handed out in turn."""

    def __init__(self, first: int, size: int = SLOT_SIZE) -> None:
        self.first = first
        self.size = size
        self._next = 0
        self._by_trajectory: dict[str, int] = {}

    def uid(self, trajectory_id: str) -> int:
        """The uid of ``trajectory_id`` (a new one for a trajectory not seen yet)."""
        uid = self._by_trajectory.get(trajectory_id)
        if uid is None:
            uid = self._by_trajectory[trajectory_id] = self._fresh()
        return uid

    def release(self, trajectory_id: str) -> int | None:
        """Forget the trajectory's uid (returned, for its leftovers to be killed)."""
        return self._by_trajectory.pop(trajectory_id, None)

    def _fresh(self) -> int:
        taken = set(self._by_trajectory.values())
        if len(taken) >= self.size:
            raise OSError(f"all {self.size} uids of this agent are in use")
        while True:
            uid = self.first + self._next
            self._next = (self._next + 1) % self.size
            if uid not in taken:
                return uid


class SlotClaim:
    """A range of uids this agent holds on the machine until :meth:`release` (or death)."""

    def __init__(self, root: Path, slot_dir: Path = SLOT_DIR) -> None:
        self._file: IO[bytes] | None = None
        slot_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        start = zlib.crc32(str(root).encode()) % SLOTS  # the same root, the same slot if free
        for i in range(SLOTS):
            slot = (start + i) % SLOTS
            f = open(slot_dir / str(slot), "ab")  # held for the agent's life
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            self._file, self.slot = f, slot
            self.first_uid = UID_BASE + slot * SLOT_SIZE
            return
        raise OSError(f"no free uid slot in {slot_dir}: {SLOTS} agents on this machine?")

    def release(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def pins(launcher: str) -> bool:
    """Whether ``launcher`` pins the action to its cores itself (``as_uid``'s ``cores``):
    ``tangram-dropuid`` does, setpriv does not (the spawning thread pins itself then)."""
    return launcher != SETPRIV


def as_uid(
    uid: int,
    argv: Sequence[str],
    env: Mapping[str, str],
    launcher: str,
    cores: Sequence[int] = (),
) -> tuple[tuple[str, ...], dict[str, str]]:
    """The argv and environment that run ``argv`` with ``env`` as ``uid`` (the same gid, no
    supplementary groups, no gain through setuid programs), through ``launcher``
    (``tangram-dropuid`` or setpriv, see ``run_as``); pinned to ``cores`` by the launcher
    where it ``pins`` (else ``cores`` are ignored).

    The launcher starts as root, and the C library honours variables such as LD_PRELOAD in a
    process that is root without being setuid: an action setting them would run its code as
    root. So those (glibc's list for setuid programs, and every LD_*) are kept out of the
    launcher's environment and handed to it as NAME=VALUE arguments, set once root is gone
    (through env(1) after setpriv). Why not ``Popen(user=...)``: CPython then forks the whole
    agent instead of vfork-ing, which cost ~5 ms more CPU per action (bench/auth_cost.py). The
    launcher looks the program up as the uid, never root here: a lookup as root would tell the
    action which files exist where it may not look (another trajectory's directory)."""
    assert launcher, "run_as() said per-trajectory uids are possible"
    assert uid > 0, "never run an action as root"
    held = [f"{k}={v}" for k, v in env.items() if _for_root_unsafe(k)]
    safe = {k: v for k, v in env.items() if not _for_root_unsafe(k)}
    if pins(launcher):
        pin = ("-c", format_cpulist(cores)) if cores else ()
        return (launcher, *pin, str(uid), str(uid), *held, "--", *argv), safe
    if held and ENV is None:
        raise FileNotFoundError(errno.ENOENT, "env (coreutils) sets them after setpriv", "env")
    then = (ENV, *held) if held and ENV is not None else ()
    if then and "=" in argv[0]:  # env(1) would take it for one more variable
        raise OSError(errno.EINVAL, "cannot follow env(1): the name holds '='", argv[0])
    drop = (f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs", "--")
    return (launcher, *drop, *then, *argv), safe  # launcher is SETPRIV here


def _for_root_unsafe(name: str) -> bool:
    return name in ROOT_UNSAFE or name.startswith("LD_")


def kill_argv(uid: int, launcher: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """The argv and environment of :func:`kill_uid`'s process."""
    if pins(launcher):  # tangram-dropuid
        return (launcher, "-k", str(uid), str(uid)), {}
    return as_uid(uid, ("sh", "-c", KILL_ALL), {"PATH": dropuid.SYSTEM_PATH}, launcher)


def kill_uid(uid: int, launcher: str) -> None:
    """Kill every process of ``uid``, even one that keeps forking to a new pid (a scan of the
    process table misses it, see ``kill_uids``): kill(-1, SIGKILL) run as that uid, which the
    kernel applies to all its processes at once (a fork under way fails). Blocking: one exec
    of ``tangram-dropuid -k``; through setpriv, a launcher and a sh (~1.2 ms of CPU; a psutil
    scan of 100 processes costs 3.4)."""
    argv, env = kill_argv(uid, launcher)
    quiet = subprocess.DEVNULL
    subprocess.run(argv, env=env, cwd="/", stdin=quiet, stdout=quiet, stderr=quiet, timeout=30)


def kill_uids(first: int, count: int = 1) -> None:
    """Kill every process still running as a uid in ``[first, first + count)``: a closed
    trajectory's background ones, or (the whole slot) an earlier incarnation's, even those
    that shed the variables leftovers are otherwise recognised by."""
    for proc in psutil.process_iter(["uids"]):
        with contextlib.suppress(psutil.Error):
            if proc.info["uids"] is not None and first <= proc.info["uids"].real < first + count:
                proc.kill()


def own_dir(path: Path, uid: int) -> None:
    """Make ``path`` the uid's alone: created if missing, owned by it, mode 0700."""
    path.mkdir(mode=0o700, exist_ok=True)
    os.chown(path, uid, uid)
    os.chmod(path, 0o700)
