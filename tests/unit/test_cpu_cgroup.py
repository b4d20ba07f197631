"""Finding and writing a container's cgroup files (pure parsing + a fake cgroupfs tree)."""

from __future__ import annotations

from pathlib import Path

from services.cpu_manager.docker.cgroup import locate, parse_oom_kills, parse_proc_cgroup

V1 = "4:memory:/docker/abc\n3:cpuset:/docker/abc\n2:cpu,cpuacct:/docker/abc\n0::/docker/abc\n"


def test_parse_proc_cgroup_v1_and_v2() -> None:
    paths = parse_proc_cgroup(V1)
    assert paths["cpuset"] == paths["cpuacct"] == paths[""] == "/docker/abc"
    assert parse_proc_cgroup("0::/system.slice/docker-abc.scope\n") == {
        "": "/system.slice/docker-abc.scope"
    }


def test_parse_oom_kills() -> None:
    assert parse_oom_kills("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n") == 3
    assert parse_oom_kills("low 0\nhigh 0\nmax 2\noom 1\noom_kill 1\n") == 1
    assert parse_oom_kills("oom_kill_disable 0\n") is None


def _fake_v1(tmp_path: Path, pid: int) -> tuple[Path, Path]:
    proc, root = tmp_path / "proc", tmp_path / "cg"
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "cgroup").write_text(V1)
    for ctrl in ("cpuset", "cpu,cpuacct", "memory"):
        d = root / ctrl / "docker" / "abc"
        d.mkdir(parents=True)
        (d / "cgroup.procs").write_text(f"{pid}\n")
    cs = root / "cpuset" / "docker" / "abc"
    (cs / "cpuset.cpus").write_text("0-7\n")
    mem = root / "memory" / "docker" / "abc"
    (mem / "memory.limit_in_bytes").write_text(str(256 * 2**20))
    (mem / "memory.memsw.limit_in_bytes").write_text(str(256 * 2**20))
    (mem / "memory.oom_control").write_text("oom_kill_disable 0\noom_kill 2\n")
    return proc, root


def test_locate_v1_and_write(tmp_path: Path) -> None:
    proc, root = _fake_v1(tmp_path, 42)
    cg = locate(42, root, proc)
    assert cg is not None
    assert cg.version == 1
    cg.set_cpus((2, 3, 5))
    assert cg.cpus() == "2-3,5"
    assert (cg.cpu_dir / "cpu.cfs_quota_us").read_text() == "300000"
    cg.park()
    assert (cg.cpu_dir / "cpu.cfs_quota_us").read_text() == "1000"
    assert cg.oom_kills() == 2
    cg.set_memory(512 * 2**20)
    assert (cg.memory_dir / "memory.limit_in_bytes").read_text() == str(512 * 2**20)
    assert (cg.memory_dir / "memory.memsw.limit_in_bytes").read_text() == str(512 * 2**20)


def test_locate_refuses_a_cgroup_the_pid_is_not_in(tmp_path: Path) -> None:
    proc, root = _fake_v1(tmp_path, 42)
    (root / "cpuset" / "docker" / "abc" / "cgroup.procs").write_text("7\n")
    assert locate(42, root, proc) is None
    assert locate(43, root, proc) is None


def test_locate_v2(tmp_path: Path) -> None:
    proc, root = tmp_path / "proc", tmp_path / "cg"
    (proc / "9").mkdir(parents=True)
    (proc / "9" / "cgroup").write_text("0::/system.slice/docker-abc.scope\n")
    d = root / "system.slice" / "docker-abc.scope"
    d.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu memory\n")
    (d / "cgroup.procs").write_text("9\n")
    (d / "cpuset.cpus").write_text("")
    cg = locate(9, root, proc)
    assert cg is not None
    assert cg.version == 2
    cg.set_cpus((1,))
    assert (d / "cpu.max").read_text() == "100000 100000"
    cg.set_memory(2**20)
    assert (d / "memory.max").read_text() == str(2**20)
