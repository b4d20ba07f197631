"""Review of the GPU services surface as a hostile user would use it (the gpu_manager agent on
CPU devices, in-memory bus, fake scheduler): factories and handlers that raise BaseException
subclasses, outputs nested past what the wire carries, user objects whose own methods fail,
and a model no device of the node could ever hold."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from services.gpu_manager.examples import mlp, mlp_handle
from tangram.contract import ErrorKind, ServiceSpec

from .test_gpu_agent import Node, started

M = "tests.unit.test_gpu_review"


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    async with started() as n:
        yield n


class Custom(BaseException):
    """Neither an Exception nor a SystemExit: what a careless library may raise."""


def _raise(exc: BaseException) -> Any:
    def handle(model: nn.Module, payloads: list[Any]) -> list[Any]:
        raise exc

    return handle


def kbd_factory() -> tuple[nn.Module, Any]:
    raise KeyboardInterrupt


def custom_factory() -> tuple[nn.Module, Any]:
    raise Custom("no GPU budget left")


def exiting_handler() -> tuple[nn.Module, Any]:
    return mlp(), _raise(SystemExit(4))


def kbd_handler() -> tuple[nn.Module, Any]:
    return mlp(), _raise(KeyboardInterrupt())


def custom_handler() -> tuple[nn.Module, Any]:
    return mlp(), _raise(Custom("boom"))


class Unprintable(Exception):
    def __repr__(self) -> str:
        raise RuntimeError("repr of a user's exception failed")


def unprintable_handler() -> tuple[nn.Module, Any]:
    return mlp(), _raise(Unprintable())


class Lying(list[Any]):
    def __len__(self) -> int:
        raise RuntimeError("a user's list whose len fails")


def lying_handler() -> tuple[nn.Module, Any]:
    return mlp(), lambda model, payloads: Lying(mlp_handle(model, payloads))


def _nested(depth: int) -> Any:
    out: Any = 1
    for _ in range(depth):
        out = [out]
    return out


def deep_handler() -> tuple[nn.Module, Any]:
    return mlp(), lambda model, payloads: [_nested(int(p)) for p in payloads]


def huge_factory() -> tuple[nn.Module, Any]:  # 4 MB of state: devices of 1 MB never hold it
    return nn.Linear(1024, 1024), mlp_handle


@pytest.mark.parametrize(
    ("factory", "words"),
    [("kbd_factory", "raised KeyboardInterrupt()"), ("custom_factory", "no GPU budget left")],
)
async def test_a_factory_raising_a_base_exception_fails_at_once_naming_it(
    node: Node, factory: str, words: str
):
    # before: the build thread died, the registration waited out the prepare timeout (90 s)
    # and then blamed a factory that "did not return"
    await node.prepare(ServiceSpec("f", f"{M}:{factory}"))
    error = node.scheduler.service("f").error  # type: ignore[union-attr]
    assert words in error
    assert "did not return" not in error


async def test_a_module_exiting_at_import_fails_naming_it(
    node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    (tmp_path / "r2_exits_at_import.py").write_text("import sys\nsys.exit(5)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        await node.prepare(ServiceSpec("x", "r2_exits_at_import:build"))
    finally:
        sys.modules.pop("r2_exits_at_import", None)
    assert "cannot be imported: SystemExit(5)" in node.scheduler.service("x").error  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("factory", "words"),
    [
        ("exiting_handler", "handler raised SystemExit(4)"),
        ("kbd_handler", "handler raised KeyboardInterrupt()"),
        ("custom_handler", "handler raised Custom('boom')"),
        ("unprintable_handler", "Unprintable whose repr failed"),
    ],
)
async def test_a_handler_raising_anything_is_the_calls_own_failure(
    node: Node, factory: str, words: str
):
    # before: SystemExit escaped the worker into the event loop and stopped the agent; an
    # exception whose repr fails was reported as the device's failure (device_lost)
    await node.prepare(ServiceSpec("h", f"{M}:{factory}"), ServiceSpec("ok", f"{M}:deep_handler"))
    await node.call("h1", "h", [0.0] * 8)
    out = await node.outcome("h1")
    assert (out.failure, out.exit_code) == (None, 1)
    assert words in out.detail
    await node.call("ok1", "ok", 0)  # the agent serves on
    assert (await node.outcome("ok1")).output == 1


async def test_a_list_subclass_of_outputs_is_read_as_its_items(node: Node):
    # before: its failing __len__ ran outside the handler's guard: reported as device_lost
    await node.prepare(ServiceSpec("l", f"{M}:lying_handler"))
    await node.call("l1", "l", [0.0] * 8)
    out = await node.outcome("l1")
    assert out.exit_code == 0
    assert out.output == mlp_handle(mlp(), [[0.0] * 8])[0]


@pytest.mark.parametrize(("depth", "words"), [(25, "deeper than 24 levels"), (2000, "recursion")])
async def test_an_output_nested_past_the_wire_fails_clearly(node: Node, depth: int, words: str):
    # before: the bus refused the completion forever (25) or the batch task died with a
    # RecursionError (2000): the call never ended
    await node.prepare(ServiceSpec("d", f"{M}:deep_handler", max_batch=1))
    for aid, d in [("ok", 24), ("deep", depth)]:
        await node.call(aid, "d", d)
    assert (await node.outcome("ok")).output == _nested(24)
    out = await node.outcome("deep")
    assert (out.failure, out.exit_code) == (None, 1)
    assert words in out.detail


async def test_a_model_no_device_can_hold_fails_its_registration(node: Node):
    # before: reported ready (so the registration succeeded) and every call was refused
    await node.prepare(ServiceSpec("huge", f"{M}:huge_factory", dops=(1, 2)))
    errors = {s.dop: s.error for s in node.scheduler.reports()[-1].services if s.name == "huge"}
    assert set(errors) == {1, 2}
    assert all("needs 5 MB on each device, more than any device" in e for e in errors.values())
    await node.call("c", "huge", [0.0] * 8)
    assert (await node.outcome("c")).failure is ErrorKind.INVALID_REQUEST
