"""Sandboxes are locked down by default; network is opt-in per environment."""

from __future__ import annotations

import pytest
from exec_requests import ok, request_for

from services.cpu_manager.docker.backend import DockerBackend
from tangram.contract import ErrorKind

pytestmark = pytest.mark.docker

REACH = (
    "import socket,sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)\n"
    "except OSError as e:\n"
    "    print('blocked', e); sys.exit(7)\n"
    "print('reached')\n"
)


@pytest.mark.parametrize(("host", "port"), [("1.1.1.1", 53), ("8.8.8.8", 443), ("10.0.0.1", 80)])
async def test_network_is_off_by_default(backend: DockerBackend, host: str, port: int) -> None:
    out = await backend.run(request_for("traj-net", ["python3", "-c", REACH, host, str(port)]))
    assert out.failure is None
    assert out.exit_code == 7, out.stdout
    assert b"unreachable" in out.stdout.lower()


async def test_only_loopback_exists(backend: DockerBackend) -> None:
    out = ok(await backend.run(request_for("traj-if", "ls /sys/class/net")))
    assert out.split() == ["lo"]


async def test_network_is_opt_in_per_environment(backend_factory) -> None:
    backend = await backend_factory(network_mode="host")
    out = ok(await backend.run(request_for("traj-on", "ls /sys/class/net", network=True)))
    assert out.split() != ["lo"]
    off = ok(await backend.run(request_for("traj-off", "ls /sys/class/net")))
    assert off.split() == ["lo"]


async def test_no_privileges_read_only_root_non_root_user(backend: DockerBackend) -> None:
    script = (
        "id -u; grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status | tr -s '\\t' ' ';"
        "touch /rootfile 2>/dev/null && echo rootfs-writable || echo rootfs-ro;"
        "touch /work/ok && echo work-writable; touch /tmp/ok && echo tmp-writable;"
        "test -e /var/run/docker.sock && echo docker-sock || echo no-docker-sock"
    )
    lines = ok(await backend.run(request_for("traj-lock", script))).splitlines()
    assert lines[0] != "0"
    assert "CapEff: 0000000000000000" in lines
    assert "CapBnd: 0000000000000000" in lines
    assert "NoNewPrivs: 1" in lines
    assert lines[-4:] == ["rootfs-ro", "work-writable", "tmp-writable", "no-docker-sock"]


async def test_memory_and_pids_limits(backend_factory) -> None:
    backend = await backend_factory(pids_limit=64)
    script = "cat /sys/fs/cgroup/pids/pids.max /sys/fs/cgroup/pids.max 2>/dev/null | head -1"
    assert ok(await backend.run(request_for("traj-pids", script))).strip() == "64"
    mem = "cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/memory.max 2>/dev/null"
    mem += "; true"
    out = ok(await backend.run(request_for("traj-pids", mem)))
    assert int(out.split()[0]) == 256 * 2**20


async def test_fork_bomb_is_contained(backend_factory) -> None:
    backend = await backend_factory(pids_limit=64)
    bomb = "for i in $(seq 200); do sleep 5 & done; wait"
    out = await backend.run(request_for("traj-bomb", bomb, timeout_s=3))
    assert b"fork" in out.stderr.lower() or b"resource" in out.stderr.lower()
    ok(await backend.run(request_for("traj-bomb", "true")))


async def test_a_planted_socket_is_not_trusted(backend_factory) -> None:
    """The ctl dir is writable by the sandbox: a socket swapped in there gets nothing."""
    backend = await backend_factory()
    ok(await backend.run(request_for("traj-plant", "true")))
    env = backend.env("traj-plant")
    script = (  # a listener that escapes the action's process group and answers anything
        "import os,socket,json,struct\n"
        "os.replace('/run/tangram/exec.sock', '/run/tangram/real.sock')\n"
        "s=socket.socket(socket.AF_UNIX); s.bind('/run/tangram/exec.sock'); s.listen(8)\n"
        "if os.fork() == 0:\n"
        "    os.setsid(); os.closerange(0, 3)\n"
        "    while True:\n"
        "        c,_=s.accept(); b=json.dumps({'ok':True,'pid':1}).encode()\n"
        "        c.sendall(struct.pack('>I',len(b))+b); c.close()\n"
    )
    ok(await backend.run(request_for("traj-plant", ["python3", "-c", script], timeout_s=5)))
    out = await backend.run(request_for("traj-plant", "true"))
    assert out.failure is ErrorKind.ENVIRONMENT_LOST
    assert "not served by the container's executor" in out.detail
    assert backend.env("traj-plant") is not env
