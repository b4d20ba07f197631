"""A small reward service built in code (random init, no weights downloaded), for the docs'
examples and the adapters' tests. Register it as any model service::

    tangram services register reward tangram.integrations.examples:reward_model --dops 1

Each payload is a :class:`~tangram.integrations.rewards.RewardQuery` (as a dict). The score
is 0.8 when the label appears in the response, plus 0.2 times what the model makes of the
response's bytes, so a right answer scores above 0.8 and a wrong one below 0.2. Its details
say both parts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Handle = Callable[[nn.Module, list[Any]], list[Any]]


def reward_model() -> tuple[nn.Module, Handle]:
    """The factory: ``(model, handle)`` in the model-service contract."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 16), nn.Tanh(), nn.Linear(16, 1)).eval()
    return model, _score


def _score(model: nn.Module, payloads: list[Any]) -> list[Any]:
    device = next(model.parameters()).device
    texts = [str(p.get("response", "")) if isinstance(p, dict) else str(p) for p in payloads]
    with torch.no_grad():
        fluency = torch.sigmoid(model(_histograms(texts).to(device))).squeeze(1).tolist()
    out = []
    for payload, text, f in zip(payloads, texts, fluency, strict=True):
        label = payload.get("label") if isinstance(payload, dict) else None
        want = "" if label is None else str(label).strip()
        match = 1.0 if want and want in text else 0.0
        out.append({"score": 0.8 * match + 0.2 * f, "match": match, "fluency": f})
    return out


def _histograms(texts: list[str]) -> torch.Tensor:
    """Each text's byte frequencies (256 features)."""
    rows = torch.zeros(len(texts), 256)
    for i, text in enumerate(texts):
        data = torch.tensor(list(text.encode()[:65536]) or [0], dtype=torch.long)
        rows[i] = torch.bincount(data, minlength=256).float() / len(data)
    return rows
