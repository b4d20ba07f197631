"""Model factories only the gpu_manager tests need: factories that break the user contract on
purpose, or that let a test steer them (gates, recorded batch sizes). The models users, the demo
and the bench share are in ``services.gpu_manager.examples``. No weights are downloaded."""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch
from torch import nn

from services.gpu_manager.examples import MlpConfig, mlp, mlp_handle

__all__ = [
    "BATCH_SIZES",
    "BLOCK",
    "BLOCKED",
    "GATE",
    "GROWN_BYTES",
    "KEPT",
    "NOT_CALLABLE",
    "WIDE",
    "blocked_service",
    "chatty_service",
    "clinging_service",
    "exiting_service",
    "growing_service",
    "not_a_module",
    "picky_service",
    "raising_service",
    "single_value",
    "slow_service",
    "uncallable_handle",
    "unencodable_service",
    "wide_a",
    "wide_b",
]


def raising_service() -> tuple[nn.Module, Any]:
    raise RuntimeError("no such checkpoint")


def exiting_service() -> tuple[nn.Module, Any]:
    sys.exit(3)


def single_value() -> nn.Module:
    return mlp()


def not_a_module() -> tuple[Any, Any]:
    return "model", mlp_handle


def uncallable_handle() -> tuple[nn.Module, Any]:
    return mlp(), 42


NOT_CALLABLE = 7


# --------------------------------------------------------------------------- agent tests

WIDE = MlpConfig(hidden=400, layers=2)  # ~0.66 MB of state: two never fit a 1 MB device


def wide_a() -> tuple[nn.Module, Any]:
    return mlp(WIDE), mlp_handle


def wide_b() -> tuple[nn.Module, Any]:
    return mlp(MlpConfig(hidden=400, layers=2, seed=1)), mlp_handle


KEPT: list[torch.Tensor] = []  # what clinging_service's handle held on to


def _clinging_handle(model: nn.Module, payloads: list[Any]) -> list[Any]:
    KEPT.append(next(model.parameters()))  # a view of the copy's arena, kept past the call
    return mlp_handle(model, payloads)


def clinging_service() -> tuple[nn.Module, Any]:
    """wide_a's model whose handle keeps a parameter (a cache a user might build)."""
    return mlp(WIDE), _clinging_handle


BATCH_SIZES: list[int] = []  # what slow_service's handle saw, in order
GATE = threading.Event()  # slow_service's handle waits for it (set: no wait)
GATE.set()


def _slow_handle(model: nn.Module, payloads: list[Any]) -> list[Any]:
    BATCH_SIZES.append(len(payloads))
    GATE.wait(10)
    return mlp_handle(model, payloads)


GROWN_BYTES = 600_000  # what growing_service's handle adds to its model on its first call


def _growing_handle(model: nn.Module, payloads: list[Any]) -> list[Any]:
    if "cache" not in model._buffers:  # a cache built on first use: state prepare never saw
        device = next(model.parameters()).device
        model.register_buffer("cache", torch.zeros(GROWN_BYTES // 4, device=device))
    return mlp_handle(model, payloads)


def growing_service() -> tuple[nn.Module, Any]:
    """A tiny model whose handle grows its state past what prepare measured."""
    return mlp(), _growing_handle


BLOCK = threading.Event()  # blocked_service's factory waits for it (set: no wait)
BLOCK.set()
BLOCKED: list[str] = []  # "returned" once blocked_service's factory returned


def blocked_service() -> tuple[nn.Module, Any]:
    """A factory stuck in its build until BLOCK is set (never, in another process)."""
    BLOCK.wait()
    BLOCKED.append("returned")
    return mlp(), mlp_handle


def slow_service() -> tuple[nn.Module, Any]:
    return mlp(), _slow_handle


def _picky_handle(model: nn.Module, payloads: list[Any]) -> list[Any]:
    if any(p == "bad" for p in payloads):
        raise ValueError("payload 'bad' is not a feature vector")
    return mlp_handle(model, payloads)


def picky_service() -> tuple[nn.Module, Any]:
    return mlp(), _picky_handle


def chatty_service() -> tuple[nn.Module, Any]:
    return mlp(), lambda model, payloads: ["x" * 100_000 for _ in payloads]


def unencodable_service() -> tuple[nn.Module, Any]:
    return mlp(), lambda model, payloads: [object() for _ in payloads]
