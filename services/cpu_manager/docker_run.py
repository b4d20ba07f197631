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
from typing import TYPE_CHECKING

from services.cpu_manager.backend import EnvFailure, ExecOutcome, ExecRequest
from services.cpu_manager.docker_engine import DockerFailure
from services.cpu_manager.executor_client import Call, ExecutorGone, Reply

if TYPE_CHECKING:
    from services.cpu_manager.docker_backend import DockerBackend, Env

log = logging.getLogger(__name__)


@dataclass(eq=False)
class ActionRun:
    """A running action: how to reach it to kill it, and why it was killed."""

    req: ExecRequest
    call: Call | None = None
    exec_id: str = ""
    kill_reason: EnvFailure | None = None


def _failed(failure: EnvFailure, detail: str, started: float) -> ExecOutcome:
    return ExecOutcome(None, b"", b"", False, False, started, time.time(), failure, detail)


def _ending(run: ActionRun, timed_out: bool, killed: bool) -> tuple[EnvFailure | None, str]:
    if timed_out:
        return EnvFailure.EXEC_TIMEOUT, f"killed after the {run.req.timeout_s:g}s timeout"
    if killed or run.kill_reason is not None:
        return run.kill_reason or EnvFailure.KILLED, "killed on request"
    return None, ""


def outcome_from_reply(reply: Reply, run: ActionRun) -> ExecOutcome:
    """Turn the executor's reply into an outcome (a signal becomes a negative exit code)."""
    h = reply.header
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


async def _broken(
    backend: DockerBackend, env: Env, run: ActionRun, why: str, started: float
) -> ExecOutcome:
    """The container failed under an action: say why, quarantine it."""
    if run.kill_reason is not None and backend.env(run.req.trajectory_id) is not env:
        return _failed(run.kill_reason, "killed on request (environment dropped)", started)
    failure, detail = await backend.diagnose(env, why)
    backend.quarantine(env, detail, tell_next=failure is not EnvFailure.ENVIRONMENT_LOST)
    return _failed(failure, detail, started)


def _hung(backend: DockerBackend, env: Env, run: ActionRun, started: float) -> ExecOutcome:
    detail = (
        f"exec hung: no result {backend.cfg.exec_grace_s:g}s past its "
        f"{run.req.timeout_s:g}s timeout"
    )
    backend.quarantine(env, detail, tell_next=True)
    return _failed(EnvFailure.EXEC_TIMEOUT, detail, started)


async def exec_via_executor(backend: DockerBackend, env: Env, run: ActionRun) -> ExecOutcome:
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
    try:
        async with asyncio.timeout(req.timeout_s + backend.cfg.exec_grace_s):
            reply = await run.call.run(payload, req.output_cap_bytes)
    except TimeoutError:
        return _hung(backend, env, run, started)
    except ExecutorGone as exc:
        return await _broken(backend, env, run, str(exc), started)
    return outcome_from_reply(reply, run)


async def exec_via_docker(backend: DockerBackend, env: Env, run: ActionRun) -> ExecOutcome:
    """The fallback: ``docker exec``; a timeout kills the exec's process tree from the host."""
    req = run.req
    engine = backend.engine
    started = time.time()
    try:
        run.exec_id = await backend.call(
            engine.exec_create, env.container_id, req.argv, backend.action_env(req)
        )
    except DockerFailure as exc:
        if exc.failure is not EnvFailure.ENVIRONMENT_LOST:
            raise
        return await _broken(backend, env, run, exc.detail, started)
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
    failure, detail = _ending(run, timed_out, False)
    return ExecOutcome(code, out, err, out_trunc, err_trunc, started, finished, failure, detail)


async def oom_checked(
    backend: DockerBackend, env: Env, outcome: ExecOutcome, before: int | None, since: float
) -> ExecOutcome:
    """``outcome``, typed OOM-killed when the kernel's OOM killer ended the command."""
    if outcome.failure is not None or outcome.exit_code not in (-9, 137):
        return outcome
    if not await _oom_killed(backend, env, before, since):
        return outcome
    backend.stats["oom_kills"] += 1
    detail = f"killed by the kernel OOM killer: over the {env.memory_mb} MiB memory limit"
    return dataclasses.replace(outcome, failure=EnvFailure.OOM_KILLED, detail=detail)


async def _oom_killed(backend: DockerBackend, env: Env, before: int | None, since: float) -> bool:
    """The cgroup's OOM-kill counter where it is visible; the engine's word otherwise."""
    after = env.cgroup.oom_kills() if env.cgroup is not None else None
    if before is not None and after is not None:
        return after > before
    try:
        return await backend.call(backend.engine.oom_killed_since, env.container_id, since)
    except DockerFailure as exc:
        log.info("cannot tell whether %s was OOM-killed: %s", env.spec.name, exc.detail)
        return False
