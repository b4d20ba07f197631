"""Model factories for the gpu_manager tests and bench: the shared examples (importable by
the demo and users' docs, in ``services.gpu_manager.examples``) plus factories that break the
user contract on purpose. No weights are downloaded."""

from __future__ import annotations

import sys
import threading
from typing import Any

from torch import nn

from services.gpu_manager.examples import (
    LmConfig,
    MlpConfig,
    TiedLM,
    lm_handle,
    mlp,
    mlp_handle,
    mlp_service,
    teacher_handle,
    teacher_small,
    tied_lm,
    tied_lm_service,
    tiny_service,
    transformer,
)

__all__ = [
    "BATCH_SIZES",
    "GATE",
    "NOT_CALLABLE",
    "WIDE",
    "LmConfig",
    "MlpConfig",
    "TiedLM",
    "chatty_service",
    "exiting_service",
    "lm_handle",
    "mlp",
    "mlp_handle",
    "mlp_service",
    "not_a_module",
    "picky_service",
    "raising_service",
    "single_value",
    "slow_service",
    "teacher_handle",
    "teacher_small",
    "tied_lm",
    "tied_lm_service",
    "tiny_service",
    "transformer",
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


BATCH_SIZES: list[int] = []  # what slow_service's handle saw, in order
GATE = threading.Event()  # slow_service's handle waits for it (set: no wait)
GATE.set()


def _slow_handle(model: nn.Module, payloads: list[Any]) -> list[Any]:
    BATCH_SIZES.append(len(payloads))
    GATE.wait(10)
    return mlp_handle(model, payloads)


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
