"""Environment tiering without an engine: the policy, the snapshot store, crashes mid-write."""

from __future__ import annotations

import hashlib
import io
import os
import signal
import stat
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from services.cpu_manager.config import load_own
from services.cpu_manager.docker.snapshots import (
    META_NAME,
    SnapshotError,
    SnapshotMeta,
    SnapshotStore,
)
from services.cpu_manager.docker.tiers import EnvView, Move, Tier, TierPolicy, plan
from tangram import subjects
from tangram.agent import Agent
from tangram.agent.core import AgentConfig, AgentCore, Publish
from tangram.contract import Inventory, NodeReport
from tangram.errors import InvalidRequest
from tangram.membus import MemoryBroker

from ..support import eventually
from .test_agent_shell import FakeExecutor, FakeScheduler

ROOT = Path(__file__).resolve().parents[2]


def view(tid: str, tier: Tier, last: float, mb: int = 100, busy: bool = False) -> EnvView:
    return EnvView(tid, tier, last, mb, busy)


# ------------------------------------------------------------------ policy


def test_idle_time_pauses_then_moves_to_disk() -> None:
    policy = TierPolicy(pause_after_s=10, disk_after_s=100)
    envs = [
        view("fresh", Tier.RUNNING, 95),
        view("idle", Tier.RUNNING, 80),
        view("old", Tier.PAUSED, 0),
        view("gone", Tier.DISK, -50),
    ]
    assert plan(envs, 100, policy) == [Move("old", Tier.DISK), Move("idle", Tier.PAUSED)]


def test_an_environment_in_use_is_never_moved() -> None:
    policy = TierPolicy(pause_after_s=1, disk_after_s=2, budget_mb=1)
    assert plan([view("busy", Tier.RUNNING, 0, busy=True)], 100, policy) == []


def test_memory_pressure_sends_the_longest_idle_to_disk_until_under_budget() -> None:
    policy = TierPolicy(pause_after_s=0, disk_after_s=0, budget_mb=250, pressure_min_idle_s=5)
    envs = [
        view("a", Tier.RUNNING, 10),  # oldest
        view("b", Tier.PAUSED, 20),
        view("c", Tier.RUNNING, 30),
        view("just-used", Tier.RUNNING, 98),  # idle < 5 s: kept though over budget
        view("busy", Tier.RUNNING, 0, busy=True),
        view("disk", Tier.DISK, 0, mb=10_000),  # holds no memory
    ]
    # 500 MiB resident, 250 allowed: a and b, then c would be one too many
    assert (
        plan(envs, 100, policy)
        == [Move("a", Tier.DISK), Move("b", Tier.DISK), Move("c", Tier.DISK)][:3]
    )
    assert {m.trajectory_id for m in plan(envs, 100, policy)} == {"a", "b", "c"}


def test_zero_thresholds_switch_the_rules_off() -> None:
    assert plan([view("x", Tier.RUNNING, 0)], 1e9, TierPolicy(0, 0, 0)) == []


# ------------------------------------------------------------------ snapshots


def make_tree(root: Path) -> None:
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "main.py").write_text("print('hi')\n")
    (root / "src" / "pkg" / "key").write_bytes(os.urandom(1000))
    (root / "src" / "pkg" / "key").chmod(0o600)
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o4755)  # setuid kept: the same modes, exactly
    (root / "empty").touch()
    (root / "link").symlink_to("/usr/bin/python3")
    (root / "src").chmod(0o750)


def manifest(root: Path) -> dict[str, tuple[object, ...]]:
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            p = Path(dirpath) / name
            st = p.lstat()
            body: object = None
            if stat.S_ISLNK(st.st_mode):
                body = os.readlink(p)
            elif stat.S_ISREG(st.st_mode):
                body = hashlib.sha256(p.read_bytes()).hexdigest()
            out[str(p.relative_to(root))] = (st.st_mode, st.st_uid, st.st_size, body)
    return out


def meta(tid: str = "t/1 é") -> SnapshotMeta:
    return SnapshotMeta(trajectory_id=tid, image="img:1", memory_mb=256, last_used=5.0)


