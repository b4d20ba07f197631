"""Chaos under load (issue 14): one fault at a time into a mesh as ``tangram up`` runs it.

A real mesh (``tangram.launcher.Mesh``: supervision on, two schedulers, credentials per role,
two cpu_managers and a quota_manager, the process backend) carries a steady open-loop stream of
short shell actions from many trajectories and a trickle of HTTP calls under a quota (to the
project's rate-limited server, in this process). Into it, in turn:

- kill -9 of the gateway, the leading scheduler, a cpu_manager, the quota_manager,
  nats-server and Postgres (each brought back by the launcher's supervisor, none by us);
- SIGSTOP of a cpu_manager past the suspect bound (``--stop-s``), then SIGCONT;
- a partition of the other cpu_manager from NATS for ``--partition-s``: that agent alone
  reaches NATS through a small TCP proxy in this process, and the partition is an iptables
  DROP of both directions on the proxy's port on loopback (packets vanish, connections stay
  open, new ones time out); where iptables cannot be used the proxy stops forwarding instead
  (``partition_method`` in the output says which was used).

Per fault: detection (injection -> the mesh's first reaction: the supervisor seeing a process
exit, the standby leading, a health transition in ``health_events``, or the first ``node_died``
/ ``environment_lost`` result of the victim's work), and serving again (injection -> the first
action submitted after the injection that succeeds; probes of fresh trajectories every 0.25 s).
At the end, every acknowledged action: exactly one terminal state (delivered, recorded in
``actions`` and once among ``action_events``), and how often it ran (each exec appends to a
marker file of its own; each HTTP call is counted by the server under its action id).

    python -m bench.chaos [--rate 20] [--http-rate 4] [--trajectories 32] [--stop-s 4]
                          [--partition-s 10] [--rounds 2] [--faults gateway,scheduler,...]
                          [--into KEY]
    python -m bench.chaos --idle 600 [--idle-every 60]

Writes bench/results/chaos.json; ``--into KEY`` writes the run under KEY of the existing file
instead (its other keys kept), and ``--idle`` writes its run under ``idle`` so (see chaos_idle).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvloop

from bench.chaos_account import account, summary
from bench.chaos_idle import run_idle
from bench.chaos_rig import (
    PARTITIONED,
    WINDOW_S,
    ChaosMesh,
    CountingServer,
    Load,
    SupervisorLog,
    Watch,
)
from tangram import QuotaSpec
from tangram.bus import Bus
from tangram.client import Client
from tangram.launcher import MeshOptions
from tangram.supervisor import RestartPolicy
from tests.ratelimited_server import ServerConfig

OUT = Path(__file__).parent / "results" / "chaos.json"
FAULTS = (
    "gateway",
    "scheduler",
    "cpu_manager",
    "quota_manager",
    "sigstop",
    "nats",
    "postgres",
    "partition",
)
STOPPED = "cpu_manager.0"  # killed, then stopped
SETTLE_S = 60.0
STEADY_S = 3.0  # of undisturbed load before each injection

log = logging.getLogger("bench.chaos")


# --------------------------------------------------------------------------- faults


@dataclass
class Shot:
    """One fault as injected: what was hit, when, and how to undo it (if it is ours to)."""

    name: str
    target: str
    t0: float
    undo_after_s: float = 0.0
    undo: Any = None  # an async callable, run undo_after_s after the injection
    old_epoch: int = 0
    notes: dict[str, Any] = field(default_factory=dict)


def _kill(pid: int) -> float:
    t0 = time.time()
    os.kill(pid, signal.SIGKILL)
    return t0


async def inject(name: str, w: Watch, args: argparse.Namespace) -> Shot:
    mesh = w.mesh
    match name:
        case "gateway" | "cpu_manager" | "quota_manager":
            key = STOPPED if name == "cpu_manager" else name
            return Shot(name, key, _kill(mesh.pid(key)))
        case "scheduler":
            key, _ = await w.leader()
            old = await w.epoch()
            return Shot(name, key, _kill(mesh.pid(key)), old_epoch=old)
        case "nats" | "postgres":
            server = mesh.nats if name == "nats" else mesh.pg
            assert server is not None
            assert server.proc is not None
            key = "nats-server" if name == "nats" else "postgres"
            return Shot(name, key, _kill(server.proc.pid))
        case "sigstop":
            pid = mesh.pid(STOPPED)
            t0 = time.time()
            os.kill(pid, signal.SIGSTOP)
            resume = _resume(pid)
            return Shot(name, STOPPED, t0, args.stop_s, resume, notes={"stopped_s": args.stop_s})
        case "partition":
            part = mesh.partition
            assert part is not None
            t0 = time.time()
            await part.cut()
            notes = {"partitioned_s": args.partition_s, "partition_method": part.method}
            return Shot(name, PARTITIONED, t0, args.partition_s, part.heal, notes=notes)
    raise ValueError(f"unknown fault {name!r}; one of {', '.join(FAULTS)}")


def _resume(pid: int) -> Any:
    async def resume() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)

    return resume


def node_of(key: str) -> str:
    """The node id the agent process ``key`` reports as."""
    if key.startswith("cpu_manager."):
        return f"node{key.partition('.')[2]}"
    from tangram.auth import default_node_id

    return default_node_id(key)


async def detected(shot: Shot, w: Watch, load: Load) -> tuple[float | None, str]:
    """Seconds from the injection to the mesh's first reaction to it, and what that was."""
    deadline = shot.t0 + WINDOW_S
    while time.time() < deadline:
        found = await _reaction(shot, w, load)
        if found is not None:
            return round(found[0] - shot.t0, 3), found[1]
        await asyncio.sleep(0.05)
    return None, "nothing within the window"


