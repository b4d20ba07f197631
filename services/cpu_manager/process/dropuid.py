"""``tangram-dropuid``: the launcher that runs a trajectory's action as its uid.

An agent running as root starts every action of a trajectory through a launcher that gives up
root first (no supplementary groups, the trajectory's gid and uid, ``no_new_privs``), then
execs the action. util-linux's ``setpriv`` does exactly that, but its own start-up costs about
1.2 ms of CPU per action on this kind of machine, twice a ``true``'s whole exec
(``python -m bench.auth_cost``). ``dropuid.c`` does the same four steps in a static binary that
starts in about 0.4 ms. It is built here from that source with the machine's C compiler (from
/usr/bin or /bin only), once per boot (``/run`` is a tmpfs), into a root-owned directory
nobody else may write: root execs it for every action, so a file anyone else could replace
would hand them root. Static only: a dynamic build would run the dynamic loader as root, which
honours the action's LD_PRELOAD (the backend also keeps such variables out of the launcher's
environment, see ``users.as_uid``). Without a compiler or a static C library, or where that
directory is not root's alone, the backend uses ``setpriv``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Final

log = logging.getLogger(__name__)

SOURCE: Final = Path(__file__).with_name("dropuid.c")
BIN_DIR: Final = Path("/run/tangram/bin")  # beside the uid slots: root's own
BUILD_TIMEOUT_S: Final = 60.0
SYSTEM_PATH: Final = "/usr/bin:/bin"  # root's own programs: never a user's cc from $PATH


def launcher(bin_dir: Path = BIN_DIR) -> tuple[Path | None, str]:
    """The built launcher (built now if missing), or None and why not. Blocking: call it from
    a thread. Only root may use it (it exists to drop root)."""
    if os.geteuid() != 0:
        return None, "not root"
    target, why = installed(SOURCE, "tangram-dropuid", bin_dir)
    if target is None:
        return None, why
    why = _self_test(target)
    return (None, why) if why else (target, "")


def installed(
    source: Path, name: str, directory: Path, static: bool = True
) -> tuple[Path | None, str]:
    """``source`` built into ``directory`` as ``NAME-<hash of the source>`` unless a file of
    this user's that no one else may change is there already; None and why not when it cannot
    be. As root ``directory`` and every ancestor must be root's alone (see
    :func:`_make_private_dir`), else ``directory`` must be this user's alone. Blocking."""
    try:
        text = source.read_bytes()
    except OSError as exc:
        return None, f"its source is missing ({exc})"
    target = directory / f"{name}-{hashlib.sha256(text).hexdigest()[:12]}"
    unsafe = _make_private_dir(directory) if os.geteuid() == 0 else _user_dir(directory)
    if unsafe:
        return None, unsafe
    if not trusted(target, os.geteuid()):
        why = build(source, target, static)
        if why:
            return None, why
    return target, ""


def trusted(path: Path, owner: int = 0) -> bool:
    """A regular file (not a link) of ``owner``'s that only it may change, executable."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return (
        stat.S_ISREG(st.st_mode)
        and st.st_uid == owner
        and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        and bool(st.st_mode & stat.S_IXUSR)
    )


def _user_dir(path: Path) -> str:
    """ "" when ``path`` is a directory only this user may change (made if missing)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.lstat()
    except OSError as exc:
        return f"cannot create {path}: {exc}"
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return f"{path} is not a directory of this user's"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} may be changed by other users"
    return ""


def _make_private_dir(path: Path) -> str:
    """Create ``path`` root's own, a level at a time from /, each level checked before the
    next is made in it; "" when it and every ancestor are directories only root may change,
    else why not."""
    for p in (*reversed(path.parents), path):
        try:
            p.mkdir(mode=0o755, exist_ok=True)
            st = p.lstat()
        except OSError as exc:
            return f"cannot create {p}: {exc}"
        unsafe = root_only(p, st)
        if unsafe:
            return unsafe
    return ""


def root_only(p: Path, st: os.stat_result) -> str:
    """ "" when ``p`` (its ``lstat``) is a directory only root may change (others may add
    entries only where the sticky bit stops them replacing root's), else why not."""
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0:
        return f"{p} is not a directory of root's"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        return f"{p} may be changed by users other than root"
    return ""


def build(source: Path, target: Path, static: bool = True) -> str:
    """Compile ``source`` (statically unless told not to) into ``target``; "" once built, else
    why not. Written aside (a name no other agent picks) and renamed: agents building at once
    each publish a whole file."""
    cc = shutil.which("cc", path=SYSTEM_PATH) or shutil.which("gcc", path=SYSTEM_PATH)
    if cc is None:
        return f"no C compiler (cc) in {SYSTEM_PATH} to build it"
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}")
    argv = [cc, "-O2", *(["-static"] if static else []), "-o", str(tmp), str(source)]
    try:
        try:
            done = subprocess.run(
                argv, capture_output=True, timeout=BUILD_TIMEOUT_S, env={"PATH": SYSTEM_PATH}
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{cc} failed: {exc}"
        if done.returncode != 0:
            said = " ".join(done.stderr.decode(errors="replace").strip().splitlines()[-1:])
            return f"{cc} could not build it{' statically' if static else ''}: {said}"
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    except OSError as exc:
        return f"cannot install {target}: {exc}"
    finally:
        tmp.unlink(missing_ok=True)
    log.info("built %s", target)
    return ""


def _self_test(target: Path) -> str:
    """Run it once as nobody (``id -u``); "" when it answered as nobody, else why not."""
    nobody = "65534"
    try:
        done = subprocess.run(
            [str(target), nobody, nobody, "--", "id", "-u"],
            capture_output=True,
            timeout=BUILD_TIMEOUT_S,
            env={"PATH": SYSTEM_PATH},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{target} did not run: {exc}"
    if done.returncode != 0 or done.stdout.strip() != nobody.encode():
        return f"{target} failed its self-test: {done.stderr.decode(errors='replace').strip()}"
    return ""