def test_a_snapshot_restores_exactly_the_files_and_modes(tmp_path: Path) -> None:
    make_tree(tmp_path / "env" / "work")
    store = SnapshotStore(tmp_path / "snaps")
    saved = store.save(meta(), tmp_path / "env" / "work")
    assert saved.size_bytes > 1000
    assert store.scan() == {"t/1 é": saved}
    assert store.restore("t/1 é", tmp_path / "new") == saved
    assert manifest(tmp_path / "new" / "work") == manifest(tmp_path / "env" / "work")
    store.delete("t/1 é")
    assert store.scan() == {}


def _bad_snapshot(path: Path, meta_bytes: bytes, extra: tuple[str, bytes] | None = None) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in [(META_NAME, meta_bytes), *([extra] if extra else [])]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize(
    "content",
    [
        b"not a tar at all",
        b"",
        "tar:{}",
        'tar:{"trajectory_id": "x", "image": "i", "memory_mb": 0}',
        'tar:{"trajectory_id": "x", "image": "i", "memory_mb": 1, "version": 99}',
        'tar:{"trajectory_id": "x", "image": "i", "memory_mb": 1, "surprise": 1}',
        "tar:[1, 2]",
    ],
)
def test_unreadable_snapshots_are_set_aside_and_the_rest_kept(
    tmp_path: Path, content: bytes | str
) -> None:
    store = SnapshotStore(tmp_path)
    make_tree(tmp_path / "w" / "work")
    store.save(meta("good"), tmp_path / "w" / "work")
    bad = tmp_path / ("0" * 32 + ".tar")
    if isinstance(content, str):
        _bad_snapshot(bad, content.removeprefix("tar:").encode())
    else:
        bad.write_bytes(content)
    assert list(store.scan()) == ["good"]
    assert not bad.exists()
    assert bad.with_suffix(".bad").exists()


def test_a_snapshot_escaping_its_directory_is_refused(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "s")
    store.dir.mkdir()
    good = b'{"trajectory_id": "x", "image": "i", "memory_mb": 1}'
    _bad_snapshot(store.path("x"), good, ("work/../../escaped", b"boom"))
    with pytest.raises(SnapshotError):
        store.restore("x", tmp_path / "dest")
    assert not (tmp_path / "escaped").exists()


