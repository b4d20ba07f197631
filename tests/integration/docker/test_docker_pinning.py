"""Allocate-on-execution: each action runs on exactly its granted cores, in its own container."""

from __future__ import annotations

import asyncio
import os

import pytest
from exec_requests import ok, request_for

from services.cpu_manager.action_env import tangram_vars
from services.cpu_manager.cpulist import format_cpulist
from services.cpu_manager.docker.backend import DockerBackend
from services.cpu_manager.docker.cgroup import PARK_QUOTA_US

pytestmark = pytest.mark.docker

CPUS = sorted(os.sched_getaffinity(0))
ALLOWED = "grep Cpus_allowed_list /proc/self/status | cut -f2"


def _core_sets() -> list[tuple[int, ...]]:
    sets = [(CPUS[0],), (CPUS[-1],), tuple(CPUS)]
    return list(dict.fromkeys(sets))


async def test_cpuset_inside_equals_granted_and_changes(backend: DockerBackend) -> None:
    seen = []
    for cores in _core_sets():
        out = ok(await backend.run(request_for("traj-pin", ALLOWED, cores)))
        seen.append(out.strip())
        assert out.strip() == _cpulist(cores)
    if len(CPUS) > 1:
        assert len(set(seen)) == len(seen), f"cpuset did not change between actions: {seen}"


QUOTA = (
    "cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us 2>/dev/null || cut -d' ' -f1 /sys/fs/cgroup/cpu.max"
)


async def test_cpu_quota_is_granted_cores_during_action_and_parked_after(backend_factory) -> None:
    backend = await backend_factory(exec_mode="executor", cpuset_via="auto")
    for cores in _core_sets():
        out = ok(await backend.run(request_for("traj-quota", QUOTA, cores)))
        assert int(out) == 100_000 * len(cores)
    env = backend.env("traj-quota")
    assert env is not None
    if env.cgroup is not None:  # between actions the container is throttled to 1% of a core
        name = "cpu.cfs_quota_us" if env.cgroup.version == 1 else "cpu.max"
        assert (env.cgroup.cpu_dir / name).read_text().split()[0] == "1000"


async def test_docker_update_path_parks_the_container_after_an_action(backend: DockerBackend):
    update = backend.cfg.cpuset_via == "docker"
    for cores in _core_sets():
        out = ok(await backend.run(request_for("traj-park", QUOTA, cores)))
        assert int(out) == 100_000 * len(cores)
        env = backend.env("traj-park")
        if update:  # docker's record is what `docker update` wrote last
            info = await backend.call(backend.engine.api.inspect_container, env.container_id)
            assert info["HostConfig"]["CpuQuota"] == PARK_QUOTA_US
        else:
            name = "cpu.cfs_quota_us" if env.cgroup.version == 1 else "cpu.max"
            assert (env.cgroup.cpu_dir / name).read_text().split()[0] == str(PARK_QUOTA_US)


async def test_dop_and_core_env_vars(backend: DockerBackend) -> None:
    cores = tuple(CPUS)
    out = ok(await backend.run(request_for("traj-dop", "echo $TANGRAM_DOP $TANGRAM_CORES", cores)))
    assert out.split() == [str(len(cores)), _cpulist(cores)]


async def test_tangram_variables_are_the_shared_ones_and_cannot_be_forged(backend: DockerBackend):
    forged = {"TANGRAM_CORES": "99", "TANGRAM_DOP": "64", "MINE": "1"}
    req = request_for("traj-vars", "env | grep ^TANGRAM_ | sort; echo $MINE", env=forged)
    out = ok(await backend.run(req)).splitlines()
    expected = sorted(f"{k}={v}" for k, v in tangram_vars(req, backend.cfg.node_id).items())
    assert out == [*expected, "1"]


async def test_two_trajectories_never_share_a_core(backend: DockerBackend) -> None:
    if len(CPUS) < 2:
        pytest.skip("needs two cores")
    probe = (
        "import os,time\n"
        "seen=set(); end=time.time()+0.6\n"
        "while time.time()<end:\n"
        "    seen.add(int(open('/proc/self/stat').read().rsplit(')',1)[1].split()[36]))\n"
        "print(sorted(os.sched_getaffinity(0)), sorted(seen))\n"
    )
    a, b = await asyncio.gather(
        backend.run(request_for("traj-a", ["python3", "-c", probe], (CPUS[0],))),
        backend.run(request_for("traj-b", ["python3", "-c", probe], (CPUS[1],))),
    )
    ran_a, ran_b = (_ran_on(ok(o)) for o in (a, b))
    assert ran_a == {CPUS[0]}
    assert ran_b == {CPUS[1]}


def _ran_on(stdout: str) -> set[int]:
    _affinity, ran = stdout.strip().split("] [")
    return {int(c) for c in ran.strip("[]").split(",") if c.strip()}


def _cpulist(cores: tuple[int, ...]) -> str:
    return format_cpulist(cores)
