"""A program that cannot be started is the action's own failure, reported as a shell does.

Both backends map a failed ``exec`` the same way: not found (``ENOENT``, ``ENOTDIR``) exits
127 with ``PROGRAM: command not found``; found but not executable (``EACCES``, ``EPERM``,
``ENOEXEC``, ``EISDIR``) exits 126 with ``PROGRAM: <strerror>``, e.g. ``Permission denied``.
Any other errno is the node's failure, not the action's (the caller decides which kind).
"""

from __future__ import annotations

import errno
import os
import time

from services.cpu_manager.backend_api import ExecOutcome

NOT_FOUND = frozenset({errno.ENOENT, errno.ENOTDIR})
NOT_EXECUTABLE = frozenset({errno.EACCES, errno.EPERM, errno.ENOEXEC, errno.EISDIR})
# What container runtimes (runc, crun) say instead of an errno when `docker exec` cannot start
# a program, and the errno each phrase means.
RUNTIME_PHRASES = (
    ("executable file not found", errno.ENOENT),
    ("no such file or directory", errno.ENOENT),
    ("not a directory", errno.ENOTDIR),
    ("permission denied", errno.EACCES),
    ("exec format error", errno.ENOEXEC),
    ("is a directory", errno.EISDIR),
)


def exit_status(err: int) -> tuple[int, str] | None:
    """(exit code, why) for a failed exec with errno ``err``; None if it is not the action's."""
    if err in NOT_FOUND:
        return 127, "command not found"
    if err in NOT_EXECUTABLE:
        return 126, os.strerror(err)
    return None


def spawn_failed(program: str, err: int, started: float) -> ExecOutcome | None:
    """The outcome of an action whose program could not be executed, or None if ``err`` says
    the node failed rather than the action."""
    status = exit_status(err)
    if status is None:
        return None
    code, why = status
    line = f"{program}: {why}\n".encode(errors="replace")
    return ExecOutcome(code, b"", line, False, False, started, time.time())


def runtime_errno(message: str) -> int | None:
    """The errno a container runtime's exec error message stands for, if it names one."""
    text = message.lower()
    return next((err for phrase, err in RUNTIME_PHRASES if phrase in text), None)
