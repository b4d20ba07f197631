"""The in-container executor: the entrypoint of every Docker environment (issue 3, §5.2).

It replaces one ``docker exec`` per action by a request on a unix socket that lives in a
bind-mounted directory the node agent can reach. Standard library only: it runs with whatever
``python3`` the image (or a read-only bind mount of the host's) provides.

Wire: every frame is a 4-byte big-endian length and a payload. The agent opens one connection
per request and sends one JSON frame:

- ``{"op": "ping"}`` -> one JSON frame ``{"ok": true, "pid": ...}``
- ``{"op": "run", "argv": [...], "env": {...}, "cwd": "/work", "timeout_s": 5, "cap": 65536}``
  -> a JSON header frame, then the stdout frame, then the stderr frame. While the command runs,
  any byte from the agent kills it (``killed``); closing the connection kills it and no reply
  is sent. The command runs in its own session (process group); on timeout, kill or exit the
  whole group is SIGKILLed, so nothing it started outlives the action. The header carries
  ``oom_kills``, the kernel's OOM kills in the container during the command (None where the
  container's memory cgroup is not readable), and, when the command could not be started at
  all, ``spawn_errno`` (and ``spawn_filename``, ``spawn_error``) instead of an exit status.

As PID 1 the executor also reaps orphans: one reaper thread owns every ``waitpid``.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

HEADER = struct.Struct(">I")
MAX_REQUEST = 1 << 20
READ_CHUNK = 1 << 16
DRAIN_GRACE_S = 0.2
# The container's own memory cgroup as it sees it: v2 (private cgroup namespace), then v1.
OOM_COUNTERS = ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control")
BASE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/work"}


def encode_frame(payload: bytes) -> bytes:
    """Length-prefix ``payload``."""
    return HEADER.pack(len(payload)) + payload


def encode_json(obj: object) -> bytes:
    """One JSON frame."""
    return encode_frame(json.dumps(obj, separators=(",", ":")).encode())


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly ``n`` bytes or raise ``EOFError``."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("peer closed")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket, limit: int = MAX_REQUEST) -> bytes:
    """Read one frame (blocking)."""
    (size,) = HEADER.unpack(recv_exact(sock, HEADER.size))
    if size > limit:
        raise ValueError(f"frame of {size} bytes exceeds {limit}")
    return recv_exact(sock, size)


class Reaper:
    """The only caller of ``waitpid``: hands exit statuses to their spawner, drops orphans."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._waiters: dict[int, Callable[[int], None]] = {}
        self._generation = 0

    def spawn(
        self, start: Callable[[], subprocess.Popen[bytes]], on_exit: Callable[[int], None]
    ) -> subprocess.Popen[bytes]:
        """Start a child and register ``on_exit`` before the reaper can see it exit."""
        with self._cv:
            proc = start()
            self._waiters[proc.pid] = on_exit
            self._generation += 1
            self._cv.notify_all()
        return proc

    def run(self) -> None:
        """Reap forever (daemon thread)."""
        while True:
            with self._cv:
                seen = self._generation
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                with self._cv:
                    while self._generation == seen:
                        self._cv.wait()
                continue
            with self._cv:
                on_exit = self._waiters.pop(pid, None)
            if on_exit is not None:
                on_exit(status)


