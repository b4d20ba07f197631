"""Environment tiering against a real engine: paused and on-disk environments come back whole."""

from __future__ import annotations

import asyncio
import hashlib
import os
import stat
from pathlib import Path
from typing import Any

import msgspec
import pytest
from exec_requests import ok, request_for

from services.cpu_manager.docker.backend import DockerBackend
from services.cpu_manager.docker.engine import Engine
from services.cpu_manager.docker.tiers import Tier
from tangram.contract import ErrorKind
from tests.support import eventually

pytestmark = pytest.mark.docker

# Tiers moved by calling tick() in the test: thresholds of 0 s would switch a rule off, so tiny
# ones; a tick period the test never reaches.
TIERED: dict[str, Any] = {
    "tier_pause_after_s": 1e-6,
    "tier_disk_after_s": 1e-6,
    "tier_tick_s": 3600.0,
    "exec_mode": "executor",
}
PAUSE_ONLY: dict[str, Any] = TIERED | {"tier_disk_after_s": 0.0}

MAKE_FILES = r"""
set -e
cd /work
mkdir -p src/pkg deep/a/b/c
printf 'print("hi")\n' > src/main.py
printf 'secret' > src/pkg/key && chmod 600 src/pkg/key
printf '#!/bin/sh\necho run\n' > run.sh && chmod 755 run.sh
printf 'ro' > readonly && chmod 444 readonly
: > empty
head -c 300000 /dev/urandom > blob.bin
chmod 700 deep/a
ln -s /usr/bin/python3 py
ln -s src/main.py main-link
"""


def manifest(root: Path) -> dict[str, tuple[object, ...]]:
    """Every file under ``root``: kind, mode, owner, size, content hash or link target."""
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = Path(dirpath) / name
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                what: object = os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                what = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                what = None
            rel = str(path.relative_to(root))
            out[rel] = (
                stat.S_IFMT(st.st_mode),
                stat.S_IMODE(st.st_mode),
                st.st_uid,
                st.st_size,
                what,
            )
    return out


async def test_an_environment_on_disk_comes_back_with_exactly_its_files(
    backend_factory: Any,
) -> None:
    backend: DockerBackend = await backend_factory(**TIERED)
    ok(await backend.run(request_for("tier-files", MAKE_FILES)))
    env = backend.env("tier-files")
    before = manifest(env.spec.host_dir / "work")
    old_container = env.container_id

    await backend.tiers.tick()

    assert backend.tiers.tier_of("tier-files") is Tier.DISK
    assert backend.envs_on_disk() == ("tier-files",)
    assert "tier-files" in backend.envs()  # still the trajectory's, for its TTL
    assert await backend.call(backend.engine.state, old_container) is None  # memory released
    assert not env.spec.host_dir.exists()

    out = ok(await backend.run(request_for("tier-files", "cat src/pkg/key; ./run.sh")))
    assert out == "secretrun\n"
    restored = backend.env("tier-files")
    assert restored.container_id != old_container
    assert manifest(restored.spec.host_dir / "work") == before
    assert backend.envs_on_disk() == ()
    assert not backend.tiers.store.path("tier-files").exists()  # restored: one copy only


KEEPER = r"""
import os, sys, time, uuid
if os.fork():
    sys.exit(0)
os.setsid()
fd = os.open(os.devnull, os.O_RDWR)
for n in (0, 1, 2):
    os.dup2(fd, n)
value, count = uuid.uuid4().hex, 0
while True:
    count += 1
    with open("/work/state.tmp", "w") as f:
        f.write(f"{os.getpid()} {value} {count}")
    os.replace("/work/state.tmp", "/work/state")
    time.sleep(0.02)
"""


def _state(backend: DockerBackend, tid: str) -> tuple[str, str, int]:
    text = (backend.env(tid).spec.host_dir / "work" / "state").read_text()
    pid, value, count = text.split()
    return pid, value, int(count)


