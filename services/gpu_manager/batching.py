"""Dynamic batching: concurrent calls to one resident service coalesced into one forward pass.

Pure and asyncio-free. The shell ``submit``s calls as they arrive; whenever a device is free for
a service it ``take``s up to ``max_batch`` of that service's calls (oldest first), runs them with
:func:`run_batch` (in a worker thread: torch blocks), and routes each :class:`Output` back by
``call_id``. Outputs keep the order of the calls; one call's bad output never reaches another.
"""

from __future__ import annotations

import traceback
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

import torch

from tangram.errors import Busy, InvalidRequest

Handle = Callable[[torch.nn.Module, list[Any]], list[Any]]
Fault = Literal["handler", "oom", "device"]
# Words of a RuntimeError torch raises when the device itself failed (not the handler's code).
DEVICE_ERRORS: Final = ("CUDA error", "device-side assert", "cudaError", "NVML", "ECC error")
TRACE_CHARS: Final = 2000  # of a handler's traceback: its tail says where it failed


@dataclass(frozen=True, slots=True)
class Call:
    """One pending call of a service."""

    call_id: str
    service: str
    payload: Any
    arrived: float


@dataclass(frozen=True, slots=True)
class Batch:
    """Calls of one service run together, in arrival order."""

    service: str
    calls: tuple[Call, ...]


@dataclass(frozen=True, slots=True)
class Output:
    """A call's result: ``value`` when ``error`` is empty, else the failure: the handler's
    own (``trace`` its traceback's tail), the device's memory, or the device itself."""

    call_id: str
    value: Any = None
    error: str = ""
    fault: Fault = "handler"
    trace: str = ""


class BatchFormer:
    """Per-service FIFO queues of pending calls, bounded in total.

    Each queue is an OrderedDict keyed by call id, so a call is cancelled in O(1) wherever it
    waits (a kill, or its timeout) and the rest keep their order; ``_service`` finds its queue.
    """

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._queues: dict[str, OrderedDict[str, Call]] = {}
        self._service: dict[str, str] = {}  # call id -> the service whose queue holds it

    def __len__(self) -> int:
        return len(self._service)

    def submit(self, call: Call) -> None:
        """Queue a call; :class:`Busy` when the queue is full, :class:`InvalidRequest` when a
        call of that id is pending already."""
        if call.call_id in self._service:
            raise InvalidRequest(f"call {call.call_id} is pending already")
        if len(self._service) >= self.capacity:
            raise Busy(f"{len(self._service)} calls already waiting")
        self._queues.setdefault(call.service, OrderedDict())[call.call_id] = call
        self._service[call.call_id] = call.service

    def waiting(self) -> list[str]:
        """Services with pending calls, the one whose oldest call is oldest first."""
        return sorted(self._queues, key=lambda s: next(iter(self._queues[s].values())).arrived)

    def pending(self, service: str) -> int:
        """How many calls of ``service`` wait."""
        queue = self._queues.get(service)
        return len(queue) if queue else 0

    def cancel(self, call_id: str) -> Call | None:
        """Remove a pending call (None when it is not pending: running or unknown)."""
        service = self._service.pop(call_id, None)
        if service is None:
            return None
        queue = self._queues[service]
        call = queue.pop(call_id)
        if not queue:
            del self._queues[service]
        return call

    def take(self, service: str, max_batch: int) -> Batch | None:
        """Up to ``max_batch`` of ``service``'s oldest calls (None when it has none)."""
        if max_batch < 1:
            raise InvalidRequest(f"max_batch must be ≥ 1, got {max_batch}")
        queue = self._queues.get(service)
        if not queue:
            return None
        calls = tuple(queue.popitem(last=False)[1] for _ in range(min(max_batch, len(queue))))
        if not queue:
            del self._queues[service]
        for c in calls:
            del self._service[c.call_id]
        return Batch(service, calls)


def run_batch(model: torch.nn.Module, handle: Handle, batch: Batch) -> list[Output]:
    """One forward pass for the batch; a failure of the handler fails each of its calls."""
    try:
        with torch.inference_mode():
            values = handle(model, [c.payload for c in batch.calls])
            if isinstance(values, list):  # a plain copy: a subclass's own __len__ or __iter__
                values = list.copy(values)  # would run outside this guard
    except BaseException as exc:  # user code in a worker thread: a SystemExit,
        # KeyboardInterrupt or custom BaseException is the calls' failure, never the agent's
        trace = traceback.format_exc()[-TRACE_CHARS:]
        return _failed(batch, f"handler raised {safe_repr(exc)}", fault_of(exc), trace)
    if not isinstance(values, list) or len(values) != len(batch.calls):
        got = len(values) if isinstance(values, list) else type(values).__name__
        return _failed(batch, f"handler returned {got} outputs for {len(batch.calls)} payloads")
    return [Output(c.call_id, v) for c, v in zip(batch.calls, values, strict=True)]


def safe_repr(obj: object) -> str:
    """``repr(obj)``, or its type's name when the user's ``__repr__`` itself fails."""
    try:
        return repr(obj)
    except BaseException:  # a user's __repr__ is user code too
        return f"<{type(obj).__name__} whose repr failed>"


def fault_of(exc: BaseException) -> Fault:
    """Whose failure an exception raised while running a handler is."""
    if isinstance(exc, torch.cuda.OutOfMemoryError | MemoryError):
        return "oom"
    if isinstance(exc, RuntimeError) and "out of memory" in str(exc):
        return "oom"
    if isinstance(exc, RuntimeError) and any(w in str(exc) for w in DEVICE_ERRORS):
        return "device"
    return "handler"


def _failed(batch: Batch, message: str, fault: Fault = "handler", trace: str = "") -> list[Output]:
    return [Output(c.call_id, error=message, fault=fault, trace=trace) for c in batch.calls]
