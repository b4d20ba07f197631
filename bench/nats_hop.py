"""The floor under every hop of the mesh: a bare nats-py request/reply between two processes
through an embedded nats-server, back to back and with the callers idle in between (as at a
few actions a second), so the mesh's own overhead can be read against what the machine gives;
then the same round trip through the mesh's own bus (``tangram.bus``) with and without a
stored trace (what a traced hop costs: both ends record a span, the context rides in headers).

    python -m bench.nats_hop [--requests 300]

Prints JSON (round trip p50/p90 in microseconds per gap between requests); writes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nats
import uvloop

from tangram import telemetry
from tangram.bus import Bus
from tangram.contract import Done, GetResult
from tangram.embedded import EmbeddedNats
from tangram.subjects import Endpoint

GAPS_S = (0.0, 0.002, 0.02)
SUBJECT = "bench.hop"


async def responder(url: str) -> None:
    """The other process: answers every request with its own payload."""
    nc = await nats.connect(url)

    async def echo(msg: nats.aio.msg.Msg) -> None:
        await msg.respond(msg.data)

    await nc.subscribe(SUBJECT, cb=echo)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()


async def measure(url: str, requests: int) -> dict[str, dict[str, float]]:
    nc = await nats.connect(url)
    out = {}
    for gap in GAPS_S:
        rtts = []
        for _ in range(requests):
            t0 = time.perf_counter()
            await nc.request(SUBJECT, b"x" * 200, timeout=2)
            rtts.append((time.perf_counter() - t0) * 1e6)
            await asyncio.sleep(gap)
        q = statistics.quantiles(rtts, n=10)
        out[f"gap_{gap * 1000:g}ms"] = {"p50_us": round(q[4]), "p90_us": round(q[8])}
    await nc.close()
    return out


async def traced_hop(url: str, requests: int) -> dict[str, dict[str, float]]:
    """Round trips through ``tangram.bus`` in this process, plain and traced, interleaved."""
    telemetry.setup("bench-hop", None, traces_per_s=1e9)  # spans stored, every one traced
    endpoint: Endpoint[GetResult, Done] = Endpoint("bench.bus-hop", GetResult, Done)
    asker, server = await Bus.connect(url, "asker"), await Bus.connect(url, "server")

    async def done(req: GetResult, msg: object) -> Done:
        return Done()

    server.serve(endpoint, done)
    await server.start()
    rtts: dict[str, list[float]] = {"plain": [], "traced": []}
    for i in range(2 * requests):
        kind = "traced" if i % 2 else "plain"
        t0 = time.perf_counter()
        if kind == "traced":
            with telemetry.tracer().start_as_current_span("bench.root"):
                await asker.request(endpoint, GetResult(action_id="x"))
        else:
            await asker.request(endpoint, GetResult(action_id="x"))
        rtts[kind].append((time.perf_counter() - t0) * 1e6)
    await asker.close()
    await server.close()
    return {k: {"p50_us": round(statistics.median(v))} for k, v in rtts.items()}


async def main(requests: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="tangram-hop-") as tmp:
        server = EmbeddedNats(Path(tmp)).start()
        other = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.nats_hop", "--responder", server.url,
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            assert other.stdout is not None
            await asyncio.wait_for(other.stdout.readline(), 30)
            bare = await measure(server.url, requests)
            return {"round_trip": bare, "bus_round_trip": await traced_hop(server.url, requests)}
        finally:
            other.terminate()
            await other.wait()
            server.stop()


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--responder", metavar="URL", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.responder:
        uvloop.run(responder(args.responder))
    else:
        print(json.dumps(uvloop.run(main(args.requests)), indent=2))


if __name__ == "__main__":
    cli()
