"""rLLM sandbox backend on a running mesh, checked against rLLM's documented ``Sandbox``
protocol (rLLM is not on the package registry): exec returns stdout and raises
RuntimeError on failure, files and trees are uploaded in slices, close ends the sandbox and
is_alive says so without raising."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

import pytest

from tangram.integrations.rllm import CHUNK_BYTES, TangramSandbox, create_tangram_sandbox
from tangram.launcher import Mesh

pytestmark = pytest.mark.slow

PROTOCOL = {  # rllm/sandbox/protocol.py: method -> its parameters
    "exec": ["command", "timeout", "user"],
    "upload_file": ["local_path", "remote_path"],
    "upload_dir": ["local_path", "remote_path"],
    "close": [],
    "is_alive": [],
}


def test_it_has_the_protocols_methods():
    for name, params in PROTOCOL.items():
        found = list(inspect.signature(getattr(TangramSandbox, name)).parameters)[1:]
        assert found == params, name


def _session(tmp: Path, uid: str) -> None:
    box = create_tangram_sandbox(f"{uid}-box", job_id=uid)
    assert box.is_alive()
    assert box.exec("echo hi") == "hi\n"
    big = bytes(range(256)) * (CHUNK_BYTES // 128)  # two slices and a bit
    (tmp / "blob.bin").write_bytes(big)
    box.upload_file(str(tmp / "blob.bin"), "data/blob.bin")
    assert box.exec("wc -c < data/blob.bin").strip() == str(len(big))
    (tmp / "proj" / "pkg").mkdir(parents=True)
    (tmp / "proj" / "pkg" / "mod.py").write_text("X = 7\n")
    (tmp / "proj" / ".git").mkdir()
    (tmp / "proj" / ".git" / "HEAD").write_text("ref\n")
    box.upload_dir(str(tmp / "proj"), "work")
    assert box.exec("cd work && python3 -c 'from pkg.mod import X; print(X)'") == "7\n"
    assert box.exec("ls -a work") == ".\n..\npkg\n"  # what a sandbox never needs stays out
    with pytest.raises(RuntimeError, match=r"exit 3"):
        box.exec("echo oops >&2; exit 3")
    box.close()
    assert not box.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        box.exec("true")


async def test_a_sandbox_session(reward_mesh: Mesh, uid: str, tmp_path: Path):
    await asyncio.to_thread(_session, tmp_path, uid)