def test_a_snapshot_of_another_trajectory_is_refused(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    make_tree(tmp_path / "w" / "work")
    store.save(meta("a"), tmp_path / "w" / "work")
    store.path("a").rename(store.path("b"))
    with pytest.raises(SnapshotError, match="holds 'a'"):
        store.restore("b", tmp_path / "dest")


# ------------------------------------------------------------------ kill -9

SLOW = """
import sys, tarfile, time
from pathlib import Path
from services.cpu_manager.docker.snapshots import SnapshotMeta, SnapshotStore
for name in ("addfile", "makefile"):
    real = getattr(tarfile.TarFile, name)
    def slow(self, *a, _real=real, **k):
        time.sleep(0.004)
        return _real(self, *a, **k)
    setattr(tarfile.TarFile, name, slow)
store = SnapshotStore(Path(sys.argv[2]))
if sys.argv[1] == "save":
    meta = SnapshotMeta(trajectory_id="t", image="i", memory_mb=64)
    store.save(meta, Path(sys.argv[3]))
else:
    store.restore("t", Path(sys.argv[3]))
"""


def many_files(root: Path, n: int = 400) -> None:
    root.mkdir(parents=True)
    for i in range(n):
        (root / f"f{i:04}").write_bytes(os.urandom(4096))


def _kill_when(proc: subprocess.Popen[bytes], ready: Path, min_bytes: int) -> None:
    """SIGKILL the child once ``ready`` holds ``min_bytes`` (it is mid-write)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"child ended before the kill: {proc.returncode}")
        size = ready.stat().st_size if ready.is_file() else _tree_size(ready)
        if size >= min_bytes:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return
        time.sleep(0.002)  # polling a child process, not waiting for our own event loop
    proc.kill()
    pytest.fail("child never got mid-write")


def _tree_size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0


def _child(*args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'libs'}"}
    return subprocess.Popen([sys.executable, "-c", SLOW, *args], env=env, cwd=ROOT)


def test_kill_9_mid_snapshot_leaves_no_half_snapshot_and_the_files_untouched(
    tmp_path: Path,
) -> None:
    work, snaps = tmp_path / "work", tmp_path / "snaps"
    many_files(work)
    before = manifest(work)
    proc = _child("save", str(snaps), str(work))
    _kill_when(proc, snaps / (SnapshotStore(snaps).path("t").name + ".tmp"), 200_000)
    assert not SnapshotStore(snaps).path("t").exists()  # never a half snapshot by its name
    assert SnapshotStore(snaps).scan() == {}  # the half-written temp file is deleted
    assert list(snaps.iterdir()) == []
    assert manifest(work) == before  # the environment is as it was


def test_kill_9_mid_restore_keeps_the_complete_snapshot(tmp_path: Path) -> None:
    work, snaps = tmp_path / "work", tmp_path / "snaps"
    many_files(work)
    store = SnapshotStore(snaps)
    store.save(SnapshotMeta(trajectory_id="t", image="i", memory_mb=64), work)
    digest = hashlib.sha256(store.path("t").read_bytes()).hexdigest()
    proc = _child("restore", str(snaps), str(tmp_path / "half"))
    _kill_when(proc, tmp_path / "half", 200_000)
    assert hashlib.sha256(store.path("t").read_bytes()).hexdigest() == digest
    assert list(store.scan()) == ["t"]
    store.restore("t", tmp_path / "again")  # the next try gets everything
    assert manifest(tmp_path / "again" / "work") == manifest(work)


# ------------------------------------------------------------------ config and reports


@pytest.mark.parametrize(
    ("name", "value", "field"),
    [
        ("TANGRAM_CPU_TIER_PAUSE_AFTER_S", "-1", "$.docker.tier_pause_after_s"),
        ("TANGRAM_CPU_TIER_DISK_AFTER_S", "soon", "$.docker.tier_disk_after_s"),
        ("TANGRAM_CPU_TIER_BUDGET_MB", "-5", "$.docker.tier_budget_mb"),
        ("TANGRAM_CPU_TIER_TICK_S", "0", "$.docker.tier_tick_s"),
    ],
)
def test_bad_tiering_settings_fail_loudly_naming_the_field(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, field: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidRequest) as err:
        load_own()
    assert f"at `{field}`" in str(err.value)


def test_tiering_settings_reach_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANGRAM_CPU_TIER_BUDGET_MB", "4096")
    monkeypatch.setenv("TANGRAM_CPU_TIER_PAUSE_AFTER_S", "0")
    policy = load_own({"node_id": "n"}).docker.tier_policy()
    assert (policy.budget_mb, policy.pause_after_s, policy.disk_after_s) == (4096, 0.0, 600.0)


def test_every_report_names_the_environments_on_disk() -> None:
    core = AgentCore(AgentConfig(node_id="n0", incarnation="inc"))
    core.on_disk = ("t2",)
    inv = Inventory(numa=(), memory_mb=1, backend="docker", isolates=True)
    (effect,) = core.register(inv, ["t1", "t2"], 0.0)
    assert isinstance(effect, Publish)
    assert isinstance(effect.msg, NodeReport)
    assert effect.msg.envs_on_disk == ("t2",)


class TieredExecutor(FakeExecutor):
    def envs(self) -> dict[str, float]:
        return {"t1": 1.0, "t2": 2.0}

    def envs_on_disk(self) -> tuple[str, ...]:
        return ("t2",)


async def test_the_agent_registers_and_heartbeats_with_its_environments_on_disk() -> None:
    broker = MemoryBroker()
    scheduler, sbus = FakeScheduler(), broker.connect("scheduler")
    sbus.serve(subjects.SCHED_NODES, scheduler.on_node, max_in_flight=1)
    await sbus.start()
    bus = broker.connect("agent")
    cfg = AgentConfig(node_id="n0", incarnation="inc", heartbeat_s=0.02)
    agent = Agent(bus, TieredExecutor(), cfg)
    try:
        await agent.start()
        await eventually(lambda: len(scheduler.of(NodeReport)) >= 2, what="two reports")
        assert all(r.envs_on_disk == ("t2",) for r in scheduler.of(NodeReport))
    finally:
        await agent.stop(0.1)
        await bus.close()
        await sbus.close()