class Action:
    """One running command: pipes, deadline, caps, and how it ended."""

    def __init__(self, req: dict[str, Any], conn: socket.socket, reaper: Reaper) -> None:
        self.conn = conn
        self.cap = max(0, int(req.get("cap", 1 << 20)))
        self.deadline = time.monotonic() + float(req.get("timeout_s", 60))
        self.out = {"stdout": bytearray(), "stderr": bytearray()}
        self.truncated = {"stdout": False, "stderr": False}
        self.status: int | None = None
        self.timed_out = self.killed = self.abandoned = False
        self.wake_r, self.wake_w = os.pipe()
        self.started_at = time.time()
        self.oom_kills_before = oom_kills()
        env = dict(BASE_ENV)
        env.update({str(k): str(v) for k, v in (req.get("env") or {}).items()})
        argv = [str(a) for a in req["argv"]]
        cwd = str(req.get("cwd") or "/")
        try:
            self.proc = reaper.spawn(lambda: _popen(argv, env, cwd), self._on_exit)
        except OSError:
            os.close(self.wake_r)
            os.close(self.wake_w)
            raise
        _raise_oom_score(self.proc.pid)

    def _on_exit(self, status: int) -> None:
        self.status = status
        os.write(self.wake_w, b"x")

    def kill_group(self) -> None:
        """SIGKILL the command's whole process group (no-op once it is gone)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self) -> None:
        """Pump output, watch the agent and the deadline until the command is done."""
        sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        assert self.proc.stderr is not None
        sel.register(self.proc.stdout, selectors.EVENT_READ, "stdout")
        sel.register(self.proc.stderr, selectors.EVENT_READ, "stderr")
        sel.register(self.conn, selectors.EVENT_READ, "agent")
        sel.register(self.wake_r, selectors.EVENT_READ, "exit")
        pipes_open = 2
        drain_until: float | None = None
        try:
            while pipes_open or self.status is None:
                now = time.monotonic()
                limit = drain_until if drain_until is not None else self.deadline
                if now >= limit:
                    if drain_until is not None:
                        break  # something that escaped the group still holds a pipe
                    self.timed_out = True
                    self.kill_group()
                    self.deadline = float("inf")
                    continue
                for key, _ in sel.select(min(limit - now, 3600)):
                    pipes_open -= self._on_event(sel, key)
                if self.status is not None and drain_until is None:
                    self.kill_group()
                    drain_until = time.monotonic() + DRAIN_GRACE_S
        finally:
            sel.close()
            for fd in (self.wake_r, self.wake_w):
                os.close(fd)
            self.proc.stdout.close()
            self.proc.stderr.close()
            self.proc.returncode = self.status if self.status is not None else -1

    def _on_event(self, sel: selectors.BaseSelector, key: selectors.SelectorKey) -> int:
        name = key.data
        if name == "exit":
            os.read(self.wake_r, 16)
            return 0
        if name == "agent":
            self.abandoned = not self.conn.recv(16)
            sel.unregister(self.conn)
            self.killed = True
            self.kill_group()
            return 0
        chunk = os.read(key.fd, READ_CHUNK)
        if not chunk:
            sel.unregister(key.fileobj)
            return 1
        room = self.cap - len(self.out[name])
        if len(chunk) > room:
            self.truncated[name] = True
        self.out[name] += chunk[: max(room, 0)]
        return 0

    def header(self) -> dict[str, Any]:
        """The reply header: how the command ended."""
        status = self.status if self.status is not None else 0
        exited = os.WIFEXITED(status)
        return {
            "ok": True,
            "exit_code": os.WEXITSTATUS(status) if exited else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "timed_out": self.timed_out,
            "killed": self.killed,
            "stdout_truncated": self.truncated["stdout"],
            "stderr_truncated": self.truncated["stderr"],
            "started_at": self.started_at,
            "finished_at": time.time(),
            "oom_kills": _delta(self.oom_kills_before, oom_kills()),
        }


def _popen(argv: list[str], env: dict[str, str], cwd: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=cwd,
        start_new_session=True,
        close_fds=True,
    )


def _raise_oom_score(pid: int) -> None:
    # The command, not the executor, should be the OOM killer's victim: raising is unprivileged.
    try:
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def oom_kills() -> int | None:
    """How many processes the kernel has OOM-killed in this container's memory cgroup (None
    where no counter is readable). The kernel counts a kill before it sends the SIGKILL, so a
    count read after the command's exit includes the command's own kill: no race."""
    for path in OOM_COUNTERS:
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    return None


def _delta(before: int | None, after: int | None) -> int | None:
    return after - before if before is not None and after is not None else None


def _spawn_failure(exc: OSError) -> dict[str, Any]:
    """The command could not be started: the errno says why; the agent maps it to an exit
    status (its ``spawn_failure`` module), so that every backend reports it alike."""
    now = time.time()
    return {
        "ok": True,
        "exit_code": None,
        "signal": None,
        "timed_out": False,
        "killed": False,
        "stdout_truncated": False,
        "stderr_truncated": False,
        "started_at": now,
        "finished_at": now,
        "spawn_errno": exc.errno,
        "spawn_filename": None if exc.filename is None else os.fsdecode(exc.filename),
        "spawn_error": str(exc),
    }


def handle(conn: socket.socket, reaper: Reaper) -> None:
    """Serve one connection: one request, one reply."""
    with conn:
        try:
            req = json.loads(recv_frame(conn))
        except (EOFError, ValueError, OSError):
            return
        op = req.get("op")
        if op == "ping":
            conn.sendall(encode_json({"ok": True, "pid": os.getpid()}))
            return
        if op != "run" or not isinstance(req.get("argv"), list) or not req["argv"]:
            conn.sendall(encode_json({"ok": False, "error": f"bad request: op={op!r}"}))
            return
        try:
            action = Action(req, conn, reaper)
        except OSError as exc:
            reply = encode_json(_spawn_failure(exc)) + encode_frame(b"") + encode_frame(b"")
            conn.sendall(reply)
            return
        action.wait()
        if action.abandoned:
            return
        out, err = (bytes(action.out[name]) for name in ("stdout", "stderr"))
        reply = encode_json(action.header()) + encode_frame(out) + encode_frame(err)
        try:
            conn.sendall(reply)
        except OSError:
            pass


def serve(path: str) -> None:
    """Listen on ``path`` forever."""
    reaper = Reaper()
    threading.Thread(target=reaper.run, name="reaper", daemon=True).start()
    if os.path.exists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.chmod(path + ".tmp", 0o600)
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the socket appears only once it accepts
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=handle, args=(conn, reaper), daemon=True).start()


def main(argv: list[str]) -> int:
    """Entry point: ``python3 executor.py SOCKET_PATH``."""
    if len(argv) != 2:
        sys.stderr.write("usage: executor.py SOCKET_PATH\n")
        return 2
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # PID 1 ignores SIGTERM otherwise
    serve(argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
