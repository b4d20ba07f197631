"""Small torch models built in code (random init from a config) and service factories for the
gpu_manager tests and bench. No weights are downloaded."""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class MlpConfig:
    d_in: int = 8
    hidden: int = 32
    layers: int = 2
    d_out: int = 4
    seed: int = 0


def mlp(cfg: MlpConfig = MlpConfig()) -> nn.Module:
    torch.manual_seed(cfg.seed)
    dims = [cfg.d_in] + [cfg.hidden] * cfg.layers
    blocks: list[nn.Module] = []
    for a, b in itertools.pairwise(dims):
        blocks += [nn.Linear(a, b), nn.LayerNorm(b), nn.GELU()]
    return nn.Sequential(*blocks, nn.Linear(dims[-1], cfg.d_out)).eval()


class TiedLM(nn.Module):
    """Tied input/output embeddings, batch-norm buffers (incl. int64) and a float16 branch."""

    def __init__(self, vocab: int = 50, dim: int = 16, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, dim)
        self.norm = nn.BatchNorm1d(dim)
        self.mix = nn.Linear(dim, dim)
        self.side = nn.Linear(dim, 1).to(torch.float16)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor(0.5), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        e = self.emb(tokens)
        h = torch.tanh(self.mix(self.norm(e.flatten(0, -2)).view_as(e)))
        return self.head(h) * self.scale + self.side(h.half()).float()


def tied_lm(seed: int = 0) -> nn.Module:
    model = TiedLM(seed=seed)
    with torch.no_grad():  # non-trivial running stats, so buffers matter
        model.norm.running_mean.uniform_(-1, 1)
        model.norm.running_var.uniform_(0.5, 2)
    return model.eval()


@dataclass(frozen=True)
class LmConfig:
    """A transformer-shaped model; the defaults give ~400 MB of float32 state."""

    vocab: int = 32_000
    dim: int = 1024
    layers: int = 6
    ffn: int = 4096
    seed: int = 0


def transformer(cfg: LmConfig = LmConfig()) -> nn.Module:
    torch.manual_seed(cfg.seed)
    layer = nn.TransformerEncoderLayer(cfg.dim, 8, cfg.ffn, batch_first=True)
    encoder = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
    return nn.Sequential(nn.Embedding(cfg.vocab, cfg.dim), encoder).eval()


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def mlp_handle(model: nn.Module, payloads: list[Any]) -> list[Any]:
    x = torch.tensor(payloads, dtype=torch.float32, device=_device(model))
    return model(x).tolist()  # type: ignore[no-any-return]


def lm_handle(model: nn.Module, payloads: list[Any]) -> list[Any]:
    x = torch.tensor(payloads, dtype=torch.long, device=_device(model))
    return model(x).sum(dim=1).tolist()  # type: ignore[no-any-return]


# Service factories (the user contract): no arguments, returning (model, handle).
def mlp_service() -> tuple[nn.Module, Any]:
    return mlp(), mlp_handle


def tiny_service() -> tuple[nn.Module, Any]:
    return mlp(MlpConfig(d_in=4, hidden=8, layers=1, d_out=1)), mlp_handle


def tied_lm_service() -> tuple[nn.Module, Any]:
    return tied_lm(), lm_handle


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