async def _reaction(shot: Shot, w: Watch, load: Load) -> tuple[float, str] | None:
    if shot.name in ("gateway", "nats", "postgres"):
        t = w.said.first(shot.target, "killed by", shot.t0)
        return None if t is None else (t, "the supervisor saw it exit")
    if shot.name == "scheduler":
        epoch = await w.epoch()
        return (
            (time.time(), f"the standby leads (epoch {epoch})") if epoch > shot.old_epoch else None
        )
    node = node_of(shot.target)
    seen: list[tuple[float, str]] = []
    for t in await w.transitions(shot.t0):
        if t["node"] == node:
            seen.append((shot.t0 + t["after_s"], f"health {t['change']}: {t['why']}"))
    if shot.name in ("cpu_manager", "quota_manager"):
        lost = [s for s in list(load.sent.values()) if s.lost and s.node in ("", node)]
        lost = [s for s in lost if s.done_at is not None and s.done_at >= shot.t0]
        seen += [
            (s.done_at, f"{s.result.error.kind} result ({s.result.error.message})") for s in lost
        ]  # type: ignore[misc,union-attr]
    return min(seen) if seen else None


async def run_fault(name: str, w: Watch, load: Load, args: argparse.Namespace) -> dict[str, Any]:
    """Inject one fault under the running load; its figures once the mesh has settled again."""
    load.phase = name
    epoch = await w.epoch()  # which scheduler epoch led before: kept, or replaced?
    shot = await inject(name, w, args)
    log.warning("%s: injected into %s", name, shot.target)
    probe = "http" if name == "quota_manager" else "exec"
    detecting = asyncio.ensure_future(detected(shot, w, load))
    serving = asyncio.ensure_future(load.serving_again(shot.t0, probe))
    if shot.undo is not None:
        await asyncio.sleep(max(0.0, shot.t0 + shot.undo_after_s - time.time()))  # the fault
        await shot.undo()
    (detect_s, how), serving_s = await asyncio.gather(detecting, serving)
    settled_s = await settle(w)
    said = w.said
    out = {
        "fault": name,
        "target": shot.target,
        "injected_at": round(shot.t0, 3),
        "detected_s": detect_s,
        "detected_by": how,
        "serving_again_s": None if serving_s is None else round(serving_s, 3),
        "exit_seen_s": _after(said.first(shot.target, "; restart ", shot.t0), shot.t0),
        "restarted_s": _after(said.first(shot.target, "restarted", shot.t0), shot.t0),
        "settled_s": None if settled_s is None else round(settled_s - shot.t0, 3),
        "epochs": [epoch, await w.epoch()],  # leading before the fault, once settled after it
        "health_events": await w.transitions(shot.t0),
        "other_exits": [  # processes that exited because of this fault, not hit by it
            f"+{t - shot.t0:.2f}s {m}"
            for t, m in said.lines
            if t >= shot.t0 and "; restart " in m and not m.startswith(f"{shot.target} ")
        ],
        **shot.notes,
    }
    log.warning(
        "%s: detected %ss (%s), serving again %ss", name, detect_s, how, out["serving_again_s"]
    )
    return out


def _after(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 3)


async def settle(w: Watch) -> float | None:
    """When the mesh was whole again (see Watch.settled), within SETTLE_S; then a steady spell."""
    deadline, why = time.time() + SETTLE_S, ""
    while time.time() < deadline:
        why = await w.unsettled()
        if not why:
            at = time.time()
            await asyncio.sleep(STEADY_S)  # undisturbed load before the next fault
            return at
        await asyncio.sleep(0.1)
    log.error("the mesh did not settle within %.0fs: %s", SETTLE_S, why)
    return None


# --------------------------------------------------------------------------- main


