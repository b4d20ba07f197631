"""A program that cannot be executed is the action's own failure (as a shell reports it), not
the node's: the process backend, spawning real processes."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.cpu_manager.backend_api import ExecRequest
from services.cpu_manager.outcome import to_outcome
from services.cpu_manager.process.backend import ProcessBackend, ProcessConfig
from services.scheduler.core.effects import error_of
from tangram.contract import ErrorKind


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[ProcessBackend]:
    b = ProcessBackend(ProcessConfig(root=tmp_path / "envs", incarnation="spawn-test"))
    await b.start()
    try:
        yield b
    finally:
        await b.close()


def request(argv: tuple[str, ...]) -> ExecRequest:
    core = min(os.sched_getaffinity(0))
    return ExecRequest(
        action_id="a",
        trajectory_id="t",
        argv=argv,
        cores=(core,),
        timeout_s=10.0,
        output_cap_bytes=4096,
    )


async def test_missing_program_exits_127_naming_it(backend: ProcessBackend) -> None:
    out = await backend.run(request(("tangram-no-such-program", "--flag")))
    assert out.failure is None
    assert out.exit_code == 127
    assert out.stderr == b"tangram-no-such-program: command not found\n"
    err = error_of(to_outcome(out, None))
    assert err is not None
    assert err.kind is ErrorKind.COMMAND_FAILED


async def test_missing_path_exits_127(backend: ProcessBackend, tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere" / "prog")
    out = await backend.run(request((missing,)))
    assert (out.failure, out.exit_code) == (None, 127)
    assert missing.encode() in out.stderr


async def test_program_without_exec_permission_exits_126(
    backend: ProcessBackend, tmp_path: Path
) -> None:
    script = tmp_path / "not-executable.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    out = await backend.run(request((str(script),)))
    assert (out.failure, out.exit_code) == (None, 126)
    assert out.stderr == f"{script}: Permission denied\n".encode()
    err = error_of(to_outcome(out, None))
    assert err is not None
    assert err.kind is ErrorKind.COMMAND_FAILED


async def test_the_trajectory_keeps_working_after_a_missing_program(
    backend: ProcessBackend,
) -> None:
    await backend.run(request(("tangram-no-such-program",)))
    out = await backend.run(request(("sh", "-c", "echo ok")))
    assert (out.failure, out.exit_code, out.stdout) == (None, 0, b"ok\n")
