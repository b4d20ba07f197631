"""rLLM adapter: :class:`TangramSandbox`, a sandbox backend with rLLM's ``Sandbox``
protocol (``exec``, ``upload_file``, ``upload_dir``, ``close``, ``is_alive``) whose sandbox
is a trajectory's environment on the mesh's pooled nodes.

rLLM is not on the package registry this project installs from, so this follows its
documented protocol (``rllm/sandbox/protocol.py``) and its backends' conventions: ``exec``
returns stdout and raises ``RuntimeError`` on a non-zero exit, ``is_alive`` never raises,
and :func:`create_tangram_sandbox` mirrors ``create_docker_sandbox(name, image, ...)``.

Files travel inside the actions that write them (base64 in ``python3`` argv, in slices
well under a message's size), since a sandbox may be on another machine. Remote paths are
as the environment sees them: with the process backend a relative path lands in the
trajectory's directory; absolute paths need the Docker backend's writable image.
"""

from __future__ import annotations

import base64
import io
import tarfile
import uuid
from typing import Any

from tangram.client import SyncClient
from tangram.contract import ActionResult
from tangram.integrations import clients

__all__ = ["SandboxError", "TangramSandbox", "create_tangram_sandbox"]

CHUNK_BYTES = 48 * 1024  # 64 KiB of base64: the longest argument the contract takes
IGNORED = {".venv", "venv", ".git", "__pycache__", "node_modules", ".tox", ".mypy_cache"}
_WRITE = (
    "import base64,os,sys\n"
    "p=sys.argv[1]\n"
    "os.makedirs(os.path.dirname(p) or '.',exist_ok=True)\n"
    "open(p,sys.argv[2]).write(base64.b64decode(sys.argv[3]))\n"
)
_UNTAR = (
    "import os,sys,tarfile\n"
    "os.makedirs(sys.argv[2],exist_ok=True)\n"
    "kw={'filter':'data'} if hasattr(tarfile,'data_filter') else {}\n"  # older pythons
    "tarfile.open(sys.argv[1]).extractall(sys.argv[2],**kw)\n"
    "os.remove(sys.argv[1])\n"
)


class SandboxError(RuntimeError):
    """A command failed in the sandbox, or the sandbox could not run it; ``result`` says
    which (``result.infrastructure_failure``)."""

    def __init__(self, message: str, result: ActionResult) -> None:
        super().__init__(message)
        self.result = result


class TangramSandbox:
    """One rLLM sandbox = one trajectory's environment."""

    def __init__(
        self,
        name: str,
        image: str | None = None,
        *,
        job_id: str = "rllm",
        cpus: int | tuple[int, int] = 1,
        client: SyncClient | None = None,
        **_: Any,
    ) -> None:
        self.name = name
        self.trajectory_id = f"rllm-{name}-{uuid.uuid4().hex[:12]}"
        self.job_id = job_id
        self.cpus = cpus
        self.image = image
        self.closed = False
        self.client = client or clients.shared_sync_client()

    def exec(self, command: str, timeout: float | None = None, user: str | None = None) -> str:
        """Run ``command`` under ``sh -c``; its stdout. ``user`` is ignored (the mesh runs
        every action as its sandbox's one user)."""
        return self._run(command, timeout).stdout

    def upload_file(self, local_path: str, remote_path: str) -> None:
        with open(local_path, "rb") as f:
            self._write(remote_path, f.read())

    def upload_dir(self, local_path: str, remote_path: str) -> None:
        staged = f".tangram-upload-{uuid.uuid4().hex}.tar.gz"
        self._write(staged, _tarred(local_path))
        self._run(["python3", "-c", _UNTAR, staged, remote_path], None)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.client.close_env(self.trajectory_id)

    def is_alive(self) -> bool:
        """A no-op action answered in the environment (never raises)."""
        if self.closed:
            return False
        try:
            self._run("true", 30.0)
        except Exception:
            return False
        return True

    def _write(self, remote_path: str, data: bytes) -> None:
        for start in range(0, max(len(data), 1), CHUNK_BYTES):
            part = base64.b64encode(data[start : start + CHUNK_BYTES]).decode()
            mode = "wb" if start == 0 else "ab"
            self._run(["python3", "-c", _WRITE, remote_path, mode, part], None)

    def _run(self, command: str | list[str], timeout: float | None) -> ActionResult:
        if self.closed:
            raise RuntimeError(f"sandbox {self.name} is closed")
        kw: dict[str, Any] = {"timeout_s": timeout} if timeout else {}
        if self.image:
            kw["image"] = self.image
        result = self.client.exec(
            command, trajectory_id=self.trajectory_id, job_id=self.job_id, cpus=self.cpus, **kw
        )
        if not result.ok:
            raise SandboxError(_failure(self.name, command, result), result)
        return result


def _failure(name: str, command: str | list[str], result: ActionResult) -> str:
    shown = command if isinstance(command, str) else " ".join(command[:2])
    if result.infrastructure_failure and result.error is not None:
        why = f"{result.error.kind}: {result.error.message}"
    else:
        why = f"exit {result.exit_code}"
    tail = result.stderr[-600:]
    return f"Command failed ({why}) in sandbox {name}: {shown}\nstderr (tail):\n{tail}"


def _tarred(local_path: str) -> bytes:
    """``local_path``'s tree as a gzipped tar, without what a sandbox never needs."""

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = set(info.name.split("/"))
        return None if parts & IGNORED or info.name.endswith(".egg-info") else info

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(local_path, arcname=".", filter=keep)
    return buf.getvalue()


def create_tangram_sandbox(name: str, image: str | None = None, **kwargs: Any) -> TangramSandbox:
    """rLLM's factory shape (``create_docker_sandbox(name, image, **kwargs)``)."""
    return TangramSandbox(name, image, **kwargs)
