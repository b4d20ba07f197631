"""The bus's behaviours, run on both transports: the in-memory bus and a real nats-server.

One suite, two brokers (as faststream tests its fake broker): whatever a service-shell test
learns on the memory bus holds on NATS.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import msgspec
import pytest
from nats.aio.msg import Msg

from tangram.bus import MAX_NESTING, BaseBus, Bus
from tangram.contract import Ack, Done, ErrorReply, GetResult, NodeCommand, Reconcile, codec
from tangram.discovery import free_port
from tangram.embedded import EmbeddedNats
from tangram.errors import Busy, NotFound, RemoteError, Unavailable
from tangram.membus import MemoryBroker, matches
from tangram.subjects import Endpoint, GatewayAnswer

from ..support import eventually

Connect = Callable[[str], Awaitable[BaseBus]]
GatewayLike = Endpoint[GetResult, GatewayAnswer]


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = EmbeddedNats(tmp_path_factory.mktemp("nats")).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(params=["memory", "nats"])
async def connect(request: pytest.FixtureRequest) -> AsyncIterator[Connect]:
    """``await connect(name)``: a bus on this test's broker (closed after the test)."""
    opened: list[BaseBus] = []
    broker = MemoryBroker()
    url = request.getfixturevalue("nats_url") if request.param == "nats" else ""

    async def connect(name: str) -> BaseBus:
        if request.param == "memory":
            bus: BaseBus = broker.connect(name)
        else:
            bus = await Bus.connect(url, name)
        opened.append(bus)
        return bus

    try:
        yield connect
    finally:
        for bus in opened:
            await bus.close()


@pytest.fixture
def endpoint() -> GatewayLike:
    return Endpoint[GetResult, GatewayAnswer](
        f"test.{uuid.uuid4().hex[:8]}.gw", GetResult, GatewayAnswer
    )


async def answer(req: GetResult, msg: Msg) -> GatewayAnswer:
    if req.action_id == "missing":
        raise NotFound(f"no action {req.action_id!r}")
    if req.action_id == "bug":
        raise ZeroDivisionError
    return Done()


async def serving(connect: Connect, endpoint: GatewayLike, **kw: object) -> BaseBus:
    server = await connect("server")
    server.serve(endpoint, answer, **kw)  # type: ignore[arg-type]
    await server.start()
    return server


async def test_a_typed_request_gets_its_typed_reply(connect: Connect, endpoint: GatewayLike):
    await serving(connect, endpoint)
    client = await connect("client")
    assert await client.request(endpoint, GetResult(action_id="a"), timeout=5) == Done()


async def test_handler_errors_become_typed_errors(connect: Connect, endpoint: GatewayLike):
    await serving(connect, endpoint)
    client = await connect("client")
    with pytest.raises(NotFound, match="missing"):
        await client.request(endpoint, GetResult(action_id="missing"), timeout=5)
    with pytest.raises(RemoteError, match="internal error") as bug:
        await client.request(endpoint, GetResult(action_id="bug"), timeout=5)
    assert bug.value.code == "internal"
    assert await client.request(endpoint, GetResult(action_id="a"), timeout=5) == Done()


DEEP = b"\x83\xa4type\xaaget_result\xa9action_id\xa1x\xa2zz" + b"\x91" * 1000 + b"\x01"
UNDECODABLE = [
    (b"\xc1 not msgpack", "malformed"),
    (msgspec.msgpack.encode({"action_id": 5}), "action_id"),
    (DEEP, f"nested deeper than {MAX_NESTING}"),
    (b"\x91" * (MAX_NESTING + 1) + b"\x01", f"nested deeper than {MAX_NESTING}"),
    (b"\x00" * (600 * 1024), "exceeds"),
]


