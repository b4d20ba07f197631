"""Running one action in a container: through the in-container executor, or ``docker exec``.

Both paths end in an ``ExecOutcome``: the command's own result, or a typed failure
(timeout, kill, hung exec, lost/OOM-killed container) with the broken container quarantined.
A SIGKILLed command counts as OOM-killed only when the cgroup's counter (or, where the cgroup
is not visible from here, the engine) says the kernel's OOM killer did it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.cpu_manager.backend_api import ExecOutcome, ExecRequest, failed_outcome
from services.cpu_manager.docker.engine import DockerFailure
from services.cpu_manager.docker.executor_client import Call, ExecutorGone, Reply
from services.cpu_manager.spawn_failure import runtime_errno, spawn_failed
from tangram.contract import ErrorKind

if TYPE_CHECKING:
    from services.cpu_manager.docker.backend import ContainerEnv, DockerBackend

log = logging.getLogger(__name__)
# How dockerd answers a `docker exec` whose program the container runtime could not start.
RUNTIME_EXEC_FAILED = b"OCI runtime exec failed"


@dataclass(eq=False)
class ActionRun:
    """A running action: how to reach it to kill it, and why it was killed."""

    req: ExecRequest
    call: Call | None = None
    exec_id: str = ""
    kill_reason: ErrorKind | None = None
    oom_kills: int | None = None  # the container's own count during the action (the executor's)


def _ending(run: ActionRun, timed_out: bool, killed: bool) -> tuple[ErrorKind | None, str]:
    if timed_out:
        return ErrorKind.EXEC_TIMEOUT, f"killed after the {run.req.timeout_s:g}s timeout"
    if killed or run.kill_reason is not None:
        return run.kill_reason or ErrorKind.CANCELLED, "killed on request"
    return None, ""


def outcome_from_reply(reply: Reply, run: ActionRun) -> ExecOutcome:
    """Turn the executor's reply into an outcome (a signal becomes a negative exit code)."""
    h = reply.header
    if h.get("spawn_errno") is not None:
        return _not_started(h, run.req)
    run.oom_kills = h.get("oom_kills")
    code = h["exit_code"] if h["exit_code"] is not None else -int(h["signal"] or 0)
    failure, detail = _ending(run, bool(h["timed_out"]), bool(h["killed"]))
    return ExecOutcome(
        exit_code=code,
        stdout=reply.stdout,
        stderr=reply.stderr,
        stdout_truncated=bool(h["stdout_truncated"]),
        stderr_truncated=bool(h["stderr_truncated"]),
        started_at=float(h["started_at"]),
        finished_at=float(h["finished_at"]),
        failure=failure,
        detail=detail,
    )


def _not_started(h: dict[str, Any], req: ExecRequest) -> ExecOutcome:
    """The executor could not start the command: its program's failure (as a shell says it,
    exactly as the process backend does), or the container's."""
    started = float(h["started_at"])
    if h.get("spawn_filename") == req.argv[0]:
        own = spawn_failed(req.argv[0], int(h["spawn_errno"]), started)
        if own is not None:
            return own
    return failed_outcome(ErrorKind.INTERNAL, f"could not start: {h.get('spawn_error')}", started)


async def _broken(
    backend: DockerBackend, env: ContainerEnv, run: ActionRun, why: str, started: float
) -> ExecOutcome:
    """The container failed under an action: say why, quarantine it."""
    if run.kill_reason is not None and backend.env(run.req.trajectory_id) is not env:
        return failed_outcome(run.kill_reason, "killed on request (environment dropped)", started)
    failure, detail = await backend.diagnose(env, why)
    backend.quarantine(env, detail, tell_next=failure is not ErrorKind.ENVIRONMENT_LOST)
    return failed_outcome(failure, detail, started)


def _hung(backend: DockerBackend, env: ContainerEnv, run: ActionRun, started: float) -> ExecOutcome:
    detail = (
        f"exec hung: no result {backend.cfg.exec_grace_s:g}s past its "
        f"{run.req.timeout_s:g}s timeout"
    )
    backend.quarantine(env, detail, tell_next=True)
    return failed_outcome(ErrorKind.EXEC_TIMEOUT, detail, started)


async def exec_via_executor(
    backend: DockerBackend, env: ContainerEnv, run: ActionRun
) -> ExecOutcome:
    """One request to the container's executor; it enforces the timeout and the output cap."""
    req = run.req
    started = time.time()
    run.call = Call(env.spec.socket_path, env.init_pid)
    if run.kill_reason is not None:  # killed while its cores were being set
        run.call.kill()
    payload = {
        "op": "run",
        "argv": list(req.argv),
        "env": backend.action_env(req),
        "cwd": backend.cfg.workdir,
        "timeout_s": req.timeout_s,
        "cap": req.output_cap_bytes,
    }
    launch = backend.starts.begin()  # ends once the request is written (or failed)
    try:
        async with asyncio.timeout(req.timeout_s + backend.cfg.exec_grace_s):
            reply = await run.call.run(payload, req.output_cap_bytes, sent=launch.done)
    except TimeoutError:
        return _hung(backend, env, run, started)
    except ExecutorGone as exc:
        return await _broken(backend, env, run, str(exc), started)
    finally:
        launch.done()
    return outcome_from_reply(reply, run)


