"""Every framework's example in examples/integrations/ (the docs' end-to-end examples) runs
against a mesh, finding it as it finds the one `tangram up` runs."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tangram.launcher import Mesh

pytest.importorskip("verl.tools.base_tool", reason="needs tests/integrations/frameworks.txt")
pytest.importorskip("skyrl_gym", reason="needs tests/integrations/frameworks.txt")

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).parents[2] / "examples" / "integrations"


@pytest.fixture
def examples_path() -> Iterator[None]:
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.mark.parametrize("name", ["verl", "skyrl", "slime", "openrlhf", "rllm"])
async def test_example_runs(
    reward_mesh: Mesh, examples_path: None, name: str, capsys: pytest.CaptureFixture[str]
):
    module = importlib.import_module(f"{name}_example")
    if name == "skyrl":
        await module.register_reward()
        await asyncio.to_thread(module.episode)
    elif inspect.iscoroutinefunction(module.main):
        await module.main()
    else:
        await asyncio.to_thread(module.main)
    out = capsys.readouterr().out
    assert EXPECTED[name] in out, out


EXPECTED = {
    "verl": "72\n[exit code 0]",
    "skyrl": "[] reward=1.0 done=True",
    "slime": "group: [0.8",
    "openrlhf": "'match': [1.0, 0.0]",
    "rllm": "alive after close: False",
}