@pytest.mark.parametrize(("payload", "names"), UNDECODABLE)
async def test_every_undecodable_request_gets_an_invalid_request_reply(
    connect: Connect, endpoint: GatewayLike, payload: bytes, names: str
):
    server = await serving(connect, endpoint)
    client = await connect("client")
    err = codec.decode(await client._ask(endpoint.subject, payload, None, timeout=5), ErrorReply)
    assert err.code == "invalid_request"
    assert names in err.message
    assert await client.request(endpoint, GetResult(action_id="a"), timeout=5) == Done()
    assert server._servers[0].served >= 2


async def test_an_undecodable_reply_is_a_typed_error(connect: Connect, endpoint: GatewayLike):
    wrong = Endpoint[GetResult, Ack](endpoint.subject, GetResult, Ack)  # the server answers Done
    await serving(connect, endpoint)
    client = await connect("client")
    with pytest.raises(RemoteError, match="undecodable reply") as exc:
        await client.request(wrong, GetResult(action_id="a"), timeout=5)
    assert exc.value.code == "invalid_reply"


async def test_no_responder_and_timeout_are_unavailable(connect: Connect, endpoint: GatewayLike):
    client = await connect("client")
    with pytest.raises(Unavailable):
        await client.request(endpoint, GetResult(action_id="a"), timeout=5)
    silent = await connect("silent")
    release = asyncio.Event()

    async def never(req: GetResult, msg: Msg) -> GatewayAnswer:
        await release.wait()
        return Done()

    silent.serve(endpoint, never)
    await silent.start()
    with pytest.raises(Unavailable, match="no reply"):
        await client.request(endpoint, GetResult(action_id="a"), timeout=0.2)
    release.set()


async def test_a_queue_group_gets_each_message_once(connect: Connect):
    subject = f"test.{uuid.uuid4().hex[:8]}.nodes"
    grouped = Endpoint[NodeCommand, Ack](subject, NodeCommand, Ack, queue="q")
    everyone = Endpoint[NodeCommand, Ack](subject, NodeCommand, Ack)
    got: dict[str, list[int]] = {"a": [], "b": [], "all": []}

    def recorder(name: str) -> Callable[[NodeCommand, Msg], Awaitable[None]]:
        async def record(cmd: NodeCommand, msg: Msg) -> None:
            got[name].append(cmd.epoch)

        return record

    for name, ep in (("a", grouped), ("b", grouped), ("all", everyone)):
        bus = await connect(name)
        bus.serve(ep, recorder(name))
        await bus.start()
    sender = await connect("sender")
    for epoch in range(20):
        await sender.publish(grouped, Reconcile(epoch=epoch))
    await eventually(lambda: len(got["all"]) == 20, what="every message at the plain subscriber")
    await eventually(lambda: len(got["a"]) + len(got["b"]) == 20, what="the queue group's share")
    assert got["all"] == list(range(20))  # in order
    assert sorted(got["a"] + got["b"]) == list(range(20))  # each once


async def test_overload_is_answered_busy(connect: Connect, endpoint: GatewayLike):
    server = await connect("server")
    release, entered = asyncio.Event(), asyncio.Semaphore(0)

    async def slow(req: GetResult, msg: Msg) -> GatewayAnswer:
        entered.release()
        await release.wait()
        return Done()

    server.serve(endpoint, slow, max_in_flight=2)
    await server.start()
    client = await connect("client")
    first = [
        asyncio.ensure_future(client.request(endpoint, GetResult(action_id=f"{i}"), timeout=5))
        for i in range(2)
    ]
    for _ in range(2):
        await asyncio.wait_for(entered.acquire(), 5)
    with pytest.raises(Busy):
        await client.request(endpoint, GetResult(action_id="third"), timeout=5)
    release.set()
    assert await asyncio.gather(*first) == [Done(), Done()]


