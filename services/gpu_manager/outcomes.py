"""What a GPU node reports of one call (pure): the handler's output, capped, or whose failure
it was."""

from __future__ import annotations

from typing import Final

import msgspec

from services.gpu_manager.batching import Output
from tangram.bus import MAX_VALUE_NESTING, too_deep
from tangram.contract import ErrorKind, Outcome, ServiceSpec

HINT: Final = "raise the service's max_output_bytes (up to 256 KiB) or return less"


def outcome_of(
    out: Output, spec: ServiceSpec, *, started: float, finished: float, restore_s: float
) -> Outcome:
    """The facts of one call: its output when it fits ``spec.max_output_bytes``; a handler's
    failure as the action's own (exit code 1, traceback in stderr); a device's as such."""
    facts = _failed(out) if out.error else _output(out, spec)
    return msgspec.structs.replace(
        facts, started_at=started, finished_at=finished, restore_s=restore_s
    )


def _output(out: Output, spec: ServiceSpec) -> Outcome:
    try:
        encoded = msgspec.msgpack.encode(out.value)
    except Exception as exc:  # TypeError, OverflowError; RecursionError when nested too deep
        why = f"service {spec.name}: the handler's output is not a msgpack value: {exc}"
        return Outcome(exit_code=1, detail=why, stderr=why)
    if too_deep(encoded, MAX_VALUE_NESTING):  # the bus would refuse its completion forever
        why = (
            f"service {spec.name}: the handler's output nests containers deeper than "
            f"{MAX_VALUE_NESTING} levels (what the messages carrying it allow)"
        )
        return Outcome(exit_code=1, detail=why, stderr=why)
    size = len(encoded)
    if size > spec.max_output_bytes:
        cap = spec.max_output_bytes
        why = f"service {spec.name}: output of {size} bytes exceeds max_output_bytes={cap}; {HINT}"
        return Outcome(failure=ErrorKind.INVALID_REQUEST, detail=why)
    return Outcome(exit_code=0, output=out.value)


def _failed(out: Output) -> Outcome:
    match out.fault:
        case "oom":
            return Outcome(failure=ErrorKind.DEVICE_OOM, detail=out.error)
        case "device":
            return Outcome(failure=ErrorKind.DEVICE_LOST, detail=out.error)
        case _:
            return Outcome(exit_code=1, detail=out.error, stderr=out.trace or out.error)


def refused(why: str, now: float) -> Outcome:
    """A call that cannot run here as dispatched (never reached a device)."""
    return Outcome(failure=ErrorKind.INVALID_REQUEST, detail=why, started_at=now, finished_at=now)
