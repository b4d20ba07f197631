"""The process backend and the Docker backend's executor path (the in-container executor run
here as a plain process) give an action the same TANGRAM_* variables and report a program
that cannot start identically: the shared ``action_env`` and ``spawn_failure`` modules."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.cpu_manager.action_env import tangram_vars
from services.cpu_manager.backend_api import ExecOutcome, ExecRequest
from services.cpu_manager.docker import executor, executor_client
from services.cpu_manager.docker.backend import DockerBackend
from services.cpu_manager.docker.config import DockerConfig
from services.cpu_manager.docker.run import ActionRun, outcome_from_reply
from services.cpu_manager.process.backend import AGENT_TAG, ROOT_TAG, ProcessBackend, ProcessConfig

NODE = "n7"
CORES = tuple(sorted(os.sched_getaffinity(0)))
SHOW_ENV = ("sh", "-c", "env | grep ^TANGRAM_ | sort")
FORGED = {"TANGRAM_CORES": "99", "TANGRAM_DOP": "64", "TANGRAM_NODE_ID": "x", "MINE": "1"}


@pytest.fixture
async def process(tmp_path: Path) -> AsyncIterator[ProcessBackend]:
    b = ProcessBackend(ProcessConfig(root=tmp_path / "envs", node_id=NODE, incarnation="agree"))
    await b.start()
    try:
        yield b
    finally:
        await b.close()


@pytest.fixture
async def docker_path(tmp_path: Path) -> AsyncIterator[tuple[DockerBackend, Path]]:
    """A Docker backend (never started: only its action path is used) and an executor."""
    backend = DockerBackend(DockerConfig(root=str(tmp_path / "d"), node_id=NODE))
    with tempfile.TemporaryDirectory(prefix="tgx-") as d:  # short: unix socket paths are capped
        sock = Path(d) / "exec.sock"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", executor.__file__, str(sock)
        )
        try:
            await executor_client.wait_ready(sock, 10.0)
            yield backend, sock
        finally:
            proc.kill()
            await proc.wait()


async def via_executor(path: tuple[DockerBackend, Path], req: ExecRequest) -> ExecOutcome:
    """What the Docker backend's executor path makes of ``req`` (exec_via_executor's steps)."""
    backend, sock = path
    payload = {
        "op": "run",
        "argv": list(req.argv),
        "env": backend.action_env(req),
        "cwd": "/",
        "timeout_s": req.timeout_s,
        "cap": req.output_cap_bytes,
    }
    reply = await executor_client.Call(sock).run(payload, req.output_cap_bytes)
    return outcome_from_reply(reply, ActionRun(req))


def request(argv: tuple[str, ...], env: dict[str, str] | None = None) -> ExecRequest:
    return ExecRequest("a1", "t1", argv, CORES, 10.0, 4096, env=env or {})


def tangram_lines(out: ExecOutcome) -> list[str]:
    private = (f"{AGENT_TAG}=", f"{ROOT_TAG}=")  # the process backend's leftover tags
    return [line for line in out.stdout.decode().splitlines() if not line.startswith(private)]


async def test_both_give_the_same_tangram_variables_and_ignore_forged_ones(
    process: ProcessBackend, docker_path: tuple[DockerBackend, Path]
) -> None:
    req = request(SHOW_ENV, FORGED)
    by_process = tangram_lines(await process.run(req))
    by_docker = tangram_lines(await via_executor(docker_path, req))
    expected = sorted(f"{k}={v}" for k, v in tangram_vars(req, NODE).items())
    assert by_process == by_docker == expected
    assert f"TANGRAM_DOP={len(CORES)}" in expected


async def test_the_action_env_reaches_the_command_in_both(
    process: ProcessBackend, docker_path: tuple[DockerBackend, Path]
) -> None:
    req = request(("sh", "-c", "echo $MINE"), FORGED)
    assert (await process.run(req)).stdout == b"1\n"
    assert (await via_executor(docker_path, req)).stdout == b"1\n"


def _not_executable(tmp_path: Path) -> str:
    script = tmp_path / "not-executable.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    return str(script)


@pytest.mark.parametrize(
    ("program", "code"),
    [
        (lambda _: "tangram-no-such-program", 127),
        (lambda tmp: str(tmp / "nowhere" / "prog"), 127),
        (_not_executable, 126),
        (lambda tmp: str(tmp), 126),  # a directory
    ],
    ids=["not-on-path", "missing-path", "no-exec-permission", "directory"],
)
async def test_both_report_a_program_that_cannot_start_alike(
    process: ProcessBackend, docker_path: tuple[DockerBackend, Path], tmp_path: Path, program, code
) -> None:
    req = request((program(tmp_path), "--flag"))
    a = await process.run(req)
    b = await via_executor(docker_path, req)
    assert (a.failure, a.exit_code, a.stderr) == (b.failure, b.exit_code, b.stderr)
    assert (a.failure, a.exit_code) == (None, code)
    assert a.stderr.startswith(req.argv[0].encode() + b": ")
