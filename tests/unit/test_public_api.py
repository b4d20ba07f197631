"""The public surface is exactly what tangram.__all__ names, and it all imports."""

import tangram

EXPECTED = {
    "Accepted",
    "ActionError",
    "ActionResult",
    "ActionSpec",
    "Allocation",
    "Busy",
    "CallerError",
    "Client",
    "DurationHint",
    "ErrorKind",
    "ExecAction",
    "InternalError",
    "InvalidRequest",
    "NotFound",
    "QuotaSpec",
    "RemoteError",
    "ResultTimeout",
    "ServiceDead",
    "ServiceSpec",
    "ServiceState",
    "SyncClient",
    "TangramError",
    "Timings",
    "Unavailable",
    "__version__",
}


def test_public_api_is_pinned():
    assert set(tangram.__all__) == EXPECTED
    for name in tangram.__all__:
        assert hasattr(tangram, name), name


def test_error_kinds_separate_the_policys_fault_from_infrastructure():
    kinds = {k for k in tangram.ErrorKind if not k.infrastructure}
    assert kinds == {tangram.ErrorKind.COMMAND_FAILED}