async def test_stop_serving_finishes_in_flight_work_then_stops_intake(
    connect: Connect, endpoint: GatewayLike
):
    server = await connect("server")
    entered, release = asyncio.Event(), asyncio.Event()

    async def slow(req: GetResult, msg: Msg) -> GatewayAnswer:
        entered.set()
        await release.wait()
        return Done()

    server.serve(endpoint, slow, max_in_flight=8)
    await server.start()
    client = await connect("client")
    pending = asyncio.ensure_future(client.request(endpoint, GetResult(action_id="a"), timeout=5))
    await asyncio.wait_for(entered.wait(), 5)
    stopping = asyncio.ensure_future(server.stop_serving(grace_s=5))
    release.set()
    await stopping
    assert await pending == Done()
    with pytest.raises(Unavailable):
        await client.request(endpoint, GetResult(action_id="b"), timeout=0.5)


def test_subject_wildcards_match_as_in_nats():
    assert matches("a.*.c", "a.b.c")
    assert not matches("a.*", "a.b.c")
    assert matches("a.>", "a.b.c")
    assert not matches("a.>", "a")
    assert not matches("a.b", "a.b.c")


async def test_a_publish_leaves_before_its_sender_yields(nats_url: str) -> None:
    """A published message is handed to the socket by ``publish`` itself, not left for
    nats-py's flusher task (which runs only after whatever else its sender woke first): a
    nats-py whose internals moved fails here rather than silently adding a hop's latency."""
    sender, receiver = await Bus.connect(nats_url, "sender"), await Bus.connect(nats_url, "rcv")
    got: list[Done] = []
    try:
        sub = await receiver.nc.subscribe("t.through", cb=_collect(got))
        await receiver.nc.flush()
        await sender.publish("t.through", Done())
        assert sender.nc._pending_data_size == 0
        assert sender.nc._pending == []
        await eventually(lambda: got == [Done()], what="the published message received")
        await sub.unsubscribe()
    finally:
        await sender.close()
        await receiver.close()


def _collect(into: list[Done]) -> Callable[[Msg], Awaitable[None]]:
    async def cb(msg: Msg) -> None:
        into.append(codec.decode(msg.data, Done))

    return cb


async def test_a_stalled_broker_leaves_publishes_in_the_bounded_buffer(tmp_path: Path) -> None:
    """A broker that stops reading (stopped here): what is published meanwhile waits in
    nats-py's bounded buffer (replayed if the connection is replaced), not in the socket's
    unbounded one; once the broker reads again every message arrives, in order."""
    server = await asyncio.to_thread(EmbeddedNats(tmp_path / "nats").start)
    assert server.proc is not None
    buses = Buses()
    got: list[int] = []
    try:
        sender, receiver = (
            await buses.connect(server.url, "sender"),
            await buses.connect(server.url, "r"),
        )
        await receiver.nc.subscribe("t.stall", cb=_numbers(got))
        await receiver.nc.flush()
        os.kill(server.proc.pid, signal.SIGSTOP)
        for n in range(STALLED_MESSAGES):  # 15 MB: more than the kernel's buffers take
            await sender.nc.publish("t.stall", n.to_bytes(4, "big") + bytes(60_000))
            await asyncio.sleep(0)  # a yield: nats-py's flusher writes between publishes
        socket = sender.nc._transport._io_writer.transport  # type: ignore[union-attr]
        assert socket.get_write_buffer_size() < 1_000_000
        assert sender.nc._pending_data_size > 0
        os.kill(server.proc.pid, signal.SIGCONT)
        await eventually(lambda: len(got) == STALLED_MESSAGES, what="every message received")
        assert got == list(range(STALLED_MESSAGES))
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        await buses.close()
        await asyncio.to_thread(server.stop)


STALLED_MESSAGES = 256


