"""Dynamic batching: FIFO batches up to max_batch, outputs routed back per call."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.gpu_manager import examples
from services.gpu_manager.batching import Batch, BatchFormer, Call, Output, run_batch
from services.gpu_manager.host_copy import HostCopy
from tangram.errors import Busy, InvalidRequest


def _calls(service: str, n: int, t0: float = 0.0) -> list[Call]:
    return [Call(f"{service}-{i}", service, [float(i)] * 8, t0 + i) for i in range(n)]


def test_batches_are_fifo_and_bounded_by_max_batch() -> None:
    former = BatchFormer()
    for c in _calls("judge", 5):
        former.submit(c)
    first = former.take("judge", 2)
    assert first is not None
    assert [c.call_id for c in first.calls] == ["judge-0", "judge-1"]
    rest = former.take("judge", 10)
    assert rest is not None
    assert len(rest.calls) == 3
    assert former.take("judge", 1) is None
    assert len(former) == 0


def test_waiting_services_oldest_head_first() -> None:
    former = BatchFormer()
    for c in _calls("late", 2, t0=5.0) + _calls("early", 1, t0=1.0):
        former.submit(c)
    assert former.waiting() == ["early", "late"]
    assert former.pending("late") == 2
    assert former.pending("none") == 0


def test_full_queue_answers_busy() -> None:
    former = BatchFormer(capacity=2)
    for c in _calls("s", 2):
        former.submit(c)
    with pytest.raises(Busy):
        former.submit(Call("x", "s", None, 9.0))


def test_max_batch_must_be_positive() -> None:
    with pytest.raises(InvalidRequest):
        BatchFormer().take("s", 0)


def test_cancel_keeps_the_order_of_the_rest() -> None:
    former = BatchFormer()
    for c in _calls("a", 4, t0=0.0) + _calls("b", 2, t0=0.5):
        former.submit(c)
    cancelled = former.cancel("a-0")
    assert cancelled is not None
    assert cancelled.call_id == "a-0"
    assert former.cancel("a-0") is None  # no longer pending
    assert former.cancel("nobody") is None
    assert former.waiting() == ["b", "a"]  # a's oldest is now a-1 (1.0), b's is b-0 (0.5)
    assert former.cancel("a-2") is not None
    batch = former.take("a", 10)
    assert batch is not None
    assert [c.call_id for c in batch.calls] == ["a-1", "a-3"]
    assert former.cancel("a-1") is None  # taken: running, not pending
    assert (len(former), former.pending("b")) == (2, 2)
    assert former.cancel("b-0") is not None
    assert former.cancel("b-1") is not None
    assert (len(former), former.waiting()) == (0, [])


def test_a_pending_call_id_is_refused_twice() -> None:
    former = BatchFormer()
    former.submit(Call("x", "s", None, 0.0))
    with pytest.raises(InvalidRequest, match="pending already"):
        former.submit(Call("x", "t", None, 1.0))
    assert (len(former), former.pending("t")) == (1, 0)


class _CountedId(str):
    """A call id that counts the comparisons made with it."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        _CountedId.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_cancel_does_not_scan_the_queue() -> None:
    former = BatchFormer()
    for i in range(2000):
        former.submit(Call(_CountedId(f"c{i}"), "s", None, float(i)))
    _CountedId.compared = 0
    assert former.cancel(_CountedId("c1999")) is not None  # the newest: a scan's worst case
    assert _CountedId.compared <= 4  # hash lookups, not one comparison per queued call


def test_batched_outputs_match_the_model_called_directly() -> None:
    model = examples.mlp()
    calls = _calls("m", 6)
    direct = examples.mlp_handle(model, [c.payload for c in calls])
    singles = [examples.mlp_handle(model, [c.payload])[0] for c in calls]
    resident = HostCopy(model).restore("cpu")
    outs = run_batch(resident.model, examples.mlp_handle, Batch("m", tuple(calls)))
    assert [o.call_id for o in outs] == [c.call_id for c in calls]
    assert [o.value for o in outs] == direct  # bit-exact on CPU, same batch
    assert torch.allclose(torch.tensor([o.value for o in outs]), torch.tensor(singles), atol=1e-6)


def _raises(model: torch.nn.Module, payloads: list[Any]) -> list[Any]:
    raise ValueError("bad payload")


def _short(model: torch.nn.Module, payloads: list[Any]) -> list[Any]:
    return payloads[:-1]


def _not_a_list(model: torch.nn.Module, payloads: list[Any]) -> list[Any]:
    return 3  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("handle", "words"),
    [(_raises, "bad payload"), (_short, "returned 1 outputs for 2"), (_not_a_list, "int")],
)
def test_handler_failures_fail_each_call(handle: Any, words: str) -> None:
    batch = Batch("m", tuple(_calls("m", 2)))
    outs = run_batch(examples.mlp(), handle, batch)
    assert [o.call_id for o in outs] == ["m-0", "m-1"]
    assert all(isinstance(o, Output) and words in o.error and o.value is None for o in outs)
