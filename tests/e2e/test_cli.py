"""The README's commands, end to end: `tangram demo`, and `tangram up` + `tangram exec`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..support import eventually

TANGRAM = [sys.executable, "-m", "tangram.cli"]
ENV = {**os.environ, "TANGRAM_CPU_BACKEND": "process"}


@pytest.mark.slow
def test_demo_runs_a_rollout_and_reports_completion_times(tmp_path: Path):
    out = subprocess.run(
        [
            *TANGRAM,
            "demo",
            "--state-dir",
            str(tmp_path),
            "--trajectories",
            "4",
            "--turns",
            "2",
            "--backend",
            "process",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=ENV,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "action completion time" in out.stdout
    for word in ("queue", "execution", "overhead", "p50", "p99"):
        assert word in out.stdout
    assert "0 infrastructure failures" in out.stdout
    assert "ran on the process backend" in out.stdout  # issue 10, item 9
    assert not (tmp_path / "mesh.json").exists()


@pytest.mark.slow
def test_up_writes_mesh_json_and_exec_runs_an_action(tmp_path: Path):
    up = subprocess.Popen(
        [*TANGRAM, "up", "--state-dir", str(tmp_path), "--backend", "process"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
    )
    try:
        deadline = time.monotonic() + 60
        lines = []
        assert up.stdout is not None
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            lines.append(line)
            if "mesh up" in line or not line:
                break
        assert any("mesh up" in x for x in lines), "".join(lines)
        assert any(x.startswith("gateway") for x in lines)
        mesh = json.loads((tmp_path / "mesh.json").read_text())
        assert mesh["nats_url"].startswith("nats://")
        assert mesh["postgres_dsn"].startswith("postgresql://")
        ran = subprocess.run(
            [
                *TANGRAM,
                "exec",
                "--state-dir",
                str(tmp_path),
                "--cpus",
                "1-2",
                "--",
                "echo",
                "dop={dop}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.startswith("dop=")
        failed = subprocess.run(
            [*TANGRAM, "exec", "--state-dir", str(tmp_path), "--", "exit 7"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert failed.returncode == 7
    finally:
        up.send_signal(signal.SIGTERM)
        rest, _ = up.communicate(timeout=60)
    assert up.returncode == 0, rest
    assert "stopping" in rest


@pytest.mark.slow
async def test_service_runs_one_service_against_given_servers(tmp_path: Path):
    import asyncio

    from tangram import subjects
    from tangram.bus import Bus
    from tangram.contract import GetResult
    from tangram.embedded import EmbeddedNats, EmbeddedPostgres
    from tangram.errors import NotFound, TangramError

    nats_srv = await asyncio.to_thread(EmbeddedNats(tmp_path / "nats").start)
    pg = await asyncio.to_thread(EmbeddedPostgres(tmp_path / "pg", fsync=False).start)
    proc = await asyncio.create_subprocess_exec(
        *TANGRAM,
        "service",
        "gateway",
        "--nats",
        nats_srv.url,
        "--postgres",
        pg.dsn,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    bus = await Bus.connect(nats_srv.url, "test")

    async def gateway_answers() -> bool:
        try:
            await bus.request(subjects.GATEWAY, GetResult(action_id="nope"), timeout=0.5)
        except NotFound:
            return True
        except TangramError:
            return False  # not up yet
        return True

    try:
        await eventually(gateway_answers, what="the gateway to answer", timeout_s=30)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        await bus.close()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await asyncio.to_thread(pg.stop)
        await asyncio.to_thread(nats_srv.stop)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["up", "--policy", "nope"], "unknown scheduling policy 'nope'"),
        (["up", "--policy", "fixed-dop:0"], "fixed DoP must be"),
        (["simulate", "--policy", "kubernetes:x"], "bad kubernetes spec"),
    ],
)
def test_bad_policy_is_refused_before_anything_starts(argv: list[str], says: str):
    done = subprocess.run(TANGRAM + argv, env=ENV, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert says in done.stderr
