"""rLLM: TangramSandbox as the sandbox of an agent's task: upload the task's files, run its
check, close.

    tangram up &    # then:
    python examples/integrations/rllm_example.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from tangram.integrations.rllm import create_tangram_sandbox


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        task = Path(tmp) / "task"
        task.mkdir()
        (task / "solution.py").write_text("def square(x):\n    return x * x\n")
        (task / "check.py").write_text("from solution import square\nassert square(7) == 49\n")
        sandbox = create_tangram_sandbox("example", job_id="rllm-example")
        try:
            print("alive:", sandbox.is_alive())
            sandbox.upload_dir(str(task), "task")
            print(sandbox.exec("cd task && python3 check.py && echo passed"))
            try:
                sandbox.exec("cd task && python3 -c 'import solution; solution.cube'")
            except RuntimeError as exc:  # what rLLM's backends raise on a failed command
                print("failed as expected:", str(exc).splitlines()[0])
        finally:
            sandbox.close()
        print("alive after close:", sandbox.is_alive())


if __name__ == "__main__":
    main()
