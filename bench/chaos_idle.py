"""The idle run of ``bench.chaos --idle SECONDS``: a real mesh left alone, to show that idle
agents are never declared failed (issue 14). The mesh is the chaos bench's (supervised, two
schedulers, credentials per role, two cpu_managers, a quota_manager) plus a gpu_manager (CPU
stand-ins where no GPU answers); it carries nothing but one light action every ``--idle-every``
seconds (0: none). Counted from Postgres's ``health_events`` (every transition the health
monitor made, whichever scheduler led) and the supervisor's log (any process that exited)."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.chaos_rig import ChaosMesh, SupervisorLog, Watch
from tangram import ActionSpec, ExecAction
from tangram.bus import Bus
from tangram.client import Client
from tangram.errors import TangramError
from tangram.launcher import Mesh, MeshOptions

log = logging.getLogger("bench.chaos")
BAD = ("suspect", "fenced", "failed")  # the states an idle agent must never reach


def idle_options(root: Path, base: MeshOptions) -> MeshOptions:
    """The chaos bench's mesh with a gpu_manager too."""
    return dataclasses.replace(base, state_dir=root, gpu_manager=True)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mesh_cpu(mesh: Mesh) -> dict[str, float]:
    """CPU seconds so far of every service process of ``mesh`` (not NATS and Postgres)."""
    return {k: cpu_seconds(p.pid) for k, p in mesh.procs.items() if p.returncode is None}


async def light_actions(client: Client, every_s: float, stop: asyncio.Event) -> list[str]:
    """One ``true`` every ``every_s`` until ``stop``; each one's outcome ('ok' or its error)."""
    outcomes: list[str] = []
    i = 0
    while every_s > 0 and not stop.is_set():
        i += 1
        spec = ActionSpec(
            action_id=f"idle{i}",
            job_id="chaos-idle",
            trajectory_id=f"idle{i}",
            action=ExecAction(command="true"),
            memory_mb=16,
        )
        try:
            result = await client.run(spec, wait_s=60)
            outcomes.append("ok" if result.ok else str(result.error))
            await client.close_env(spec.trajectory_id)
        except TangramError as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)  # the run's pace
    return outcomes


async def agents_seen(w: Watch) -> list[dict[str, Any]]:
    """The agents the leading scheduler knows, with their health and phase."""
    try:
        st = await w.mesh.status(w.bus, timeout=2.0)
    except TangramError:
        return []
    return [{"node": r.node_id, "health": r.health, "phase": r.phase} for r in st.node_rows]


async def run_idle(args: argparse.Namespace, base: MeshOptions) -> dict[str, Any]:
    said = SupervisorLog()
    logging.getLogger("tangram.supervisor").addHandler(said)
    logging.getLogger("tangram.supervisor").setLevel(logging.INFO)
    root = Path(tempfile.mkdtemp(prefix="tangram-idle-"))
    log.warning("idle run of %.0fs; state and logs under %s", args.idle, root)
    mesh = ChaosMesh(idle_options(root / "mesh", base))
    started = time.time()
    try:
        async with contextlib.AsyncExitStack() as stack:
            await mesh.start()
            bus = await Bus.connect(mesh.nats_url, "bench-idle", creds=mesh.ops_creds)
            stack.push_async_callback(bus.close)
            client = await stack.enter_async_context(
                Client.connect(mesh.nats_url, creds=mesh.client_creds)
            )
            w = Watch(mesh, bus, said)
            before = await agents_seen(w)
            cpu0, t0, load0 = mesh_cpu(mesh), time.time(), os.getloadavg()
            stop = asyncio.Event()
            acting = asyncio.ensure_future(light_actions(client, args.idle_every, stop))
            await asyncio.sleep(args.idle)  # the run itself: nothing but waiting
            stop.set()
            outcomes = await acting
            elapsed, cpu1, load1 = time.time() - t0, mesh_cpu(mesh), os.getloadavg()
            after = await agents_seen(w)
            events = await w.transitions(started)  # every one since the mesh started
            leader, standbys = await w.leader()
            if w.conn is not None:
                await w.conn.close()
    finally:
        await mesh.stop()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return idle_figures(args, base, elapsed, before, after, events, outcomes, said, cpu0, cpu1) | {
        "leader_at_end": leader,
        "standbys_at_end": standbys,
        # the host's 1-minute load average at the start and the end (others share the host)
        "host_load_avg_1m": [round(load0[0], 2), round(load1[0], 2)],
    }


def idle_figures(
    args: argparse.Namespace,
    base: MeshOptions,
    elapsed: float,
    before: list[dict[str, Any]],
    after: list[dict[str, Any]],
    events: list[dict[str, Any]],
    outcomes: list[str],
    said: SupervisorLog,
    cpu0: dict[str, float],
    cpu1: dict[str, float],
) -> dict[str, Any]:
    changes = collections.Counter(e["change"].split("->")[1] for e in events)
    agents = sorted({a["node"] for a in before + after} | {e["node"] for e in events})
    return {
        "seconds": round(elapsed, 1),
        "light_action_every_s": args.idle_every,
        "agents": len([k for k in cpu0 if "_manager" in k]),  # agent processes
        "agent_processes": [k for k in sorted(cpu0) if "_manager" in k],
        "agents_in_status": agents,  # node rows of the status (not the quota agent) or events
        "mesh": f"{base.nodes} cpu_managers (process backend), quota_manager, gpu_manager (CPU"
        " stand-ins), 2 schedulers, secure, supervised, default health bounds",
        "suspect_transitions": changes["suspect"],
        "declared_failed": changes["failed"] + changes["fenced"],
        "health_events": events,
        "health_at_end": after,
        "light_actions": dict(collections.Counter(outcomes)),
        "process_exits": [m for _, m in said.lines if "; restart " in m],
        "mesh_cpu_s_per_min": {
            k: round((cpu1.get(k, 0.0) - v) * 60 / elapsed, 3) for k, v in sorted(cpu0.items())
        },
    }
