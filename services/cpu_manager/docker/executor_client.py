"""The node agent's side of the in-container executor protocol (see ``executor.py``), async."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.cpu_manager.docker.executor import HEADER, encode_json

MAX_HEADER = 1 << 16
KILL_BYTE = b"k"
PEERCRED = struct.Struct("3i")  # pid, uid, gid


class ExecutorGone(Exception):
    """The executor could not be reached or dropped the connection: the container is suspect."""


@dataclass(frozen=True, slots=True)
class Reply:
    """The executor's answer to a run request."""

    header: dict[str, Any]
    stdout: bytes
    stderr: bytes


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> bytes:
    try:
        (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
        if size > limit:
            raise ExecutorGone(f"executor sent a {size}-byte frame (limit {limit})")
        return await reader.readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise ExecutorGone("executor closed the connection mid-reply") from exc


async def _connect(
    path: Path, peer_pid: int = 0
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect; with ``peer_pid``, refuse any listener but that process.

    The socket lives in a directory the sandbox can write: it could put a symlink to some
    host socket there. SO_PEERCRED proves we reached the container's own executor.
    """
    try:
        reader, writer = await asyncio.open_unix_connection(str(path))
    except OSError as exc:
        raise ExecutorGone(f"executor socket unreachable: {exc.strerror or exc}") from exc
    if peer_pid and _peer_pid(writer) != peer_pid:
        writer.close()
        raise ExecutorGone(f"{path} is not served by the container's executor (pid {peer_pid})")
    return reader, writer


def _peer_pid(writer: asyncio.StreamWriter) -> int:
    sock = writer.get_extra_info("socket")
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size)
    return int(PEERCRED.unpack(creds)[0])


async def ping(path: Path, peer_pid: int = 0) -> int:
    """Ask the executor for its pid; raises ``ExecutorGone`` if it does not answer."""
    reader, writer = await _connect(path, peer_pid)
    try:
        writer.write(encode_json({"op": "ping"}))
        await writer.drain()
        reply = json.loads(await _read_frame(reader, MAX_HEADER))
        return int(reply["pid"])
    finally:
        writer.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def wait_ready(path: Path, timeout_s: float, peer_pid: int = 0) -> int:
    """Ping until the executor answers (it binds its socket a few ms after the start)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.002
    while True:
        try:
            return await ping(path, peer_pid)
        except ExecutorGone as exc:
            if peer_pid and not _alive(peer_pid):
                raise ExecutorGone(f"the executor (pid {peer_pid}) exited: {exc}") from exc
            if time.monotonic() + delay > deadline:
                raise
        await asyncio.sleep(delay)  # bounded back-off while the container boots
        delay = min(delay * 2, 0.05)


class Call:
    """One run request on its own connection. Closing the connection kills the command."""

    def __init__(self, path: Path, peer_pid: int = 0) -> None:
        self.path = path
        self.peer_pid = peer_pid
        self._writer: asyncio.StreamWriter | None = None
        self.kill_requested = False

    def kill(self) -> None:
        """Ask the executor to kill the command's process group; the reply still comes."""
        self.kill_requested = True
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(KILL_BYTE)

    async def run(
        self, payload: dict[str, Any], cap: int, sent: Callable[[], None] | None = None
    ) -> Reply:
        """Send the request and wait for the reply (the caller bounds the wait); ``sent`` is
        called once the request is written (the executor starts the command on reading it)."""
        reader, self._writer = await _connect(self.path, self.peer_pid)
        try:
            self._writer.write(encode_json(payload))
            if self.kill_requested:
                self._writer.write(KILL_BYTE)
            await self._writer.drain()
            if sent is not None:
                sent()
            header = json.loads(await _read_frame(reader, MAX_HEADER))
            if not header.get("ok"):
                raise ExecutorGone(f"executor refused the request: {header.get('error')}")
            stdout = await _read_frame(reader, cap)
            stderr = await _read_frame(reader, cap)
            return Reply(header, stdout, stderr)
        except ConnectionError as exc:
            raise ExecutorGone(f"executor connection failed: {exc}") from exc
        finally:
            self._writer.close()