async def exec_via_docker(backend: DockerBackend, env: ContainerEnv, run: ActionRun) -> ExecOutcome:
    """The fallback: ``docker exec``; a timeout kills the exec's process tree from the host."""
    req = run.req
    engine = backend.engine
    started = time.time()
    try:
        run.exec_id = await backend.call(
            engine.exec_create, env.container_id, req.argv, backend.action_env(req)
        )
    except DockerFailure as exc:
        if exc.failure is not ErrorKind.ENVIRONMENT_LOST:
            raise
        return await _broken(backend, env, run, exc.detail, started)
    # Counted, not bounded: the engine's calls share the backend's threads with container
    # creations, which may hold them all for seconds on a healthy node.
    backend.starts.launched()
    collect = asyncio.ensure_future(
        backend.call(engine.exec_collect, run.exec_id, req.output_cap_bytes)
    )
    timed_out = False
    try:
        if run.kill_reason is not None:  # killed while the exec was being created
            await backend.call(engine.kill_exec, run.exec_id)
        try:
            out, err, out_trunc, err_trunc = await asyncio.wait_for(
                asyncio.shield(collect), req.timeout_s
            )
        except TimeoutError:
            timed_out = True
            await backend.call(engine.kill_exec, run.exec_id)
            out, err, out_trunc, err_trunc = await asyncio.wait_for(
                asyncio.shield(collect), backend.cfg.exec_grace_s
            )
    except TimeoutError:
        return _hung(backend, env, run, started)
    except DockerFailure as exc:
        return await _broken(backend, env, run, exc.detail, started)
    except asyncio.CancelledError:
        await asyncio.shield(backend.call(engine.kill_exec, run.exec_id))
        raise
    finished = time.time()
    code, _ = await backend.call(engine.exec_status, run.exec_id)
    if code is None:
        return await _broken(backend, env, run, "exec ended without an exit code", started)
    if code in (126, 127) and out.startswith(RUNTIME_EXEC_FAILED) and not err:
        return _runtime_refused(out.decode(errors="replace"), req, started)
    failure, detail = _ending(run, timed_out, False)
    return ExecOutcome(code, out, err, out_trunc, err_trunc, started, finished, failure, detail)


def _runtime_refused(message: str, req: ExecRequest, started: float) -> ExecOutcome:
    """``docker exec`` could not start the program: dockerd says so in the output (exit 126
    whatever the reason); reported as the process backend and the executor report it."""
    err = runtime_errno(message)
    own = spawn_failed(req.argv[0], err, started) if err is not None else None
    return own or failed_outcome(ErrorKind.INTERNAL, message.strip(), started)


async def oom_checked(
    backend: DockerBackend,
    env: ContainerEnv,
    run: ActionRun,
    outcome: ExecOutcome,
    before: int | None,
    since: float,
) -> ExecOutcome:
    """``outcome``, typed OOM-killed when the kernel's OOM killer ended the command."""
    if outcome.failure is not None or outcome.exit_code not in (-9, 137):
        return outcome
    if not await _oom_killed(backend, env, run, before, since):
        return outcome
    backend.stats["oom_kills"] += 1
    detail = f"killed by the kernel OOM killer: over the {env.memory_mb} MiB memory limit"
    return dataclasses.replace(outcome, failure=ErrorKind.OOM_KILLED, detail=detail)


async def _oom_killed(
    backend: DockerBackend, env: ContainerEnv, run: ActionRun, before: int | None, since: float
) -> bool:
    """The kernel's OOM-kill counter of the container's memory cgroup, as the executor read it
    inside or as this host sees it; the engine's word only where neither can be read.

    The counters are exact: the kernel counts a kill before it sends the SIGKILL. The engine's
    ``oom`` event is not: it travels kernel -> containerd -> dockerd and may arrive after the
    executor has already reported the exit, so it is the last resort (``docker exec`` of an
    image whose cgroup is not visible from here).
    """
    if run.oom_kills is not None:
        return run.oom_kills > 0
    after = env.cgroup.oom_kills() if env.cgroup is not None else None
    if before is not None and after is not None:
        return after > before
    try:
        return await backend.call(backend.engine.oom_killed_since, env.container_id, since)
    except DockerFailure as exc:
        log.info("cannot tell whether %s was OOM-killed: %s", env.spec.name, exc.detail)
        return False
