"""The service contract: factories load by import path; every failure is a typed error."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from services.gpu_manager import examples
from services.gpu_manager.services import build_service, load_factory
from tangram.errors import InvalidRequest

M = "tests.gpu_models"
EX = "services.gpu_manager.examples"


def test_builds_a_factory_by_import_path() -> None:
    built = build_service(f"{EX}:mlp_service")
    assert isinstance(built.model, torch.nn.Module)
    outs = built.handle(built.model, [[0.0] * 8, [1.0] * 8])
    assert len(outs) == 2
    assert outs == examples.mlp_handle(examples.mlp(), [[0.0] * 8, [1.0] * 8])


def test_dotted_attribute_path() -> None:
    assert load_factory(f"{M}:MlpConfig.__call__") is not None


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("tests.gpu_models", "not 'module:callable'"),
        (":mlp_service", "not 'module:callable'"),
        ("tests.gpu_models:", "not 'module:callable'"),
        ("tests.no_such_module:f", "cannot be imported"),
        (f"{M}:no_such_factory", "cannot be imported"),
        (f"{M}:NOT_CALLABLE", "is not callable"),
        (f"{M}:raising_service", "no such checkpoint"),
        (f"{M}:exiting_service", "SystemExit(3)"),
        (f"{M}:single_value", "not (model, handle)"),
        (f"{M}:not_a_module", "not torch.nn.Module"),
        (f"{M}:uncallable_handle", "handle is not callable"),
    ],
)
def test_bad_factories_are_typed_errors(path: str, words: str) -> None:
    with pytest.raises(InvalidRequest, match="factory") as info:
        build_service(path)
    assert words in str(info.value)
    assert info.value.hint


def test_import_time_failure_is_typed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken_user_mod.py").write_text("raise ValueError('bad import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(InvalidRequest, match="bad import"):
        build_service("broken_user_mod:f")


def test_user_factory_from_pythonpath(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "user_rewards_mod.py").write_text(
        textwrap.dedent(
            """
            import torch

            def judge():
                torch.manual_seed(1)
                model = torch.nn.Linear(2, 1)

                def handle(model, payloads):
                    x = torch.tensor(payloads, dtype=torch.float32)
                    return model(x).squeeze(1).tolist()

                return model, handle
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        built = build_service("user_rewards_mod:judge")
        assert len(built.handle(built.model, [[1.0, 2.0], [3.0, 4.0]])) == 2
    finally:
        sys.modules.pop("user_rewards_mod", None)
