"""The default sandbox image, made offline: ``docker import`` of a rootfs that holds only mount
points. Its label tells the Docker backend to bind the host's system dirs (``/usr``, ``/lib``,
``/lib64``, ``/bin``, ``/sbin``, ``/etc``) read-only into its containers, which is enough for
``sh`` and ``python3`` (the executor). No registry, no download: what ``tangram up`` builds
when the image is absent, and what ``tangram sandbox-image`` builds on request.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from services.cpu_manager.docker.config import DockerConfig
from services.cpu_manager.docker.engine import (
    CTL_DIR,
    EXECUTOR_PATH,
    HOST_ROOTFS,
    HOST_SYSTEM_DIRS,
    LABEL_ROOTFS,
    Engine,
)

TAG = "tangram-sandbox:latest"
MOUNT_POINTS = (
    *HOST_SYSTEM_DIRS,
    "/tmp",
    "/work",
    "/proc",
    "/sys",
    "/dev",
    str(Path(EXECUTOR_PATH).parent),
    CTL_DIR,
)
DESCRIPTION = "an empty rootfs; the host's " + ",".join(HOST_SYSTEM_DIRS) + " bound read-only"


def _parents(path: str) -> list[str]:
    parts = Path(path).parts[1:]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def rootfs_tar(dirs: tuple[str, ...] = MOUNT_POINTS) -> bytes:
    """A tarball of empty directories: the mount points the sandbox needs."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in sorted({p for d in dirs for p in _parents(d)}):
            info = tarfile.TarInfo(path.lstrip("/"))
            info.type = tarfile.DIRTYPE
            info.mode = 0o1777 if path == "/tmp" else 0o755
            tar.addfile(info)
    return buf.getvalue()


def build(docker_host: str = "", tag: str = TAG) -> str:
    """Import the empty rootfs as ``tag``, labelled to borrow the host's system dirs (blocking).

    Returns the engine's version; raises ``DockerFailure`` when the engine does not answer.
    """
    engine = Engine(DockerConfig(root=".", docker_host=docker_host))
    try:
        version = engine.connect()
        engine.import_image(rootfs_tar(), tag, [f"LABEL {LABEL_ROOTFS}={HOST_ROOTFS}"])
    finally:
        engine.close()
    return version


def present(docker_host: str, image: str) -> bool:
    """True when the engine at ``docker_host`` has ``image`` (blocking; raises DockerFailure)."""
    engine = Engine(DockerConfig(root=".", docker_host=docker_host))
    try:
        engine.connect()
        return engine.has_image(image)
    finally:
        engine.close()
