"""``tangram up --schedulers N``: how many schedulers (one leads, the others stand by), refused
before anything starts when it makes no sense."""

from __future__ import annotations

import pytest

from tangram import cli


def test_up_runs_a_standby_scheduler_by_default():
    assert cli.parser().parse_args(["up"]).schedulers == 2
    assert cli.parser().parse_args(["up", "--schedulers", "1"]).schedulers == 1


@pytest.mark.parametrize("bad", ["0", "-1", "two", "10"])
def test_a_bad_scheduler_count_is_refused(bad: str, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exited:
        cli.parser().parse_args(["up", "--schedulers", bad])
    assert exited.value.code == 2
    assert "--schedulers" in capsys.readouterr().err
