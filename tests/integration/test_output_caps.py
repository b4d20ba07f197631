"""Output at the largest caps still ends its action (issue 17): the completion is cut to fit
one message and flagged, never refused for its size, so the action ends and frees its cores.

Runs on the process backend through a real mesh; ``OVERSIZED`` and :func:`check_oversized`
are shared with the Docker-backend run (give it a client of a mesh on that backend).
"""

from __future__ import annotations

import pytest

from tangram import ActionResult
from tangram.client import Client
from tangram.contract import MAX_MESSAGE_BYTES, MAX_OUTPUT_CAP

BOTH_AT_CAP = "head -c 262144 /dev/zero | tr '\\0' a; head -c 262144 /dev/zero | tr '\\0' b >&2"
INVALID_UTF8 = "head -c 200000 /dev/zero | tr '\\0' '\\377'"  # each byte decodes to 3
OVERSIZED = [
    pytest.param(BOTH_AT_CAP, "a", True, id="both-streams-at-the-cap"),
    pytest.param(INVALID_UTF8, "\ufffd", False, id="invalid-utf8"),
]


async def check_oversized(
    client: Client, uid: str, command: str, char: str, stderr_cut: bool
) -> ActionResult:
    """Run ``command`` at the largest cap; its result must come back cut and flagged."""
    res = await client.exec(
        command, trajectory_id=uid, job_id=uid, output_cap_bytes=MAX_OUTPUT_CAP, wait_s=60
    )
    assert res.ok, res
    assert res.stdout_truncated
    assert res.stderr_truncated is stderr_cut
    assert set(res.stdout) == {char}
    assert len(res.stdout) > 150_000  # what fits is kept
    assert len(res.stdout.encode()) + len(res.stderr.encode()) < MAX_MESSAGE_BYTES
    after = await client.exec("echo after", trajectory_id=uid, job_id=uid, wait_s=30)
    assert after.stdout == "after\n"  # the node is not left holding cores
    return res


@pytest.mark.parametrize(("command", "char", "stderr_cut"), OVERSIZED)
async def test_oversized_output_returns_cut_and_flagged(
    client: Client, uid: str, command: str, char: str, stderr_cut: bool
):
    res = await check_oversized(client, uid, command, char, stderr_cut)
    if stderr_cut:
        assert set(res.stderr) == {"b"}
