"""The process-wide connection to the mesh that framework code loaded by import path uses.

A framework calls an adapter from its own event loop (verl's agent loop, slime's rollout) or
from threads (SkyRL's ``step``, rLLM's sandbox, verl's sync reward): an async
:class:`~tangram.Client` is kept per event loop, one :class:`~tangram.SyncClient` per
process. Both find the mesh as ``Client.connect()`` does (``TANGRAM_NATS_URL``, the live
``mesh.json``, port 4222)."""

from __future__ import annotations

import asyncio
import threading
import weakref

from tangram import discovery
from tangram.client import Client, SyncClient
from tangram.errors import Unavailable

_async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Future[Client]] = (
    weakref.WeakKeyDictionary()
)
_sync: list[SyncClient] = []
_sync_lock = threading.Lock()


async def shared_client() -> Client:
    """This event loop's client, connected on first use (concurrent first calls share it)."""
    loop = asyncio.get_running_loop()
    fut = _async.get(loop)
    if fut is None:
        fut = _async[loop] = loop.create_future()
        try:
            fut.set_result(await Client.connect())
        except Exception as exc:
            del _async[loop]  # the next call tries again
            fut.set_exception(exc)
            fut.exception()  # callers waiting on it see it; nobody else needs to
            raise
        except BaseException:
            del _async[loop]
            fut.cancel()
            raise
    return await asyncio.shield(fut)


def shared_sync_client() -> SyncClient:
    """This process's blocking client, connected on first use."""
    with _sync_lock:
        if not _sync:
            _sync.append(SyncClient.connect())
        return _sync[0]


async def close_shared() -> None:
    """Close this loop's client (the next use connects again)."""
    fut = _async.pop(asyncio.get_running_loop(), None)
    if fut is not None and fut.done() and fut.exception() is None:
        await fut.result().close()


def close_shared_sync() -> None:
    """Close this process's blocking client (the next use connects again)."""
    with _sync_lock:
        while _sync:
            _sync.pop().close()


def reward_front_url() -> str:
    """The reward front's URL, from the live ``mesh.json`` that ``tangram up`` wrote."""
    path = discovery.default_state_dir() / discovery.MESH_FILE
    url = (discovery.read_mesh(path) or {}).get("reward_front_url")
    if not isinstance(url, str) or not url:
        raise Unavailable(f"no reward front in {path}: is `tangram up` running there?")
    return url
