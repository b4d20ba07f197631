"""What the mesh's lock-down costs on the hot path, measured in isolation (interleaved runs).

1. NATS with auth (``tangram.auth`` permissions, per-role users) against NATS without: CPU of
   nats-server and of this process per request/reply through a trivial responder.
2. The process backend running each trajectory as its own uid (through ``tangram-dropuid``,
   and through util-linux's ``setpriv`` as before it) against running actions as this user:
   CPU (this process and its children) per ``true`` action.

    python -m bench.auth_cost [--requests 20000] [--actions 400] [--rounds 3]

Writes bench/results/auth_cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from services.cpu_manager.backend_api import ExecRequest
from services.cpu_manager.process import users
from services.cpu_manager.process.backend import ProcessBackend, ProcessConfig
from tangram import subjects
from tangram.auth import CLIENT, GATEWAY, Keyring, Principal
from tangram.bus import Bus
from tangram.contract import GetResult
from tangram.embedded import EmbeddedNats
from tangram.errors import NotFound

IN_FLIGHT = 64


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _self_cpu_s(children: bool = False) -> float:
    who = resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


async def nats_point(auth_on: bool, requests: int, root: Path) -> dict[str, Any]:
    """Requests through a trivial responder: µs of CPU per request (server, this process)."""
    ring = Keyring(root)
    gateway, client = Principal(GATEWAY), Principal(CLIENT, "bench")
    conf = ring.server_config([gateway, client]) if auth_on else None
    server = await asyncio.to_thread(EmbeddedNats(root / "nats", config=conf).start)
    try:
        creds = (ring.path(gateway), ring.path(client)) if auth_on else (None, None)
        serving = await Bus.connect(server.url, "bench-gateway", creds=creds[0])
        asking = await Bus.connect(server.url, "bench-client", creds=creds[1])

        async def answer(req: Any, msg: Any) -> None:
            raise NotFound("bench")

        serving.serve(subjects.GATEWAY_CLIENTS, answer)  # where clients ask
        await serving.start()
        sem = asyncio.Semaphore(IN_FLIGHT)
        asked = subjects.gateway_of("bench")  # the client credential's own subject

        async def one(i: int) -> None:
            async with sem:
                try:
                    await asyncio.wait_for(asking.request(asked, GetResult(action_id=str(i))), 10)
                except NotFound:
                    pass

        assert server.proc is not None
        s0, p0, t0 = _proc_cpu_s(server.proc.pid), _self_cpu_s(), time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        s1, p1, t1 = _proc_cpu_s(server.proc.pid), _self_cpu_s(), time.perf_counter()
        await asking.close()
        await serving.close()
    finally:
        await asyncio.to_thread(server.stop)
    return {
        "auth": auth_on,
        "server_us_per_req": round(1e6 * (s1 - s0) / requests, 1),
        "python_us_per_req": round(1e6 * (p1 - p0) / requests, 1),
        "req_per_s": round(requests / (t1 - t0)),
    }


async def backend_point(launcher: str, actions: int, base: Path) -> dict[str, Any]:
    """``true`` actions over 32 trajectories: ms of CPU per action (agent + children), run as
    this user (``launcher`` "") or as each trajectory's uid through "tangram-dropuid" or
    "setpriv"."""
    own_uids = bool(launcher)
    os.mkdir(base)
    os.chmod(base, 0o711 if own_uids else 0o700)  # closed: the backend falls back to our user
    b = ProcessBackend(ProcessConfig(root=base / "envs", incarnation="bench"))
    await b.start()
    assert b.run_as.per_trajectory == own_uids, b.run_as
    if launcher == "setpriv":
        assert users.SETPRIV is not None, "no setpriv here"
        b.run_as = dataclasses.replace(b.run_as, launcher=users.SETPRIV)
    elif own_uids:
        assert "tangram-dropuid" in b.run_as.launcher, b.run_as
    cores = tuple(sorted(os.sched_getaffinity(0)))[:1]
    try:
        s0, c0, t0 = _self_cpu_s(), _self_cpu_s(children=True), time.perf_counter()
        for i in range(actions):
            req = ExecRequest(f"a{i}", f"t{i % 32}", ("true",), cores, 10.0, 4096)
            out = await b.run(req)
            assert out.exit_code == 0, out
        s1, c1, t1 = _self_cpu_s(), _self_cpu_s(children=True), time.perf_counter()
    finally:
        await b.close()
    return {
        "own_uids": own_uids,
        "launcher": launcher or None,
        "agent_ms_per_action": round(1e3 * (s1 - s0) / actions, 3),
        "children_ms_per_action": round(1e3 * (c1 - c0) / actions, 3),
        "wall_ms_per_action": round(1e3 * (t1 - t0) / actions, 3),
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="tgb-", dir="/tmp"))
    os.chmod(tmp, 0o711)
    rows: list[dict[str, Any]] = []
    try:
        for r in range(args.rounds):  # interleaved: the machine's drift hits every variant
            for on in (False, True):
                rows.append(await nats_point(on, args.requests, tmp / f"n{r}{on}"))
                print(json.dumps(rows[-1]))
            if os.geteuid() == 0:
                for launcher in ("", "tangram-dropuid", "setpriv"):
                    where = tmp / f"b{r}{launcher}"
                    rows.append(await backend_point(launcher, args.actions, where))
                    print(json.dumps(rows[-1]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "what": __doc__.split("\n\n")[0],
        "machine": {"cores": os.cpu_count(), "root": os.geteuid() == 0},
        "rounds": rows,
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--actions", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "auth_cost.json"))
    args = ap.parse_args()
    found = asyncio.run(main(args))
    Path(args.out).write_text(json.dumps(found, indent=1) + "\n")
    print(f"wrote {args.out}")