def mesh_options(root: Path) -> MeshOptions:
    """As ``tangram up`` runs it (credentials, supervision, a standby scheduler, default
    health bounds and restart policy), on the process backend, without GPU and web fronts."""
    return MeshOptions(
        state_dir=root,
        nodes=2,
        backend="process",
        fsync=False,  # kill -9 of Postgres loses nothing without fsync; only a host crash would
        quiet=True,
        secure=True,
        schedulers=2,
        supervise=True,
        restart=RestartPolicy(),
        gpu_manager=False,
        dashboard=False,
        reward_front=False,
    )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    said = SupervisorLog()
    logging.getLogger("tangram.supervisor").addHandler(said)
    logging.getLogger("tangram.supervisor").setLevel(logging.INFO)
    root = Path(tempfile.mkdtemp(prefix="tangram-chaos-"))
    log.warning("state and logs under %s", root)
    marks = root / "marks"
    marks.mkdir()
    marks.chmod(0o777)  # actions run as per-trajectory users
    mesh = ChaosMesh(mesh_options(root / "mesh"))
    cfg = ServerConfig(per_second=10_000, concurrency=1_000, latency_s=0.2)
    try:
        async with contextlib.AsyncExitStack() as stack:
            server = await stack.enter_async_context(CountingServer(cfg))
            await mesh.start()
            bus = await Bus.connect(mesh.nats_url, "bench-chaos", creds=mesh.ops_creds)
            stack.push_async_callback(bus.close)
            client = await stack.enter_async_context(
                Client.connect(mesh.nats_url, creds=mesh.client_creds)
            )
            host = server.url.removeprefix("http://")
            await client.set_quota(QuotaSpec("chaos", concurrency=16, hosts=(host,)))
            w = Watch(mesh, bus, said)
            load = Load(client, marks, server, "chaos", args.trajectories)
            stop = asyncio.Event()
            stream = asyncio.ensure_future(load.stream(args.rate, args.http_rate, stop))
            faults: list[dict[str, Any]] = []
            try:
                await settle(w)
                for _ in range(args.rounds):
                    for name in args.faults:
                        if faults:  # the supervisor's backoff starts afresh after stable_s
                            last = faults[-1]["injected_at"]
                            await asyncio.sleep(max(0.0, last + args.spacing_s - time.time()))
                        faults.append(await run_fault(name, w, load, args))
            finally:
                stop.set()
                await stream
            acc = await account(w, load, marks, server, faults)
            if w.conn is not None:
                await w.conn.close()
    finally:
        await mesh.stop()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return {
        "config": {
            "exec_rate_per_s": args.rate,
            "http_rate_per_s": args.http_rate,
            "trajectories": args.trajectories,
            "stop_s": args.stop_s,
            "partition_s": args.partition_s,
            "rounds": args.rounds,
            "spacing_s": args.spacing_s,
            "mesh": "2 cpu_managers (process backend), quota_manager, 2 schedulers, secure,"
            " supervised, default health bounds (heartbeat 1 s, suspect 3 s, probe 2 s)",
            "host": f"{platform.node()} {os.cpu_count()} cpus",
        },
        "notes": {
            "detected_s": "injection -> the mesh's first reaction: the supervisor seeing the "
            "process exit (gateway, nats, postgres), a new epoch answering (scheduler), a health "
            "transition of the node in health_events or the first node_died/environment_lost "
            "result of its work (agents)",
            "serving_again_s": "injection -> the first probe submitted after it that succeeded "
            "(a fresh trajectory every 0.25 s; an HTTP call for the quota_manager)",
            "exit_seen_s / restarted_s": "the launcher's supervisor: the exit noticed, the "
            "process started again",
            "settled_s": "every process up, every agent healthy, a leader and a standby",
        },
        "faults": faults,
        "accounting": acc,
        "summary": summary(faults, acc),
    }


def write(out: Path, result: dict[str, Any], into: str = "") -> None:
    """Write ``result`` as ``out``, or under key ``into`` of it (its other keys kept as they are:
    an idle run or a rerun of some faults adds to the full run's figures)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if into:
        result = (json.loads(out.read_text()) if out.exists() else {}) | {into: result}
    out.write_text(json.dumps(result, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=20.0, help="exec actions per second")
    ap.add_argument("--http-rate", type=float, default=4.0, help="HTTP calls per second")
    ap.add_argument("--trajectories", type=int, default=32)
    ap.add_argument("--stop-s", type=float, default=4.0, help="SIGSTOP length (suspect: 3 s)")
    ap.add_argument("--partition-s", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=2, help="times through the list of faults")
    ap.add_argument("--faults", type=lambda s: s.split(","), default=list(FAULTS))
    ap.add_argument(
        "--spacing-s", type=float, default=0.0, help="at least so long between two injections"
    )
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--keep", action="store_true", help="keep the state dir (logs) afterwards")
    ap.add_argument("--into", default="", help="write under this key of the existing --out")
    ap.add_argument("--idle", type=float, default=0.0, help="an idle run of so many seconds")
    ap.add_argument("--idle-every", type=float, default=60.0, help="idle: one action so often")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    if args.idle > 0:
        into, result = "idle", uvloop.run(run_idle(args, mesh_options(Path("."))))
        shown = {k: v for k, v in result.items() if k != "health_events"}
    else:
        into, result = args.into, uvloop.run(run(args))
        shown = result["summary"]
    write(args.out, result, into)
    print(json.dumps(shown, indent=1))
    print(f"wrote {args.out}" + (f" (key {into})" if into else ""))


if __name__ == "__main__":
    main()
