"""``tangram``: the command line, and the one composition root of the project.

tangram up        the whole mesh on this machine (embedded NATS + Postgres)
tangram sandbox-image   build the default Docker sandbox image offline (docker import)
tangram service   one service against given NATS/Postgres URLs
tangram exec      run one action from a shell
tangram demo      an embedded mesh running a small AI-coding rollout, with a report
tangram simulate  the trace-driven simulator (the scheduler's core on a virtual clock)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import uvloop

from tangram import runtime, telemetry
from tangram.errors import TangramError

DEFAULT_STATE = Path(os.environ.get("TANGRAM_STATE_DIR", ".state"))


def _mesh_opts(args: argparse.Namespace) -> Any:
    from tangram.launcher import MeshOptions

    return MeshOptions(
        state_dir=Path(args.state_dir).resolve(),
        nats_url=args.nats,
        postgres_dsn=args.postgres,
        nodes=args.nodes,
        backend=args.backend,
        policy=args.policy,
    )


async def _cpu_backend(args: argparse.Namespace) -> tuple[str, str]:
    """The CPU backend the node agents will run and the one line that says which and why.
    On a Docker engine without the default sandbox image, that image is built first."""
    from services.cpu_manager.choice import choose
    from services.cpu_manager.config import load_own

    cfg = load_own({"backend": args.backend, "state_dir": args.state_dir})
    choice = await choose(cfg, build_image=True)
    return choice.backend, choice.line


async def cmd_up(args: argparse.Namespace) -> int:
    from tangram.bus import Bus
    from tangram.launcher import Mesh

    opts = _mesh_opts(args)
    opts.backend, line = await _cpu_backend(args)  # the agents run what this line says
    print(f"{'cpu':<11} {line}", flush=True)
    mesh = Mesh(opts)
    stop = asyncio.Event()
    runtime.install_signals(stop)
    try:
        await mesh.start()
        _status_lines(mesh)
        bus = await Bus.connect(mesh.nats_url, "tangram-up")
        st = await mesh.status(bus)
        await bus.close()
        print(
            f"scheduler   epoch {st.epoch}, policy {st.policy}, {st.nodes} node(s), "
            f"{st.free_cores} free cores"
        )
        print(f"mesh up: nats {mesh.nats_url}  postgres {mesh.postgres_dsn}")
        print(f"wrote {mesh.opts.state_dir / 'mesh.json'}; Ctrl-C stops everything", flush=True)
        await stop.wait()
    finally:
        print("stopping...", flush=True)
        await mesh.stop()
    return 0


def _status_lines(mesh: Any) -> None:
    servers = [("nats", mesh.nats_url, mesh.nats), ("postgres", mesh.postgres_dsn, mesh.pg)]
    for name, url, emb in servers:
        print(f"{name:<11} {'embedded' if emb else 'external'}  {url}")
    for key, proc in mesh.procs.items():
        print(f"{key:<11} pid {proc.pid}  log {mesh.opts.state_dir}/logs/{key}.log")


async def cmd_service(args: argparse.Namespace) -> int:
    overrides = {"nats_url": args.nats, "postgres_dsn": args.postgres}
    await runtime.run_service(args.name, _builder(args.name), overrides)
    return 0


def _builder(name: str) -> runtime.Build:
    """Import one service lazily (libs never import services at module level)."""
    if name == "gateway":
        from services.gateway.service import build as gateway

        return gateway
    if name == "scheduler":
        from services.scheduler.service import build as scheduler

        return scheduler
    if name == "cpu_manager":
        from services.cpu_manager.service import build as cpu_manager

        return cpu_manager
    raise SystemExit(f"unknown service {name!r}; known: gateway, scheduler, cpu_manager")


def _nats_url(args: argparse.Namespace) -> str:
    if args.nats:
        return str(args.nats)
    mesh_json = Path(args.state_dir) / "mesh.json"
    if mesh_json.exists():
        return str(json.loads(mesh_json.read_text())["nats_url"])
    return "nats://127.0.0.1:4222"


def _cpus(text: str) -> int | tuple[int, int]:
    lo, _, hi = text.partition("-")
    return (int(lo), int(hi)) if hi else int(lo)


async def cmd_exec(args: argparse.Namespace) -> int:
    from tangram.client import Client

    if not args.command:
        raise SystemExit("tangram exec: give a command after --")
    command: str | list[str] = args.command[0] if len(args.command) == 1 else args.command
    async with Client.connect(_nats_url(args)) as client:
        res = await client.exec(
            command,
            trajectory_id=args.trajectory,
            job_id=args.job,
            cpus=_cpus(args.cpus),
            timeout_s=args.timeout,
        )
    sys.stdout.write(res.stdout)
    sys.stderr.write(res.stderr)
    if res.error is not None and res.error.infrastructure:
        print(
            f"tangram: {res.status}: {res.error.kind.value}: {res.error.message}", file=sys.stderr
        )
        return 125
    return res.exit_code if res.exit_code is not None else 1


async def cmd_sandbox_image(args: argparse.Namespace) -> int:
    from services.cpu_manager.config import load_own
    from services.cpu_manager.docker import sandbox_image
    from services.cpu_manager.docker.engine import DockerFailure

    host = args.docker_host if args.docker_host is not None else load_own().docker.docker_host
    try:
        version = await asyncio.to_thread(sandbox_image.build, host, args.image)
    except DockerFailure as exc:
        print(f"tangram: cannot build {args.image}: {exc.detail}", file=sys.stderr)
        return 1
    print(f"built {args.image} on Docker engine {version}: {sandbox_image.DESCRIPTION}")
    return 0


async def cmd_demo(args: argparse.Namespace) -> int:
    from tangram.demo import DemoOptions, run_demo

    opts = DemoOptions(trajectories=args.trajectories, turns=args.turns, tests=args.tests)
    return await run_demo(_mesh_opts(args), opts)


def cmd_simulate(argv: list[str]) -> int:
    from services.scheduler.sim.simulator import main as simulate

    return int(simulate(argv) or 0)


def _mesh_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", default=str(DEFAULT_STATE), help="data, logs and mesh.json")
    p.add_argument("--nats", default=None, help="use this NATS instead of an embedded one")
    p.add_argument("--postgres", default=None, help="use this Postgres DSN instead of embedded")
    p.add_argument("--nodes", type=int, default=1, help="CPU node agents to run")
    p.add_argument("--backend", default="auto", choices=["auto", "process", "docker"])
    p.add_argument(
        "--policy",
        default="elastic",
        type=_policy,
        help="scheduling policy: elastic, elastic:DEPTH, fixed-dop:K, min, trajectory-static:K",
    )


def _policy(spec: str) -> str:
    """Refuse a policy the scheduler would not start with, before anything starts."""
    from services.scheduler.policies.spec import parse_policy

    try:
        parse_policy(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return spec


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="tangram", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--log-level", default=os.environ.get("TANGRAM_LOG_LEVEL", "WARNING"))
    sub = ap.add_subparsers(dest="cmd", required=True)
    _mesh_args(sub.add_parser("up", help="run the whole mesh on this machine"))
    sp = sub.add_parser("service", help="run one service")
    sp.add_argument("name", choices=["gateway", "scheduler", "cpu_manager"])
    sp.add_argument("--nats", default=None)
    sp.add_argument("--postgres", default=None)
    ep = sub.add_parser("exec", help="run one action: tangram exec -- CMD ...")
    ep.add_argument("--state-dir", default=str(DEFAULT_STATE))
    ep.add_argument("--nats", default=None)
    ep.add_argument("--trajectory", default="cli")
    ep.add_argument("--job", default="cli")
    ep.add_argument("--cpus", default="1", help="N or MIN-MAX")
    ep.add_argument("--timeout", type=float, default=600.0)
    ep.add_argument("command", nargs=argparse.REMAINDER)
    ip = sub.add_parser("sandbox-image", help="build the default Docker sandbox image offline")
    ip.add_argument("--image", default="tangram-sandbox:latest", help="tag to build")
    ip.add_argument("--docker-host", default=None, help="default: TANGRAM_CPU_DOCKER_HOST")
    dp = sub.add_parser("demo", help="AI-coding rollout on an embedded mesh")
    _mesh_args(dp)
    dp.add_argument("--trajectories", type=int, default=32)
    dp.add_argument("--turns", type=int, default=4)
    dp.add_argument("--tests", type=int, default=6, help="test cases per trajectory")
    sub.add_parser(
        "simulate", help="trace-driven simulator (see tangram simulate --help)", add_help=False
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["simulate"]:
        return cmd_simulate(argv[1:])
    args = parser().parse_args(argv)
    if args.cmd == "exec" and args.command[:1] == ["--"]:
        args.command = args.command[1:]
    runtime.setup_logging(args.log_level.upper())
    telemetry.setup(f"tangram-{args.cmd}", os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    commands = {
        "up": cmd_up,
        "service": cmd_service,
        "exec": cmd_exec,
        "demo": cmd_demo,
        "sandbox-image": cmd_sandbox_image,
    }
    try:
        return uvloop.run(commands[args.cmd](args))
    except TangramError as exc:
        print(f"tangram: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        telemetry.shutdown()


if __name__ == "__main__":
    logging.captureWarnings(True)
    sys.exit(main())
