"""The CLI's commands on a running mesh: exec, cancel, close-env, result, status, health.

Each finds the mesh as the client does (``--nats``, ``TANGRAM_NATS_URL``, the live
``mesh.json`` in ``--state-dir``, port 4222) and says in one line what went wrong.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tangram import auth, beats, discovery, subjects
from tangram.bus import Bus
from tangram.client import Client
from tangram.contract import ActionResult, GetResult, NodeRow, SchedulerStatus, StatusQuery
from tangram.errors import NotFound, ResultTimeout, TangramError, Unavailable

NO_WAIT_S = 0.2  # `tangram result` without --wait: one look (the first ask is immediate)

EXEC_HELP = """\
Run one command as an action in a trajectory's own environment (its working directory, which
persists across that trajectory's actions until it is closed), on the cores the scheduler
grants, and print its output. The exit status is the command's; 125 means the mesh could not
run it (the reason is printed). Example: tangram exec --cpus 1-4 -- make -j{dop}"""


def cpus(text: str) -> int | tuple[int, int]:
    """``N`` or ``MIN-MAX`` (an argparse type: a bad value is a one-line usage error)."""
    lo, sep, hi = text.partition("-")
    try:
        got = (int(lo), int(hi)) if sep else int(lo)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a core count: give N or MIN-MAX, e.g. 2 or 1-4"
        ) from None
    if min(got if isinstance(got, tuple) else (got,)) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: core counts start at 1")
    return got


def locate(args: argparse.Namespace) -> str:
    return discovery.find(args.nats, Path(args.state_dir)).url


def print_result(res: ActionResult) -> int:
    """The action's output as its own, then an infrastructure failure in one line."""
    sys.stdout.write(res.stdout)
    sys.stderr.write(res.stderr)
    if res.error is not None and (res.error.infrastructure or res.exit_code is None):
        print(
            f"tangram: {res.status}: {res.error.kind.value}: {res.error.message}", file=sys.stderr
        )
        return 125
    return res.exit_code if res.exit_code is not None else 1


async def cmd_exec(args: argparse.Namespace) -> int:
    if not args.command:
        raise SystemExit("tangram exec: give a command after --")
    command: str | list[str] = args.command[0] if len(args.command) == 1 else args.command
    async with Client.connect(locate(args)) as client:
        action_id = client.new_action_id()
        print(f"tangram: action {action_id}", file=sys.stderr, flush=True)
        res = await client.exec(
            command,
            trajectory_id=args.trajectory,
            job_id=args.job,
            cpus=args.cpus,
            timeout_s=args.timeout,
            action_id=action_id,
        )
    return print_result(res)


async def cmd_cancel(args: argparse.Namespace) -> int:
    async with Client.connect(locate(args)) as client:
        await client.cancel(args.action_id)
    print(f"cancel of {args.action_id} sent; `tangram result {args.action_id}` says how it ended")
    return 0


async def cmd_close_env(args: argparse.Namespace) -> int:
    async with Client.connect(locate(args)) as client:
        await client.close_env(args.trajectory)
    print(f"closed the environment of trajectory {args.trajectory}")
    return 0


async def cmd_result(args: argparse.Namespace) -> int:
    async with Client.connect(locate(args)) as client:
        try:
            res = await client.result(args.action_id, timeout=args.wait or NO_WAIT_S)
        except ResultTimeout:
            print(f"tangram: action {args.action_id} has not finished", file=sys.stderr)
            return 3
    print(f"tangram: action {res.action_id}: {res.status}", file=sys.stderr)
    return print_result(res)


async def scheduler_status(url: str) -> SchedulerStatus:
    bus = await Bus.connect(url, "tangram-status", deadline_s=5.0, creds=auth.ops_creds(url))
    try:
        st = await bus.request(subjects.SCHED_STATUS, StatusQuery(), timeout=3.0)
    finally:
        await bus.close()
    if not isinstance(st, SchedulerStatus):
        raise Unavailable(f"the scheduler answered a status query with {type(st).__name__}")
    return st


async def cmd_status(args: argparse.Namespace) -> int:
    st = await scheduler_status(locate(args))
    print(
        f"scheduler epoch {st.epoch}, policy {st.policy}: {st.nodes} node(s), "
        f"{st.queued} queued, {st.running} running, {st.envs} environment(s)\n"
    )
    table(list(beats.COLUMNS), await _services(locate(args), st))
    nodes = [
        [
            n.node_id,
            f"{n.free_cores}/{n.cores}" if not n.gpus else "-",  # a GPU node's units are GPUs
            f"{n.free_gpus}/{n.gpus}" if n.gpus else "-",
            f"{n.free_memory_mb}/{n.memory_mb}",
            str(n.envs),
            n.health or "?",
            n.phase or ("draining" if n.draining else "?"),
            _ago(n),
        ]
        for n in st.node_rows
    ]
    header = [
        "NODE",
        "FREE CORES",
        "FREE GPUS",
        "FREE MiB",
        "ENVS",
        "HEALTH",
        "PHASE",
        "LAST PROGRESS",
    ]
    table(header, nodes)
    queued = [
        [q.action_id, q.trajectory_id, str(q.cpus), f"{q.waited_s:.1f}s", q.reason]
        for q in st.queue_rows
    ]
    table(["QUEUED", "TRAJECTORY", "CPUS", "WAITED", "WAITING FOR"], queued)
    running = [
        [r.action_id, r.trajectory_id, r.node_id, str(r.cores), f"{r.running_s:.1f}s"]
        for r in st.running_rows
    ]
    table(["RUNNING", "TRAJECTORY", "NODE", "CORES", "FOR"], running)
    return 0