async def test_publishes_while_the_broker_restarts_arrive_in_order(tmp_path: Path) -> None:
    """Published before, during (buffered by nats-py) and after a broker restart: each
    arrives once, in order, at a subscriber of the same connection (its subscription is sent
    again before what was buffered)."""
    first = await asyncio.to_thread(EmbeddedNats(tmp_path / "nats").start)
    buses = Buses()
    got: list[int] = []
    again: EmbeddedNats | None = None
    try:
        bus = await buses.connect(first.url, "sender")
        await bus.nc.subscribe("t.restart", cb=_numbers(got))
        for n in range(3):
            await bus.nc.publish("t.restart", n.to_bytes(4, "big"))
        await eventually(lambda: got == [0, 1, 2], what="the first three received")
        await asyncio.to_thread(first.stop)
        await eventually(lambda: bus.nc.is_reconnecting, what="the loss noticed")
        for n in range(3, 6):
            await bus.nc.publish("t.restart", n.to_bytes(4, "big"))
        again = await asyncio.to_thread(EmbeddedNats(tmp_path / "nats", first.port).start)
        await eventually(lambda: bus.nc.is_connected, what="reconnected")
        for n in range(6, 9):
            await bus.nc.publish("t.restart", n.to_bytes(4, "big"))
        await eventually(lambda: len(got) >= 9, what="all nine received")
        assert got == list(range(9))
    finally:
        await buses.close()
        await asyncio.to_thread(again.stop if again else first.stop)


@pytest.mark.filterwarnings("ignore:parameter 'timeout':DeprecationWarning")  # nats-py's
async def test_a_publish_over_a_websocket_leaves_at_once(tmp_path: Path) -> None:
    """On a websocket nothing leaves until nats-py drains it: a publish is not written past
    its flusher there (it would then wait for the next PING, the broker's first after ~2 s)."""
    port = free_port()
    conf = tmp_path / "ws.conf"
    conf.write_text(f"websocket {{\n  host: 127.0.0.1\n  port: {port}\n  no_tls: true\n}}\n")
    server = await asyncio.to_thread(EmbeddedNats(tmp_path / "nats", config=conf).start)
    buses = Buses()
    got: list[Done] = []
    try:
        receiver = await buses.connect(server.url, "receiver")
        sender = await buses.connect(f"ws://127.0.0.1:{port}", "sender")
        await receiver.nc.subscribe("t.ws", cb=_collect(got))
        await receiver.nc.flush()
        await sender.publish("t.ws", Done())
        await eventually(lambda: got == [Done()], what="the message received", timeout_s=1.0)
    finally:
        await buses.close()
        await asyncio.to_thread(server.stop)


async def test_a_flush_is_answered_after_the_subscriptions_made_before_it(nats_url: str) -> None:
    """``flush`` (``Bus.start``'s: then the broker knows every subscription) sends its PING
    behind what was queued before it; nats-py wrote the PING at once, ahead of a SUB still
    waiting for its flusher, so the PONG could come back before the broker had the SUB."""
    bus = await Bus.connect(nats_url, "flusher")
    try:
        socket = bus.nc._transport._io_writer.transport  # type: ignore[union-attr]
        wire: list[bytes] = []
        write = socket.write

        def tap(data: bytes) -> None:
            wire.append(bytes(data))
            write(data)

        socket.write = tap
        socket.writelines = lambda lines: tap(b"".join(lines))
        await bus.nc.subscribe("t.flushed")
        await bus.nc.flush()
        sent = b"".join(wire)
        assert sent.index(b"SUB t.flushed ") < sent.index(b"PING\r\n"), sent
    finally:
        await bus.close()


class Buses:
    """Buses connected by a test, each closed at its end (even if a later one failed)."""

    def __init__(self) -> None:
        self.opened: list[Bus] = []

    async def connect(self, url: str, name: str) -> Bus:
        self.opened.append(await Bus.connect(url, name))
        return self.opened[-1]

    async def close(self) -> None:
        for bus in self.opened:
            await bus.close()


def _numbers(into: list[int]) -> Callable[[Msg], Awaitable[None]]:
    async def cb(msg: Msg) -> None:
        into.append(int.from_bytes(msg.data[:4], "big"))

    return cb
