"""tangram: run actions of RL trajectories on pooled resources (the command line).

tangram up        the whole mesh on this machine (embedded NATS + Postgres); Ctrl-C stops it
tangram sandbox-image   build the default Docker sandbox image offline (docker import)
tangram service   one service against given NATS/Postgres URLs
tangram exec      run a command in a trajectory's own environment (prints the action id)
tangram cancel / result / close-env / status / health   act on a running mesh
tangram demo      an embedded mesh running a small AI-coding rollout, with a report
tangram simulate  the trace-driven simulator (the scheduler's core on a virtual clock)
tangram auth      a deployment's NATS credentials and Postgres roles (compose runs it)
tangram client    add / list / remove client credentials of a running mesh (one per team or job)
tangram dashboard the dashboard's URL with its token

Commands on a running mesh find it by themselves: --nats, $TANGRAM_NATS_URL, the mesh.json
that `tangram up` writes in --state-dir (default .state), then port 4222 on this machine.
tangram quota     declare API quotas (quota set NAME ...) and list them with what they learned
tangram services  register model services (services register NAME module:factory) and list them
tangram infer     call a model service: tangram infer SERVICE JSON
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Any

import uvloop

from tangram import cli_auth, cli_clients, cli_ops, runtime, services_cli, telemetry
from tangram.errors import TangramError

DEFAULT_STATE = Path(os.environ.get("TANGRAM_STATE_DIR", ".state"))
SERVICE_NAMES = ["gateway", "scheduler", "cpu_manager", "quota_manager", "gpu_manager", "dashboard"]
_QUOTA_LINE = "quota_manager: HTTP calls under quotas (keys from its env; tangram quota set)"


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
    from tangram.discovery import DEFAULT_PORT
    from tangram.launcher import Mesh

    opts = _mesh_opts(args)
    opts.nats_port = DEFAULT_PORT  # clients find it with no URL (when the port is free)
    opts.dashboard_port = 8265  # the dashboard's, when free (as Ray's)
    opts.reward_front_port = 8470  # slime --rm-url / OpenRLHF --remote_rm_url, when free
    opts.secure = True  # credentials per role (mesh.json names the client's), actions' own uids
    opts.schedulers, opts.supervise = args.schedulers, True  # a standby; restarts what dies
    mesh = Mesh(opts)
    mesh.lock.acquire()  # a state dir in use: say by whom before anything starts
    opts.backend, line = await _cpu_backend(args)  # the agents run what this line says
    print(f"{'cpu':<11} {line}", flush=True)
    print(f"{'quota':<11} {_QUOTA_LINE}", flush=True)
    print(f"{'gpu':<11} {await asyncio.to_thread(services_cli.gpu_line)}", flush=True)
    stop = asyncio.Event()
    runtime.install_signals(stop)
    try:
        await mesh.start()
        _status_lines(mesh)
        bus = await Bus.connect(mesh.nats_url, "tangram-up", creds=mesh.ops_creds)
        st = await mesh.status(bus)
        await bus.close()
        print(
            f"scheduler   epoch {st.epoch}, policy {st.policy}, {st.nodes} node(s), "
            f"{st.free_cores} free cores"
        )
        print(f"mesh up: nats {mesh.nats_url}  postgres {mesh.postgres_dsn}")
        print(f"dashboard   {mesh.dashboard_login_url}", flush=True)  # its token: private
        print(f"rewards     {mesh.reward_front_url} (POST /rm, /get_reward)", flush=True)
        await _register_services(mesh, args.services)
        print(f"wrote {mesh.opts.state_dir / 'mesh.json'}; Ctrl-C stops everything", flush=True)
        await stop.wait()
    finally:
        print("stopping...", flush=True)
        await mesh.stop()
    return 0


async def _register_services(mesh: Any, path: str | None) -> None:
    """Register the services ``tangram up --services FILE`` lists, saying how each went."""
    from tangram.client import Client

    if path is None:
        return
    specs = services_cli.load_specs(Path(path))
    async with Client.connect(mesh.nats_url, creds=mesh.client_creds) as client:
        for state in await services_cli.register_all(client, specs):
            print(services_cli.state_line(state), flush=True)


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
    if name == "quota_manager":
        from services.quota_manager.service import build as quota_manager

        return quota_manager
    if name == "gpu_manager":
        from services.gpu_manager.service import build as gpu_manager

        return gpu_manager
    if name == "dashboard":
        from services.dashboard.service import build as dashboard

        return dashboard
    raise SystemExit(f"unknown service {name!r}; known: {', '.join(SERVICE_NAMES)}")


def _nats_url(args: argparse.Namespace) -> str:
    """--nats, $TANGRAM_NATS_URL, a live mesh.json in --state-dir, then port 4222."""
    return cli_ops.locate(args)


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
    mesh_opts = _mesh_opts(args)
    mesh_opts.backend, line = await _cpu_backend(args)  # said in the demo's report
    print(f"cpu backend: {line}", flush=True)
    return await run_demo(mesh_opts, opts)


def cmd_simulate(argv: list[str]) -> int:
    from services.scheduler.sim.simulator import main as simulate

    return int(simulate(argv) or 0)


async def cmd_quota(args: argparse.Namespace) -> int:
    from tangram.client import Client
    from tangram.quota_cli import quota_table, spec_of

    async with Client.connect(_nats_url(args)) as client:
        if args.quota_cmd == "set":
            await client.set_quota(spec_of(args))
            print(f"quota {args.name} set")
        else:
            print(quota_table(await client.list_quotas()))
    return 0


async def cmd_infer(args: argparse.Namespace) -> int:
    return await services_cli.cmd_infer(args, _nats_url(args))


async def cmd_services(args: argparse.Namespace) -> int:
    return await services_cli.cmd_services(args, _nats_url(args))


def _quota_args(p: argparse.ArgumentParser) -> None:
    from tangram.quota_cli import add_set_args

    qs = p.add_subparsers(dest="quota_cmd", required=True)
    for q in (qs.add_parser("set", help="declare or change a quota"), qs.add_parser("list")):
        q.add_argument("--state-dir", default=str(DEFAULT_STATE))
        q.add_argument("--nats", default=None)
    add_set_args(qs.choices["set"])


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
    up = sub.add_parser("up", help="run the whole mesh on this machine")
    _mesh_args(up)
    up.add_argument(
        "--schedulers",
        type=int,
        default=2,
        choices=range(1, 10),
        metavar="N",
        help="schedulers to run: one leads, the others stand by (default 2)",
    )
    services_cli.add_up_args(up)
    sp = sub.add_parser("service", help="run one service")
    sp.add_argument("name", choices=SERVICE_NAMES)
    sp.add_argument("--nats", default=None)
    sp.add_argument("--postgres", default=None)
    cli_ops.add_parsers(sub, str(DEFAULT_STATE))
    cli_auth.add_parsers(sub)
    cli_clients.add_parsers(sub, str(DEFAULT_STATE))
    ip = sub.add_parser("sandbox-image", help="build the default Docker sandbox image offline")
    ip.add_argument("--image", default="tangram-sandbox:latest", help="tag to build")
    ip.add_argument("--docker-host", default=None, help="default: TANGRAM_CPU_DOCKER_HOST")
    dp = sub.add_parser("demo", help="AI-coding rollout on an embedded mesh")
    _mesh_args(dp)
    dp.add_argument("--trajectories", type=int, default=32)
    dp.add_argument("--turns", type=int, default=4)
    dp.add_argument("--tests", type=int, default=6, help="test cases per trajectory")
    _quota_args(sub.add_parser("quota", help="declare and list API quotas"))
    services_cli.add_parsers(sub, str(DEFAULT_STATE))
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
    if getattr(args, "state_dir", None):  # where this command's mesh, and its credentials, are
        os.environ["TANGRAM_STATE_DIR"] = str(Path(args.state_dir).resolve())
    runtime.setup_logging(args.log_level.upper())
    telemetry.setup(f"tangram-{args.cmd}", os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    commands = {
        **cli_ops.COMMANDS,
        **cli_auth.COMMANDS,
        **cli_clients.COMMANDS,
        "up": cmd_up,
        "service": cmd_service,
        "demo": cmd_demo,
        "sandbox-image": cmd_sandbox_image,
        "quota": cmd_quota,
        "infer": cmd_infer,
        "services": cmd_services,
    }
    try:
        return uvloop.run(commands[args.cmd](args))
    except TangramError as exc:
        print(f"tangram: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one line, not a traceback (--log-level DEBUG shows it)
        logging.getLogger("tangram").debug("failed", exc_info=True)
        print(f"tangram: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        telemetry.shutdown()


if __name__ == "__main__":
    logging.captureWarnings(True)
    sys.exit(main())
