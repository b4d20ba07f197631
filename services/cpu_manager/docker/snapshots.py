"""Environments on disk: one snapshot file per trajectory, written atomically (blocking I/O).

A snapshot is one uncompressed tar (unpacking is bounded by the disk, not a core): first a
``snapshot.json`` member (a :class:`SnapshotMeta`: what is needed to make the container again),
then the environment's work directory as ``work/...``, with modes, owners and times. It is
written to ``<key>.tar.tmp``, fsynced, renamed to ``<key>.tar`` and the directory fsynced: a
crash at any point leaves the old container or a complete snapshot, never half of one. The
files on disk are the index: :meth:`SnapshotStore.scan` rebuilds it after a restart, deletes
half-written ``.tmp`` files and sets aside (``.bad``) files it cannot read.

The sandbox's root filesystem is read-only, so its work directory is all it can write that
outlives an action, besides ``/tmp``, a tmpfs (memory), which is not kept.

Nothing here runs on the event loop: the backend calls it on its threads.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import tarfile
from pathlib import Path
from typing import Annotated

import msgspec

log = logging.getLogger(__name__)

META_NAME = "snapshot.json"
WORK = "work"
VERSION = 1
MAX_META_BYTES = 64 * 1024


class SnapshotMeta(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What makes an environment's container again (our own file: unknown fields are errors)."""

    version: Annotated[int, msgspec.Meta(ge=1, le=VERSION)] = VERSION
    trajectory_id: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    image: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    memory_mb: Annotated[int, msgspec.Meta(ge=1)]
    network: bool = False
    last_used: float = 0.0  # wall clock (epoch seconds): a restart keeps the idle time
    size_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0  # of the work directory's files


class SnapshotError(Exception):
    """A snapshot file that cannot be read or does not match what was asked."""


_decode = msgspec.json.Decoder(SnapshotMeta).decode
_encode = msgspec.json.Encoder().encode


def key_of(trajectory_id: str) -> str:
    """The file name stem of a trajectory's snapshot (ids may hold any character)."""
    return hashlib.sha256(trajectory_id.encode()).hexdigest()[:32]


def _keep_modes(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    """``tar_filter`` (no absolute paths, nothing outside ``dest``) without its clearing of
    setuid/setgid bits: the archive is our own copy of the sandbox's files, owned by its
    unprivileged user, and a restored environment has exactly the modes it had."""
    return tarfile.tar_filter(member, dest).replace(mode=member.mode, deep=False)


class SnapshotStore:
    """The snapshot directory of one node."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def path(self, trajectory_id: str) -> Path:
        return self.dir / f"{key_of(trajectory_id)}.tar"

    def scan(self) -> dict[str, SnapshotMeta]:
        """The complete snapshots on disk, by trajectory; half-written ones are deleted."""
        if not self.dir.is_dir():
            return {}  # made by the first save
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        found: dict[str, SnapshotMeta] = {}
        for path in sorted(self.dir.glob("*.tar")):
            try:
                meta = read_meta(path)
            except SnapshotError as exc:
                log.warning("setting aside unreadable snapshot %s: %s", path.name, exc)
                path.rename(path.with_suffix(".bad"))
                continue
            found[meta.trajectory_id] = meta
        return found

    def save(self, meta: SnapshotMeta, work_dir: Path) -> SnapshotMeta:
        """Write the snapshot of ``work_dir`` atomically; returns its meta with its size."""
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.path(meta.trajectory_id)
        tmp = final.with_suffix(".tar.tmp")
        meta = msgspec.structs.replace(meta, size_bytes=_size_of(work_dir))
        try:
            with tmp.open("wb") as f:
                with tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
                    _add_meta(tar, meta)
                    tar.add(work_dir, arcname=WORK, recursive=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(self.dir)
        return meta

    def restore(self, trajectory_id: str, host_dir: Path) -> SnapshotMeta:
        """Unpack a snapshot's work directory as ``host_dir/work`` (the snapshot stays)."""
        path = self.path(trajectory_id)
        try:
            with tarfile.open(path, mode="r:") as tar:
                meta = _meta_from(tar)
                if meta.trajectory_id != trajectory_id:
                    raise SnapshotError(f"{path.name} holds {meta.trajectory_id!r}")
                members = [m for m in tar if m.name == WORK or m.name.startswith(f"{WORK}/")]
                tar.extractall(host_dir, members=members, filter=_keep_modes)
        except (OSError, tarfile.TarError) as exc:
            raise SnapshotError(f"cannot restore {path.name}: {exc}") from exc
        return meta

    def delete(self, trajectory_id: str) -> None:
        """Forget a snapshot (restored into a container, or its environment dropped)."""
        with contextlib.suppress(FileNotFoundError):
            self.path(trajectory_id).unlink()
            _fsync_dir(self.dir)


def read_meta(path: Path) -> SnapshotMeta:
    """The meta of one snapshot file, checked."""
    try:
        with tarfile.open(path, mode="r:") as tar:
            return _meta_from(tar)
    except (OSError, tarfile.TarError) as exc:
        raise SnapshotError(f"not a snapshot: {exc}") from exc


def _meta_from(tar: tarfile.TarFile) -> SnapshotMeta:
    first = tar.next()
    if first is None or first.name != META_NAME or not first.isfile():
        raise SnapshotError(f"first member is not {META_NAME}")
    if first.size > MAX_META_BYTES:
        raise SnapshotError(f"{META_NAME} too large ({first.size} bytes)")
    raw = tar.extractfile(first)
    if raw is None:
        raise SnapshotError(f"{META_NAME} unreadable")
    try:
        return _decode(raw.read())
    except msgspec.DecodeError as exc:
        raise SnapshotError(f"bad {META_NAME}: {exc}") from exc


def _add_meta(tar: tarfile.TarFile, meta: SnapshotMeta) -> None:
    data = _encode(meta)
    info = tarfile.TarInfo(META_NAME)
    info.size = len(data)
    info.mode = 0o600
    tar.addfile(info, io.BytesIO(data))


def _size_of(work_dir: Path) -> int:
    total = 0
    for root, _, files in os.walk(work_dir):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
