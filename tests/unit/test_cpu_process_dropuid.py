"""``tangram-dropuid``, the launcher that gives up root before a trajectory's action
(``process.dropuid``): built once into a directory only root may change, rebuilt when its file
could have been changed by anyone else, refused in a directory others may write (setpriv is
used then), and it leaves nothing of root behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from services.cpu_manager.process import dropuid, users

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping root needs root")
UID = users.UID_BASE + 123


def run(helper: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    env = {"PATH": "/usr/bin:/bin"}
    return subprocess.run([str(helper), *args], capture_output=True, env=env, timeout=30)


def test_built_once_and_leaves_nothing_of_root(tmp_path: Path) -> None:
    helper, why = dropuid.launcher(tmp_path / "bin")
    assert helper is not None, why
    assert dropuid.trusted(helper)
    built_at = helper.stat().st_mtime_ns
    assert dropuid.launcher(tmp_path / "bin") == (helper, "")
    assert helper.stat().st_mtime_ns == built_at  # found, not built again

    said = run(
        helper, str(UID), str(UID), "sh", "-c", "id -u; id -G; grep NoNewPrivs /proc/self/status"
    )
    assert said.returncode == 0, said.stderr
    uid, groups, no_new_privs = said.stdout.decode().splitlines()
    assert (int(uid), groups) == (UID, str(UID))  # its own group alone: none of root's
    assert no_new_privs.split() == ["NoNewPrivs:", "1"]  # su, sudo: no way back to root


def test_a_file_others_could_change_is_built_again(tmp_path: Path) -> None:
    helper, _ = dropuid.launcher(tmp_path / "bin")
    assert helper is not None
    helper.write_bytes(b"#!/bin/sh\necho owned\n")
    os.chmod(helper, 0o777)
    assert not dropuid.trusted(helper)
    again, why = dropuid.launcher(tmp_path / "bin")
    assert again == helper, why
    assert dropuid.trusted(helper)
    assert run(helper, str(UID), str(UID), "id", "-u").stdout.strip() == str(UID).encode()


def test_a_directory_others_may_write_is_refused(tmp_path: Path) -> None:
    open_dir = tmp_path / "bin"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    helper, why = dropuid.launcher(open_dir)
    assert helper is None
    assert "may be changed by users other than root" in why
    base = Path(tempfile.mkdtemp(prefix="tgd-", dir="/tmp"))  # pytest's dirs are closed
    os.chmod(base, 0o711)
    try:
        said = users.run_as(base / "envs", bin_dir=open_dir)
    finally:
        shutil.rmtree(base)
    if users.SETPRIV is None:
        assert not said.per_trajectory
        assert "no setpriv" in said.why
    else:
        assert said.per_trajectory
        assert said.launcher == users.SETPRIV
        assert "(setpriv: no tangram-dropuid: " in said.line()


def test_bad_ids_and_missing_programs_fail_as_a_shell_would(tmp_path: Path) -> None:
    helper, why = dropuid.launcher(tmp_path / "bin")
    assert helper is not None, why
    for args in (("-1", "5", "true"), ("x", "5", "true"), ("5", "4294967296", "true"), ("5",)):
        said = run(helper, *args)
        assert said.returncode == 127, args
        assert said.stderr.startswith(b"tangram-dropuid: ") or b"usage" in said.stderr
    missing = run(helper, str(UID), str(UID), "no-such-program-d7")
    assert missing.returncode == 127
    assert b"no-such-program-d7: No such file or directory" in missing.stderr
