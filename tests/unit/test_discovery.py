"""Issue 10, items 1, 3 and 8 without a mesh: finding the mesh, a stale mesh.json, the state
dir lock, connection errors that say why, SyncClient.connect, no fallback in a container."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from services.cpu_manager.choice import CONTAINER_VAR, choose
from services.cpu_manager.config import load_own
from tangram import discovery
from tangram.bus import Bus
from tangram.client import Client, SyncClient
from tangram.discovery import free_port
from tangram.errors import TangramError, Unavailable


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_mesh_is_found_by_url_env_live_mesh_json_then_the_default_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv(discovery.URL_VAR, raising=False)
    assert discovery.find(None, tmp_path) == discovery.Found(
        discovery.DEFAULT_URL, "the default port"
    )
    (tmp_path / "mesh.json").write_text(json.dumps({"nats_url": "nats://x:1", "pid": dead_pid()}))
    assert discovery.find(None, tmp_path).url == discovery.DEFAULT_URL  # stale: its pid is gone
    discovery.write_mesh(tmp_path, "nats://127.0.0.1:5", "postgresql://p")
    assert discovery.find(None, tmp_path).url == "nats://127.0.0.1:5"
    monkeypatch.setenv(discovery.URL_VAR, "nats://env:7")
    assert discovery.find(None, tmp_path).url == "nats://env:7"
    assert discovery.find("nats://given:9", tmp_path).url == "nats://given:9"
    discovery.remove_mesh(tmp_path)
    assert not (tmp_path / "mesh.json").exists()


def test_a_state_dir_in_use_names_the_pid_holding_it(tmp_path: Path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, pathlib; from tangram.discovery import StateLock;"
            "lock = StateLock(pathlib.Path(sys.argv[1])); lock.acquire(); print('held', flush=True);"
            "sys.stdin.read()",
            str(tmp_path),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(TangramError, match=f"in use by pid {holder.pid}"):
            discovery.StateLock(tmp_path).acquire()
    finally:
        holder.communicate("")
    lock = discovery.StateLock(tmp_path)
    lock.acquire()  # free again once its holder is gone
    lock.acquire()  # idempotent
    lock.release()


async def test_a_connection_error_names_the_url_and_the_reason(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(discovery.URL_VAR, raising=False)
    url = f"nats://127.0.0.1:{free_port()}"
    with pytest.raises(Unavailable) as err:
        await Bus.connect(url, "t", deadline_s=0.5)
    text = str(err.value)
    assert text.startswith(f"cannot connect to NATS at {url}: ")
    assert text.split(": ", 1)[1].strip()  # a reason, even for a TimeoutError
    with pytest.raises(Unavailable, match=r"\(URL from given\)"):
        await Client.connect(url, connect_timeout_s=0.5)


def test_both_clients_connect_with_the_same_spelling():
    assert isinstance(SyncClient.__dict__["connect"], classmethod)
    assert isinstance(Client.__dict__["connect"], classmethod)
    with pytest.raises(Unavailable, match="cannot connect to NATS"):
        SyncClient.connect(
            f"nats://127.0.0.1:{free_port()}", request_timeout=1, connect_timeout_s=0.5
        )


async def test_inside_a_container_auto_never_falls_back_to_the_process_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    cfg = load_own({"docker_host": f"unix://{tmp_path}/none.sock"}, environ={})
    assert (await choose(cfg)).backend == "process"  # on a host: the fallback, said
    monkeypatch.setenv(CONTAINER_VAR, "1")
    with pytest.raises(Unavailable, match="no fallback to the process backend inside a container"):
        await choose(cfg)


def test_cpus_is_a_one_line_usage_error():
    done = subprocess.run(
        [sys.executable, "-m", "tangram.cli", "exec", "--cpus", "abc", "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TANGRAM_NATS_URL": "nats://127.0.0.1:1"},
    )
    assert done.returncode == 2
    assert "'abc' is not a core count" in done.stderr
    assert "Traceback" not in done.stderr


def test_help_is_plain_words_and_every_option_is_documented():
    from tangram.cli import parser

    ap = parser()
    assert "``" not in ap.format_help()
    sub = next(a for a in ap._actions if a.choices and "exec" in a.choices)  # type: ignore[operator]
    for name in ("exec", "cancel", "close-env", "result", "status", "health"):
        p = sub.choices[name]  # type: ignore[index]
        for action in p._actions:
            assert action.help, f"{name} {action.dest} has no help"
    assert "trajectory's own environment" in sub.choices["exec"].format_help()  # type: ignore[index]


def test_a_free_port_is_below_the_ephemeral_range_and_binds() -> None:
    """A port from the kernel's ephemeral range can be given to a connection's local end before
    the server it was picked for binds it (a gateway's ops endpoint once failed so in CI)."""
    low = discovery._ephemeral_low()
    for _ in range(20):
        port = discovery.free_port()
        assert discovery.LISTEN_PORTS.start <= port < min(low, discovery.LISTEN_PORTS.stop)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_free_port_when_the_ephemeral_range_starts_low(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing below the range to pick from (a kernel set to start it under 20000): the
    kernel's pick, not an error."""
    monkeypatch.setattr(discovery, "_ephemeral_low", lambda: 1024)
    port = discovery.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
