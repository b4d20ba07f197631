"""Dynamic batching: FIFO batches up to max_batch, outputs routed back per call."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.gpu_manager.batching import Batch, BatchFormer, Call, Output, run_batch
from services.gpu_manager.host_copy import HostCopy
from tangram.errors import Busy, InvalidRequest
from tests import gpu_models


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


def test_batched_outputs_match_the_model_called_directly() -> None:
    model = gpu_models.mlp()
    calls = _calls("m", 6)
    direct = gpu_models.mlp_handle(model, [c.payload for c in calls])
    singles = [gpu_models.mlp_handle(model, [c.payload])[0] for c in calls]
    resident = HostCopy(model).restore("cpu")
    outs = run_batch(resident.model, gpu_models.mlp_handle, Batch("m", tuple(calls)))
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
    outs = run_batch(gpu_models.mlp(), handle, batch)
    assert [o.call_id for o in outs] == ["m-0", "m-1"]
    assert all(isinstance(o, Output) and words in o.error and o.value is None for o in outs)
