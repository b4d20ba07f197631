"""The user contract of a model service, and loading one from its import path.

A service is a factory named ``"module:callable"``. Called with no arguments it returns a pair
``(model, handle)``: a ``torch.nn.Module`` whose parameters and buffers are the whole state the
gpu_manager moves between host and device, and ``handle(model, payloads) -> outputs``, which runs
on whatever device the model is on and returns one output per payload, in order. Example::

    # my_rewards.py (importable from the agent's PYTHONPATH)
    import torch

    def length_judge():
        model = torch.nn.Linear(4, 1)

        def handle(model, payloads):
            device = next(model.parameters()).device
            x = torch.tensor([p["features"] for p in payloads], device=device)
            with torch.no_grad():
                return model(x).squeeze(1).tolist()

        return model, handle

    # registered as ServiceSpec(name="judge", factory="my_rewards:length_judge", max_batch=32)

The handle receives a batch (dynamic batching coalesces concurrent calls) and runs under
``torch.inference_mode()``; outputs must be msgpack-able values, nested at most 24
containers deep (``tangram.bus.MAX_VALUE_NESTING``: the messages carrying them nest too). The
model's state must live in parameters and buffers (plain tensor attributes are not moved); a
buffer the handle adds (a cache built on first use) counts in the service's measured footprint
from its first pass on.
The factory runs once per gpu_manager and should not touch a GPU itself. Whatever goes wrong
while importing or building becomes :class:`InvalidRequest` naming the problem, and so does a
factory that has not returned within ``TANGRAM_GPU_PREPARE_TIMEOUT_S``; it never takes the
process down.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.gpu_manager.batching import safe_repr
from tangram.errors import InvalidRequest

Handle = Callable[[torch.nn.Module, list[Any]], list[Any]]
HINT = "a factory is 'module:callable' returning (torch.nn.Module, handle(model, payloads))"


@dataclass(frozen=True, slots=True)
class BuiltService:
    """A service built from its factory: the model (state on the host) and its handle."""

    factory: str
    model: torch.nn.Module
    handle: Handle


def load_factory(path: str) -> Callable[[], object]:
    """The callable named by ``"module:callable"`` (attributes may be dotted)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidRequest(f"factory {path!r} is not 'module:callable'", hint=HINT)
    try:
        target: object = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except BaseException as exc:  # any import-time failure is the user's, a
        # SystemExit or KeyboardInterrupt raised by the module too (it runs in a build thread)
        why = f"factory {path!r} cannot be imported: {safe_repr(exc)}"
        raise InvalidRequest(why, hint=HINT) from exc
    if not callable(target):
        raise InvalidRequest(f"factory {path!r} is not callable", hint=HINT)
    return target


def build_service(path: str) -> BuiltService:
    """Import and call the factory once, checking the pair it returns."""
    factory = load_factory(path)
    try:
        built = factory()
    except BaseException as exc:  # a user's sys.exit() must not stop the agent
        raise InvalidRequest(f"factory {path!r} raised {safe_repr(exc)}", hint=HINT) from exc
    return _checked(path, built)


def _checked(path: str, built: object) -> BuiltService:
    if not isinstance(built, tuple) or len(built) != 2:
        got = type(built).__name__
        raise InvalidRequest(f"factory {path!r} returned {got}, not (model, handle)", hint=HINT)
    model, handle = built
    if not isinstance(model, torch.nn.Module):
        got = type(model).__name__
        raise InvalidRequest(f"factory {path!r}: model is {got}, not torch.nn.Module", hint=HINT)
    if not callable(handle):
        raise InvalidRequest(f"factory {path!r}: handle is not callable", hint=HINT)
    return BuiltService(path, model, handle)