async def _services(url: str, st: SchedulerStatus) -> list[list[str]]:
    """The services' rows: their heartbeats as the leader heard them; from a scheduler that
    hears none (an older one), the scheduler (it answered) and the gateway, asked."""
    if st.service_rows:
        return [beats.cells(r) for r in st.service_rows]
    rows = [["scheduler", "-", "-", "healthy", f"leading, epoch {st.epoch}", "-", "-", "-"]]
    try:
        why = await _unhealthy("gateway", url, None)
    except TangramError as exc:
        why = str(exc)
    health, phase = ("unhealthy: " + why, "") if why else ("healthy", "serving")
    rows.append(["gateway", "-", "-", health, phase, "-", "-", "-"])
    return rows


def _ago(n: NodeRow) -> str:
    return beats.ago(n.last_progress_s)


def table(header: list[str], rows: list[list[str]]) -> None:
    if not rows:
        print(f"{header[0]}: none\n")
        return
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    print()


async def cmd_health(args: argparse.Namespace) -> int:
    """Ask the service itself over NATS (the node agent: whether the scheduler hears it)."""
    url = locate(args)
    try:
        why = await _unhealthy(args.service, url, args.node)
    except TangramError as exc:
        why = str(exc)
    if why:
        print(f"{args.service}: unhealthy: {why}", file=sys.stderr)
        return 1
    print(f"{args.service}: ok")
    return 0


async def _unhealthy(service: str, url: str, node: str | None) -> str:
    if service == "scheduler":
        await scheduler_status(url)
        return ""
    if service == "gateway":
        bus = await Bus.connect(url, "tangram-health", deadline_s=5.0, creds=auth.ops_creds(url))
        try:
            await bus.request(subjects.GATEWAY, GetResult(action_id="health-probe"), timeout=3.0)
        except NotFound:
            pass  # it answered
        finally:
            await bus.close()
        return ""
    st = await scheduler_status(url)
    names = [n.node_id for n in st.node_rows]
    node = node or os.environ.get("TANGRAM_CPU_NODE_ID", "node0")
    if node in names:
        return ""
    return f"node {node} is not among the scheduler's live nodes {names}"


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser], state: str) -> None:
    """The subcommands above, each option with its help."""
    ep = sub.add_parser(
        "exec",
        help="run one command in a trajectory's own environment: tangram exec -- CMD ...",
        description=EXEC_HELP,
    )
    _where(ep, state)
    ep.add_argument("--trajectory", default="cli", help="trajectory id (its environment)")
    ep.add_argument("--job", default="cli", help="RL job id the action is accounted to")
    ep.add_argument(
        "--cpus",
        default=1,
        type=cpus,
        help="cores: N, or MIN-MAX for an elastic command ({dop} becomes the count granted)",
    )
    ep.add_argument("--timeout", type=float, default=600.0, help="seconds the command may run")
    ep.add_argument("command", nargs=argparse.REMAINDER, help="the command (after --)")
    cp = sub.add_parser("cancel", help="cancel a queued or running action by its id")
    _where(cp, state)
    cp.add_argument("action_id", help="the id `tangram exec` printed")
    xp = sub.add_parser("close-env", help="end a trajectory: cancel its actions, remove its env")
    _where(xp, state)
    xp.add_argument("trajectory", help="trajectory id")
    rp = sub.add_parser("result", help="print a finished action's result (exit status as exec)")
    _where(rp, state)
    rp.add_argument("action_id", help="the id `tangram exec` printed")
    rp.add_argument(
        "--wait",
        type=float,
        default=0.0,
        help="wait up to this many seconds for it to finish (default: do not wait; exit 3)",
    )
    sp = sub.add_parser(
        "status", help="the services' and nodes' health, the queue and the running actions"
    )
    _where(sp, state)
    hp = sub.add_parser("health", help="exit 0 if a service answers over NATS (compose probes)")
    _where(hp, state)
    hp.add_argument("service", choices=["gateway", "scheduler", "cpu_manager"], help="which")
    hp.add_argument(
        "--node",
        default=None,
        help="cpu_manager: its node id (default: $TANGRAM_CPU_NODE_ID, else node0)",
    )


def _where(p: argparse.ArgumentParser, state: str) -> None:
    p.add_argument(
        "--state-dir",
        default=state,
        help="where `tangram up` wrote mesh.json (default %(default)s)",
    )
    p.add_argument(
        "--nats", default=None, help="NATS URL (default: $TANGRAM_NATS_URL, mesh.json, port 4222)"
    )


COMMANDS = {
    "exec": cmd_exec,
    "cancel": cmd_cancel,
    "close-env": cmd_close_env,
    "result": cmd_result,
    "status": cmd_status,
    "health": cmd_health,
}
