"""Issue 10, end to end: a newcomer's first hour with a real `tangram up`, stopped by a real
terminal Ctrl-C (SIGINT to its process group, as a terminal sends it)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TANGRAM = [sys.executable, "-m", "tangram.cli"]
README = Path(__file__).parents[2] / "README.md"


def env_for(state: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TANGRAM_NATS_URL"}
    env.update({"TANGRAM_CPU_BACKEND": "process", "TANGRAM_STATE_DIR": str(state)})
    return env


def tangram(state: Path, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """A CLI command run with no URL: it must find the mesh by itself."""
    return subprocess.run(
        [*TANGRAM, *argv], capture_output=True, text=True, timeout=timeout, env=env_for(state)
    )


def wait_up(up: subprocess.Popen[str]) -> list[str]:
    lines: list[str] = []
    assert up.stdout is not None
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        line = up.stdout.readline()
        lines.append(line)
        if "Ctrl-C" in line or not line:
            break
    assert any("mesh up" in x for x in lines), "".join(lines)
    return lines


def readme_example(section: str = "## Use it", lang: str = "python") -> str:
    """The first ``lang`` code block of a README section, exactly as a reader copies it."""
    body = README.read_text().split(section, 1)[1]
    return re.search(rf"```{lang}\n(.*?)```", body, re.S).group(1)  # type: ignore[union-attr]


def run_python(state: Path, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=180,
        env=env_for(state),
    )


def readme_gpu_and_quota_examples_run(state: Path, tmp_path: Path) -> None:
    """The README's GPU and quota examples, as written, against the running mesh."""
    gpu = run_python(state, readme_example("## Reward and judge models on pooled GPUs"))
    assert gpu.returncode == 0, gpu.stderr
    assert gpu.stdout.startswith("succeeded "), gpu.stdout
    quota_section = "## Rate-limited APIs under one cluster-wide quota"
    shell = readme_example(quota_section, "sh")
    env = env_for(state)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # an activated venv
    pidfile = tmp_path / "http-server.pid"
    out = tmp_path / "readme-sh.log"
    with out.open("w") as log:  # a file, not a pipe: the server in the background keeps it open
        setup = subprocess.run(
            ["bash", "-c", f"{shell}\necho $! > {pidfile}"],
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=60,
            env=env,
            cwd=tmp_path,
        )
    try:
        assert setup.returncode == 0, out.read_text()
        quota = run_python(state, readme_example(quota_section))
        assert quota.returncode == 0, quota.stderr
        assert quota.stdout.startswith("succeeded 200 "), quota.stdout
    finally:
        if pidfile.exists():  # the stand-in API we started (gone already if it could not bind)
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pidfile.read_text()), signal.SIGTERM)


@pytest.mark.slow
def test_a_newcomers_first_hour(tmp_path: Path):
    state = tmp_path / "state"
    up = subprocess.Popen(
        [*TANGRAM, "up", "--backend", "process"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env_for(state),
        start_new_session=True,  # its own process group, as a shell gives a foreground job
    )
    try:
        wait_up(up)
        mesh_json = (state / "mesh.json").read_text()
        assert f'"pid": {up.pid}' in mesh_json

        # 6: a second mesh on the same state dir says who holds it, and starts nothing
        second = tangram(state, "up", "--backend", "process")
        assert second.returncode != 0
        assert f"in use by pid {up.pid}" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr

        # 1, 7: exec finds the mesh, prints the action id, runs in the trajectory's env
        ran = tangram(state, "exec", "--cpus", "1-2", "--", "echo dop={dop} > f; cat f")
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.startswith("dop=")
        action_id = re.search(r"tangram: action (\S+)", ran.stderr).group(1)  # type: ignore[union-attr]
        res = tangram(state, "result", action_id)
        assert res.returncode == 0, res.stderr
        assert res.stdout.startswith("dop=")

        # 7: a bad --cpus is one line; 4: an impossible one fails at once, naming the node
        bad = tangram(state, "exec", "--cpus", "abc", "--", "true")
        assert bad.returncode == 2
        assert "Traceback" not in bad.stderr
        assert "'abc' is not a core count" in bad.stderr
        cores = os.cpu_count() or 2
        t0 = time.monotonic()
        big = tangram(state, "exec", "--cpus", str(cores + 1), "--", "true")
        assert big.returncode == 125, big.stderr
        assert "invalid_request" in big.stderr
        assert "no node can hold it" in big.stderr
        assert re.search(r"node node0, which has \d+", big.stderr), big.stderr
        assert time.monotonic() - t0 < 20
        after = tangram(state, "exec", "--", "echo still-served")
        assert after.stdout == "still-served\n", after.stderr

        # 7: cancel, status, close-env
        slow = subprocess.Popen(
            [*TANGRAM, "exec", "--trajectory", "slow", "--", "sleep 60"],
            stderr=subprocess.PIPE,
            text=True,
            env=env_for(state),
        )
        assert slow.stderr is not None
        slow_id = slow.stderr.readline().split()[-1]
        status = tangram(state, "status")
        assert status.returncode == 0, status.stderr
        assert "NODE" in status.stdout
        assert "node0" in status.stdout
        cancelled = tangram(state, "cancel", slow_id)
        assert cancelled.returncode == 0, cancelled.stderr
        _, said = slow.communicate(timeout=30)
        assert slow.returncode == 125
        assert "cancelled" in said
        assert tangram(state, "close-env", "slow").returncode == 0

        # 2: the README's example, as written, with no URL
        example = subprocess.run(
            [sys.executable, "-c", readme_example()],
            capture_output=True,
            text=True,
            timeout=120,
            env=env_for(state),
        )
        assert example.returncode == 0, example.stderr
        assert example.stdout.startswith("succeeded 0"), example.stdout
        readme_gpu_and_quota_examples_run(state, tmp_path)
    finally:
        os.killpg(up.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        rest, _ = up.communicate(timeout=120)
    assert up.returncode == 0, rest
    assert "Traceback" not in rest
    assert not (state / "mesh.json").exists()
    for log in (state / "logs").glob("*.log"):
        assert "Traceback" not in log.read_text(), log.name
    assert 'role "root" does not exist' not in (state / "postgres" / "postgres.log").read_text()

    # 1: with the mesh gone, its mesh.json is gone too and a client says where it looked
    gone = tangram(state, "exec", "--", "true", timeout=60)
    assert gone.returncode == 2
    assert "cannot connect to NATS at nats://127.0.0.1:4222" in gone.stderr
    assert len(gone.stderr.strip().splitlines()) == 1, gone.stderr

    # 5: a restarted mesh on the same state dir: the environment's loss is said once
    up = subprocess.Popen(
        [*TANGRAM, "up", "--backend", "process"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env_for(state),
        start_new_session=True,
    )
    try:
        wait_up(up)
        lost = tangram(state, "exec", "--", "true")
        assert lost.returncode == 125, lost.stderr
        assert "environment_lost" in lost.stderr, lost.stderr
        fresh = tangram(state, "exec", "--", "echo fresh")
        assert fresh.returncode == 0, fresh.stderr
        assert fresh.stdout == "fresh\n"
    finally:
        os.killpg(up.pid, signal.SIGINT)
        up.communicate(timeout=120)
    assert up.returncode == 0
