"""What a command's result looks like to the model that asked for it, and to its trainer.

One rendering for every adapter: the output, then one line on how it ended. An
infrastructure failure (the mesh, not the command) is said as such, so a trainer masking
those samples can find them in the metrics (:func:`metrics`)."""

from __future__ import annotations

from tangram.contract import ActionResult


def observation(result: ActionResult) -> str:
    """The command's stdout and stderr, and how it ended."""
    parts = [result.stdout]
    if result.stdout_truncated:
        parts.append("[stdout truncated]\n")
    if result.stderr:
        parts.append(result.stderr)
    if result.stderr_truncated:
        parts.append("[stderr truncated]\n")
    parts.append(_ending(result))
    return "".join(p if p.endswith("\n") or not p else p + "\n" for p in parts).rstrip("\n")


def _ending(result: ActionResult) -> str:
    if result.ok:
        return "[exit code 0]"
    if result.error is not None and result.error.infrastructure:
        return f"[not run to the end: {result.error.kind}: {result.error.message}]"
    return f"[exit code {result.exit_code}]"


def metrics(result: ActionResult) -> dict[str, float]:
    """Numbers a framework logs per call: exit code, infrastructure failure, timings."""
    out = {
        "exit_code": float(result.exit_code if result.exit_code is not None else -1),
        "infrastructure_failure": float(result.infrastructure_failure),
    }
    if result.timings is not None:
        out |= {"queue_s": result.timings.queue_s, "exec_s": result.timings.exec_s}
    return out
