"""``tangram infer``, ``tangram services register|list`` and ``tangram up --services FILE``:
model services from the shell.

(``tangram service NAME`` runs one mesh service process; model services are ``services``.)
A services file is a JSON or YAML list of ServiceSpec fields, e.g.::

    - {name: judge, factory: "my_rewards:length_judge", max_batch: 32}
    - {name: teacher-l, factory: "services.gpu_manager.examples:teacher_large", dops: [1, 2]}
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from tangram.client import Client
from tangram.contract import ServiceSpec, ServiceState
from tangram.errors import InvalidRequest

COLUMNS = ("NAME", "FACTORY", "DOPS", "MB", "PREPARED ON", "RESIDENT ON", "ERROR")


def add_parsers(sub: Any, default_state: str) -> None:
    """``infer`` and ``services`` on the CLI's subparsers."""
    ip = sub.add_parser("infer", help="call a model service: tangram infer SERVICE JSON")
    _where(ip, default_state)
    ip.add_argument("service")
    ip.add_argument("payload", help="the payload as JSON, e.g. '[0.5, 1.0]' or '\"text\"'")
    ip.add_argument("--job", default="cli")
    ip.add_argument("--timeout", type=float, default=600.0)
    sp = sub.add_parser("services", help="register and list model services (GPU pool)")
    ss = sp.add_subparsers(dest="services_cmd", required=True)
    rp = ss.add_parser("register", help="register NAME FACTORY ('module:callable')")
    rp.add_argument("name")
    rp.add_argument("factory")
    rp.add_argument("--dops", default="1", help="GPU counts it may run on, e.g. 1,2")
    rp.add_argument("--max-batch", type=int, default=None)
    rp.add_argument("--max-output-bytes", type=int, default=None)
    for p in (rp, ss.add_parser("list", help="registered services, where they are resident")):
        _where(p, default_state)


def add_up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--services", default=None, help="JSON/YAML list of services to register")


def _where(p: argparse.ArgumentParser, default_state: str) -> None:
    p.add_argument("--state-dir", default=default_state)
    p.add_argument("--nats", default=None)


def spec_of(args: argparse.Namespace) -> ServiceSpec:
    """The ServiceSpec ``services register`` declares, or InvalidRequest naming the problem."""
    fields: dict[str, Any] = {"name": args.name, "factory": args.factory}
    try:
        fields["dops"] = [int(d) for d in args.dops.split(",") if d.strip()]
    except ValueError:
        raise InvalidRequest(f"--dops {args.dops!r}: give GPU counts like 1,2") from None
    if args.max_batch is not None:
        fields["max_batch"] = args.max_batch
    if args.max_output_bytes is not None:
        fields["max_output_bytes"] = args.max_output_bytes
    return _converted(fields, "the command line")


def load_specs(path: Path) -> list[ServiceSpec]:
    """The services a file lists (JSON, or YAML when it is not JSON)."""
    text = path.read_text()
    try:
        raw = json.loads(text)
    except json.JSONDecodeError:
        import yaml

        raw = yaml.safe_load(text)
    if not isinstance(raw, list):
        raise InvalidRequest(f"{path}: expected a list of services, got {type(raw).__name__}")
    return [_converted(item, str(path)) for item in raw]


def _converted(raw: object, where: str) -> ServiceSpec:
    try:
        return msgspec.convert(raw, ServiceSpec)
    except (msgspec.ValidationError, ValueError) as exc:
        raise InvalidRequest(f"bad service in {where}: {exc}") from exc


async def register_all(client: Client, specs: Sequence[ServiceSpec]) -> list[ServiceState]:
    return [await client.register_service(s) for s in specs]


def payload_of(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"the payload is not JSON: {exc}") from exc


def service_table(states: Sequence[ServiceState]) -> str:
    """Services as an aligned table, one row each, sorted by name."""
    rows = [COLUMNS] + [_row(s) for s in sorted(states, key=lambda s: s.spec.name)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def _row(s: ServiceState) -> tuple[str, ...]:
    dops = ",".join(map(str, s.spec.dops))
    where = ",".join(s.prepared_on) or "-"
    return (
        s.spec.name,
        s.spec.factory,
        dops,
        str(s.footprint_mb),
        where,
        ",".join(s.resident_on) or "-",
        s.error or "",
    )


def state_line(s: ServiceState) -> str:
    if s.error:
        return f"service {s.spec.name}: FAILED: {s.error}"
    on = ", ".join(s.prepared_on) or "no GPU node yet"
    return f"service {s.spec.name}: ready on {on} ({s.footprint_mb} MB)"


async def cmd_infer(args: argparse.Namespace, nats_url: str) -> int:
    payload = payload_of(args.payload)
    async with Client.connect(nats_url) as client:
        res = await client.infer(args.service, payload, job_id=args.job, timeout_s=args.timeout)
    if res.ok:
        print(json.dumps(res.output))
        return 0
    err = res.error
    why = f"{err.kind.value}: {err.message}" if err else res.status
    sys.stderr.write(res.stderr)
    print(f"tangram: {res.status}: {why}", file=sys.stderr)
    return 1 if err is not None and not err.infrastructure else 125


async def cmd_services(args: argparse.Namespace, nats_url: str) -> int:
    async with Client.connect(nats_url) as client:
        if args.services_cmd == "register":
            state = await client.register_service(spec_of(args))
            print(state_line(state))
            return 1 if state.error else 0
        print(service_table(await client.list_services()))
    return 0


def gpu_line() -> str:
    """What the gpu_manager of ``tangram up`` will run on (blocking: imports torch, asks
    NVML), in one line."""
    from services.gpu_manager.config import load
    from services.gpu_manager.devices import discover

    _, cfg = load()
    inv = discover(cfg.devices())
    if inv.kind == "cpu":
        why = "no GPU answered" if cfg.backend == "auto" else "TANGRAM_GPU_BACKEND=cpu"
        return f"gpu_manager: {inv.describe()} on torch's CPU device ({why})"
    return f"gpu_manager: {inv.describe()}"
