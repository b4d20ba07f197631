"""Small model services built in code (random init from a config; no weights downloaded):
the examples the docs, the demo, the tests and the bench share.

Each ``*_service`` function is a factory in the user contract (see ``services.py``): no
arguments, returns ``(model, handle)``. Register one with, e.g.::

    await client.register_service(
        tangram.ServiceSpec("teacher-s", "services.gpu_manager.examples:teacher_small")
    )
    result = await client.infer("teacher-s", "def add(a, b): return a + b", job_id="j")
    result.output  # the teacher's mean next-byte log-likelihood of the text
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from services.gpu_manager.services import Handle

# --------------------------------------------------------------------------- models


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
        out: torch.Tensor = self.head(h) * self.scale + self.side(h.half()).float()
        return out


def tied_lm(seed: int = 0) -> nn.Module:
    model = TiedLM(seed=seed)
    mean, var = model.norm.running_mean, model.norm.running_var
    assert mean is not None
    assert var is not None
    with torch.no_grad():  # non-trivial running stats, so buffers matter
        mean.uniform_(-1, 1)
        var.uniform_(0.5, 2)
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


# --------------------------------------------------------------------------- handles


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def mlp_handle(model: nn.Module, payloads: list[Any]) -> list[Any]:
    """Payloads are feature vectors; outputs the model's output vectors."""
    x = torch.tensor(payloads, dtype=torch.float32, device=_device(model))
    return model(x).tolist()  # type: ignore[no-any-return]


def lm_handle(model: nn.Module, payloads: list[Any]) -> list[Any]:
    """Payloads are equal-length token lists; outputs the summed hidden states."""
    x = torch.tensor(payloads, dtype=torch.long, device=_device(model))
    return model(x).sum(dim=1).tolist()  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- teachers

TEACHER_VOCAB = 256  # bytes of the text
TEACHER_MAX_LEN = 64


class Teacher(nn.Module):
    """A small byte-level causal LM: scores a text by its mean next-byte log-likelihood."""

    def __init__(self, cfg: LmConfig) -> None:
        super().__init__()
        torch.manual_seed(cfg.seed)
        self.emb = nn.Embedding(cfg.vocab, cfg.dim)
        layer = nn.TransformerEncoderLayer(cfg.dim, 4, cfg.ffn, batch_first=True)
        self.body = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
        self.head = nn.Linear(cfg.dim, cfg.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device)
        return self.head(self.body(self.emb(tokens), mask=causal, is_causal=True))  # type: ignore[no-any-return]


def teacher(layers: int, seed: int, dim: int = 512, ffn: int = 2048) -> nn.Module:
    """A teacher of ``layers`` layers (~12.6 MB of float32 state per layer at the defaults)."""
    return Teacher(LmConfig(vocab=TEACHER_VOCAB, dim=dim, layers=layers, ffn=ffn, seed=seed)).eval()


def _bytes_of(text: Any) -> list[int]:
    data = str(text).encode()[:TEACHER_MAX_LEN]
    return list(data) or [0]


def teacher_handle(model: nn.Module, payloads: list[Any]) -> list[Any]:
    """Payloads are texts; outputs each text's mean next-byte log-likelihood (a float)."""
    seqs = [_bytes_of(p) for p in payloads]
    width = max(len(s) for s in seqs) + 1
    tokens = torch.zeros(len(seqs), width, dtype=torch.long, device=_device(model))
    for i, s in enumerate(seqs):
        tokens[i, 1 : len(s) + 1] = torch.tensor(s)  # byte 0 starts every text
    with torch.no_grad():
        logp = model(tokens[:, :-1]).log_softmax(-1).gather(-1, tokens[:, 1:, None])[..., 0]
    return [round(float(logp[i, : len(s)].mean()), 6) for i, s in enumerate(seqs)]


# --------------------------------------------------------------------------- factories
# The user contract: no arguments, returning (model, handle).


def mlp_service() -> tuple[nn.Module, Handle]:
    return mlp(), mlp_handle


def tiny_service() -> tuple[nn.Module, Handle]:
    return mlp(MlpConfig(d_in=4, hidden=8, layers=1, d_out=1)), mlp_handle


def tied_lm_service() -> tuple[nn.Module, Handle]:
    return tied_lm(), lm_handle


def teacher_small() -> tuple[nn.Module, Handle]:
    return teacher(1, seed=1), teacher_handle


def teacher_medium() -> tuple[nn.Module, Handle]:
    return teacher(2, seed=2), teacher_handle


def teacher_large() -> tuple[nn.Module, Handle]:
    return teacher(4, seed=3), teacher_handle