async def test_pause_then_resume_keeps_the_processes_and_their_memory(
    backend_factory: Any,
) -> None:
    backend: DockerBackend = await backend_factory(**PAUSE_ONLY)
    tid = "tier-pause"
    ok(await backend.run(request_for(tid, f"cat > /work/keep.py <<'EOF'\n{KEEPER}\nEOF")))
    ok(await backend.run(request_for(tid, "python3 /work/keep.py")))
    await eventually(
        lambda: (backend.env(tid).spec.host_dir / "work" / "state").exists(), what="keeper up"
    )
    container = backend.env(tid).container_id

    await backend.tiers.tick()
    assert backend.tiers.tier_of(tid) is Tier.PAUSED
    frozen = _state(backend, tid)
    state = await backend.call(backend.engine.state, container)
    assert state is not None
    assert state["Paused"]
    assert _state(backend, tid) == frozen  # frozen: not one more write

    ok(await backend.run(request_for(tid, "true")))  # the next action thaws it first
    assert backend.tiers.tier_of(tid) is Tier.RUNNING
    assert backend.env(tid).container_id == container
    await eventually(lambda: _state(backend, tid)[2] > frozen[2], what="keeper runs again")
    pid, value, _ = _state(backend, tid)
    assert (pid, value) == frozen[:2]  # the same process, the same value in its memory
    await backend.tiers.tick()  # paused again, then the backend closes: nothing is left
    assert backend.tiers.tier_of(tid) is Tier.PAUSED
    await backend.close()
    engine = Engine(backend.cfg)
    await asyncio.to_thread(engine.connect)
    try:
        assert await asyncio.to_thread(engine.state, container) is None
    finally:
        engine.close()


async def test_a_restarted_agent_takes_back_its_environments_on_disk(
    backend_factory: Any, docker_config: Any
) -> None:
    cfg = docker_config(**TIERED)
    first = DockerBackend(cfg)
    await first.start()
    try:
        ok(await first.run(request_for("tier-restart", "echo kept > /work/note")))
        await first.tiers.tick()
        assert first.envs_on_disk() == ("tier-restart",)
    finally:
        await first.close()

    again = msgspec.structs.replace(cfg, incarnation="next-incarnation", warm_pool=1)
    second: DockerBackend = await backend_factory(**msgspec.structs.asdict(again))
    assert second.envs_on_disk() == ("tier-restart",)
    await second.pool.wait_full(timeout_s=30)
    assert ok(await second.run(request_for("tier-restart", "cat /work/note"))) == "kept\n"
    assert second.stats["pool_restores"] == 1  # restored into a warm container


async def test_dropping_an_environment_on_disk_deletes_its_snapshot(backend_factory: Any) -> None:
    backend: DockerBackend = await backend_factory(**TIERED)
    ok(await backend.run(request_for("tier-drop", "echo x > /work/f")))
    await backend.tiers.tick()
    path = backend.tiers.store.path("tier-drop")
    assert path.exists()
    await backend.drop_env("tier-drop")
    assert not path.exists()
    assert "tier-drop" not in backend.envs()
    again = await backend.run(request_for("tier-drop", "cat /work/f"))
    assert again.failure is None
    assert again.exit_code != 0


async def test_an_unreadable_snapshot_fails_its_action_and_the_backend_keeps_serving(
    backend_factory: Any,
) -> None:
    backend: DockerBackend = await backend_factory(**TIERED)
    ok(await backend.run(request_for("tier-bad", "echo x > /work/f")))
    await backend.tiers.tick()
    path = backend.tiers.store.path("tier-bad")
    path.write_bytes(path.read_bytes()[:700])  # cut mid-archive: not a snapshot any more
    lost = await backend.run(request_for("tier-bad", "cat /work/f"))
    assert lost.failure is ErrorKind.ENVIRONMENT_LOST
    ok(await backend.run(request_for("tier-bad", "true")))  # a fresh environment next
    ok(await backend.run(request_for("tier-other", "true")))
