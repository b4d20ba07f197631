"""The disk tier: one safetensors file per tensor key in a node's directory. Blocking I/O, run
only in worker threads.

A file is ``<key>.safetensors`` holding one flat ``U8`` tensor ``data`` (the bytes whose hash is
the key) and the key in its metadata. A write never leaves half a file under that name: it goes
to a temporary name, is fsynced, renamed over, and the directory fsynced -- a crash (kill -9)
at any point leaves either the whole file or none, plus maybe a temporary, which :meth:`scan`
deletes at start along with any file whose header or length is wrong. Written files are
dropped from the page cache, so a read really comes from disk (the tier's point and its cost).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import safetensors

from services.gpu_manager.state.keys import is_key, key_of

if TYPE_CHECKING:  # torch is imported where a tensor is made: a writer alone starts fast
    import torch

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
TMP = ".tmp"
_WRITE_CHUNK = 64 << 20
_ids = itertools.count()


class CorruptFile(OSError):
    """A store file that is not what its name says (truncated, wrong header, wrong bytes)."""


def header_of(key: str, nbytes: int) -> bytes:
    """The safetensors header (length prefix included) of a file holding ``nbytes`` bytes."""
    meta = {
        "__metadata__": {"key": key},
        "data": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]},
    }
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-aligned
    return struct.pack("<Q", len(text)) + text


class DiskStore:
    """Key -> file, in ``root`` (created if missing)."""

    def __init__(self, root: str | Path, *, drop_cache: bool = True) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.drop_cache = drop_cache

    def path(self, key: str) -> Path:
        return self.root / f"{key}{SUFFIX}"

    def write(self, key: str, data: torch.Tensor | memoryview) -> None:
        """Write ``data`` (flat uint8, CPU; or bytes) as ``key``'s file, atomically (see the
        module)."""
        final = self.path(key)
        tmp = final.with_name(f"{final.name}{TMP}.{os.getpid()}.{next(_ids)}")
        view = data if isinstance(data, memoryview) else data.numpy().data
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _write_all(fd, header_of(key, len(view)))
            for start in range(0, len(view), _WRITE_CHUNK):
                _write_all(fd, view[start : start + _WRITE_CHUNK])
            os.fsync(fd)
            self._uncache(fd)
        finally:
            os.close(fd)
        try:
            os.replace(tmp, final)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        self._sync_dir()

    def read(self, key: str, nbytes: int, *, pin: bool = False) -> torch.Tensor:
        """``key``'s bytes in a new uint8 tensor (pinned if ``pin``); CorruptFile if the file
        does not hold exactly ``nbytes`` under the expected header."""
        import torch

        out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        head = header_of(key, nbytes)
        with open(self.path(key), "rb", buffering=0) as f:
            if f.read(len(head)) != head:
                raise CorruptFile(f"{self.path(key)}: not the header of {nbytes} bytes of {key}")
            view = out.numpy().data
            got = 0
            while got < nbytes:
                n = f.readinto(view[got:])
                if not n:
                    raise CorruptFile(f"{self.path(key)}: truncated at {got} of {nbytes} bytes")
                got += n
            if f.read(1):
                raise CorruptFile(f"{self.path(key)}: longer than {nbytes} bytes")
        return out

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def scan(self, *, verify: bool = False) -> dict[str, int]:
        """The keys stored (key -> bytes). Deletes temporaries (writes a crash interrupted) and
        files whose name, header or length is wrong (and, with ``verify``, whose bytes do not
        hash to their key)."""
        found: dict[str, int] = {}
        for p in sorted(self.root.iterdir()):
            if TMP in p.name:
                log.warning("state store: deleting %s, a write that did not finish", p.name)
                p.unlink(missing_ok=True)
                continue
            if not p.name.endswith(SUFFIX):
                continue
            key = p.name.removesuffix(SUFFIX)
            try:
                found[key] = self._check(p, key, verify=verify)
            except (OSError, ValueError, safetensors.SafetensorError) as exc:
                log.warning("state store: deleting %s: %s", p.name, exc)
                p.unlink(missing_ok=True)
        return found

    def _check(self, p: Path, key: str, *, verify: bool) -> int:
        if not is_key(key):
            raise CorruptFile(f"{p.name} is not named by a key")
        with safetensors.safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            nbytes = int(f.get_slice("data").get_shape()[0]) if "data" in f.keys() else -1
        if meta.get("key") != key or nbytes < 0:
            raise CorruptFile(f"{p.name}: metadata or tensor missing")
        if p.stat().st_size != len(header_of(key, nbytes)) + nbytes:
            raise CorruptFile(f"{p.name}: length is not that of {nbytes} bytes")
        if verify and key_of(self.read(key, nbytes)) != key:
            raise CorruptFile(f"{p.name}: its bytes do not hash to its key")
        return nbytes

    def _uncache(self, fd: int) -> None:
        if self.drop_cache and hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def _sync_dir(self) -> None:
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
