"""``tangram-dropuid``, the launcher that gives up root before a trajectory's action
(``process.dropuid``): built once into a directory only root may change, rebuilt when its file
could have been changed by anyone else, refused in a directory others may write (setpriv is
used then); it leaves nothing of root behind, never runs the program when it cannot drop root
or is misused, and the loader variables an action sets act only once root is gone, through it
or through setpriv (``users.as_uid``)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from services.cpu_manager.cpulist import format_cpulist, parse_cpulist
from services.cpu_manager.process import dropuid, users

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping root needs root")
UID = users.UID_BASE + 123
SYSTEM = {"PATH": dropuid.SYSTEM_PATH}
RAN = ("sh", "-c", "echo RAN")


def run(
    argv: tuple[str, ...], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(argv, capture_output=True, env=env or SYSTEM, timeout=30)


@pytest.fixture
def helper(tmp_path: Path) -> Path:
    built, why = dropuid.launcher(tmp_path / "bin")
    assert built is not None, why
    return built


@pytest.fixture
def open_dir(open_state: Path) -> Path:
    """A directory every uid may reach and write (pytest's own temp dirs are closed)."""
    os.chmod(open_state, 0o777)
    return open_state


def test_built_once_and_leaves_nothing_of_root(tmp_path: Path, helper: Path) -> None:
    assert dropuid.trusted(helper)
    built_at = helper.stat().st_mtime_ns
    assert dropuid.launcher(tmp_path / "bin") == (helper, "")
    assert helper.stat().st_mtime_ns == built_at  # found, not built again

    status = "id -u; id -G; grep -E '^(NoNewPrivs|CapPrm|CapEff|CapAmb):' /proc/self/status"
    said = run((str(helper), str(UID), str(UID), "--", "sh", "-c", status))
    assert said.returncode == 0, said.stderr
    uid, groups, *fields = said.stdout.decode().splitlines()
    assert (int(uid), groups) == (UID, str(UID))  # its own group alone: none of root's
    got = dict(line.split(":") for line in fields)
    assert {k: v.strip() for k, v in got.items()} == {
        "NoNewPrivs": "1",  # su, sudo: no way back to root
        "CapPrm": "0000000000000000",
        "CapEff": "0000000000000000",
        "CapAmb": "0000000000000000",
    }


def test_a_file_others_could_change_is_built_again(tmp_path: Path, helper: Path) -> None:
    helper.write_bytes(b"#!/bin/sh\necho owned\n")
    os.chmod(helper, 0o777)
    assert not dropuid.trusted(helper)
    again, why = dropuid.launcher(tmp_path / "bin")
    assert again == helper, why
    assert dropuid.trusted(helper)
    assert run((str(helper), str(UID), str(UID), "--", "id", "-u")).stdout.strip() == b"%d" % UID


def test_a_directory_others_may_write_is_refused(tmp_path: Path, open_dir: Path) -> None:
    writable = tmp_path / "bin"
    writable.mkdir()
    os.chmod(writable, 0o777)
    helper, why = dropuid.launcher(writable)
    assert helper is None
    assert "may be changed by users other than root" in why
    os.chmod(open_dir, 0o711)
    said = users.run_as(open_dir / "envs", bin_dir=writable)
    if users.SETPRIV is None:
        assert not said.per_trajectory
        assert "no setpriv" in said.why
    else:
        assert said.per_trajectory
        assert said.launcher == users.SETPRIV
        assert "(setpriv: no tangram-dropuid: " in said.line()


@pytest.mark.parametrize(
    "head",
    [
        ("0", "5", "--"),  # root
        ("5", "0", "--"),
        ("4294967295", "5", "--"),  # (uid_t)-1: "unchanged" to setresuid
        ("5", "4294967295", "--"),
        ("4294967296", "5", "--"),
        ("-1", "5", "--"),
        ("+5", "5", "--"),
        (" 5", "5", "--"),
        ("x", "5", "--"),
        ("", "5", "--"),
        ("5", "5"),  # no "--"
        ("5", "5", "NOEQUALS", "--"),
        ("5", "5", "=x", "--"),
        ("-c", "", "5", "5", "--"),  # -c: a kernel cpulist, "0-3,8"
        ("-c", "x", "5", "5", "--"),
        ("-c", "0,", "5", "5", "--"),
        ("-c", ",0", "5", "5", "--"),
        ("-c", "0,,1", "5", "5", "--"),
        ("-c", "3-1", "5", "5", "--"),  # a range downwards
        ("-c", "0-", "5", "5", "--"),
        ("-c", "0--1", "5", "5", "--"),
        ("-c", "0-1-2", "5", "5", "--"),
        ("-c", " 0", "5", "5", "--"),
        ("-c", "+0", "5", "5", "--"),
        ("-c", "-0", "5", "5", "--"),
        ("-c", "65536", "5", "5", "--"),
        ("-c", "99999999999999999999999", "5", "5", "--"),
        ("-c", "65535", "5", "5", "--"),  # no such CPU here
        ("-c", "0", "5", "5"),
        ("-c",),
    ],
)
def test_misuse_never_runs_the_program(helper: Path, head: tuple[str, ...]) -> None:
    said = run((str(helper), *head, *RAN))
    assert said.returncode == 125, said
    assert b"RAN" not in said.stdout
    assert said.stderr.startswith((b"tangram-dropuid: ", b"usage: tangram-dropuid"))


def test_k_kills_every_process_of_the_uid_and_nothing_else(helper: Path) -> None:
    """``-k UID GID``: SIGKILL to all of UID's processes at once (kill(-1) as UID), none of
    another uid's; 0 when there were some and when there were none left."""
    procs = {(uid, k): as_uid(helper, uid) for uid in (UID, UID + 1) for k in range(2)}
    try:
        said = run((str(helper), "-k", str(UID), str(UID)))
        assert (said.returncode, said.stderr) == (0, b"")
        for (uid, _), proc in procs.items():
            if uid == UID:
                assert proc.wait(timeout=10) == -9
            else:
                assert proc.poll() is None  # another uid's: untouched
        assert run((str(helper), "-k", str(UID), str(UID))).returncode == 0  # none left
    finally:
        for proc in procs.values():
            ended(proc)


def as_uid(helper: Path, uid: int) -> subprocess.Popen[bytes]:
    """A ``sleep`` as ``uid``, returned once it runs as that uid (it has said so)."""
    proc = subprocess.Popen(
        (str(helper), str(uid), str(uid), "--", "sh", "-c", "echo up; exec sleep 60"),
        stdout=subprocess.PIPE,
        env=SYSTEM,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"up\n"  # root is gone before sh runs
    return proc


def ended(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait(timeout=10)
    if proc.stdout is not None:
        proc.stdout.close()


@pytest.mark.parametrize(
    "args",
    [
        ("-k",),
        ("-k", "U"),
        ("-k", "U", "U", "--"),
        ("-k", "U", "U", "--", "true"),
        ("-k", "0", "U"),
        ("-k", "U", "x"),
        ("-k", "", "U"),
    ],
)
def test_k_misused_kills_nothing(helper: Path, args: tuple[str, ...]) -> None:
    """Each misuse names the victim's own uid (U) where it names one."""
    victim = as_uid(helper, UID)
    try:
        said = run((str(helper), *(str(UID) if a == "U" else a for a in args)))
        assert said.returncode == 125, said
        assert said.stderr.startswith((b"tangram-dropuid: ", b"usage: tangram-dropuid"))
        assert victim.poll() is None
    finally:
        ended(victim)


@pytest.mark.skipif(users.SETPRIV is None, reason="setpriv runs it without root")
def test_a_launcher_that_cannot_drop_root_never_runs_the_program(helper: Path) -> None:
    assert users.SETPRIV is not None
    nobody = (users.SETPRIV, "--reuid=65534", "--regid=65534", "--clear-groups", "--")
    said = run((*nobody, str(helper), str(UID), str(UID), "--", *RAN))
    assert said.returncode == 125
    assert b"RAN" not in said.stdout
    assert b"cannot become" in said.stderr


def test_pinned_to_its_cpus_before_the_program_runs(helper: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    for pinned in ([cpus[-1]], cpus):  # a range, where the machine has two CPUs or more
        listed = format_cpulist(pinned)
        argv = ("grep", "Cpus_allowed_list", "/proc/self/status")
        said = run((str(helper), "-c", listed, str(UID), str(UID), "--", *argv))
        assert said.returncode == 0, said.stderr
        assert parse_cpulist(said.stdout.split()[-1].decode()) == set(pinned)


@pytest.mark.parametrize("head", [(), ("-c", "0")])
def test_a_file_without_a_hash_bang_is_126_not_run_by_sh(
    helper: Path, open_dir: Path, head: tuple[str, ...]
) -> None:
    """As CPython's subprocess (and the process backend without a launcher) says it; exec(3)'s
    execvp would run it through /bin/sh."""
    plain = open_dir / "plain"
    plain.write_text("echo RAN\n")
    os.chmod(plain, 0o755)
    env = {"PATH": f"{open_dir}:{dropuid.SYSTEM_PATH}"}
    for program in (str(plain), "plain"):
        said = run((str(helper), *head, str(UID), str(UID), "--", program), env)
        assert (said.returncode, said.stdout) == (126, b""), said
        assert said.stderr == f"{program}: Exec format error\n".encode()


def test_a_missing_program_is_127(helper: Path) -> None:
    missing = run((str(helper), str(UID), str(UID), "--", "no-such-program-d7"))
    assert missing.returncode == 127
    assert missing.stderr == b"no-such-program-d7: command not found\n"  # as a shell says


def _preload(open_dir: Path) -> Path:
    """A library whose constructor notes the euid of every process that loads it."""
    source = open_dir / "note.c"
    source.write_text(
        "#include <stdio.h>\n#include <stdlib.h>\n#include <unistd.h>\n"
        "__attribute__((constructor)) static void note(void) {\n"
        '  FILE *f = fopen(getenv("NOTE"), "a");\n'
        '  if (f) { fprintf(f, "%d\\n", (int)geteuid()); fclose(f); }\n}\n'
    )
    lib = open_dir / "note.so"
    cc = shutil.which("cc", path=dropuid.SYSTEM_PATH)
    assert cc is not None
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(source)], check=True)
    os.chmod(lib, 0o755)
    return lib


@pytest.mark.parametrize("through", ["tangram-dropuid", "setpriv"])
def test_loader_variables_act_only_once_root_is_gone(
    helper: Path, open_dir: Path, through: str
) -> None:
    """An action's LD_PRELOAD (a file of its own) would run its code as root in a dynamic
    launcher started as root: it reaches the action, never the launcher."""
    if through == "setpriv" and users.SETPRIV is None:
        pytest.skip("no setpriv")
    launcher = str(helper) if through == "tangram-dropuid" else str(users.SETPRIV)
    lib, note = _preload(open_dir), open_dir / "note"
    env = {"PATH": "/usr/bin:/bin", "LD_PRELOAD": str(lib), "NOTE": str(note), "KEEP": "k"}
    argv, outer = users.as_uid(UID, ("sh", "-c", "echo $KEEP"), env, launcher)
    assert "LD_PRELOAD" not in outer
    assert outer["KEEP"] == "k"
    said = run(argv, outer)
    assert said.returncode == 0, said.stderr
    assert said.stdout == b"k\n"
    seen = note.read_text().split()
    assert seen  # it did reach the action (sh, and echo's process if any)
    assert set(seen) == {str(UID)}  # and loaded in no process running as root


@pytest.mark.skipif(users.SETPRIV is None, reason="no setpriv")
def test_env_after_setpriv_refuses_a_program_it_would_take_for_a_variable(open_dir: Path) -> None:
    assert users.SETPRIV is not None
    env = {"PATH": "/usr/bin:/bin", "LD_PRELOAD": "x.so"}
    with pytest.raises(OSError, match="name holds '='"):
        users.as_uid(UID, ("./a=b",), env, users.SETPRIV)
    argv, _ = users.as_uid(UID, ("./a=b",), {"PATH": "/usr/bin:/bin"}, users.SETPRIV)
    assert argv[-1] == "./a=b"  # no loader variables: no env(1), nothing to mistake
