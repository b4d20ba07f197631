"""The one exception tree of Tangram.

::

    TangramError                      base of everything raised by tangram
    ├── CallerError                   the request is wrong; fix it (carries a ``hint``)
    │   ├── InvalidRequest            failed validation (bad field, absurd resource, empty command)
    │   ├── NotFound                  no such action / environment
    │   └── Fenced                    the sender's incarnation was declared failed
    ├── RemoteError                   a service answered with an error reply (carries ``code``)
    │   └── Busy                      overloaded: retry after ``retry_after_s``
    ├── Unavailable                   no service answered in time (retryable)
    ├── ResultTimeout                 the action did not finish within the caller's wait
    ├── ServiceDead                   a worker or engine this process depends on is gone
    └── InternalError                 a bug: an invariant did not hold

Every error knows whether retrying can help (``retryable``). Third-party exceptions are
translated at the boundary with ``raise X(...) from exc`` and travel as
:class:`tangram.contract.ErrorReply`; :func:`from_reply` turns one back into an exception.
"""

from __future__ import annotations

from tangram.contract import ErrorReply


def clipped(text: str, limit: int) -> str:
    """``text`` for an error message: whole up to ``limit`` characters, else cut, saying how
    long it was (a sender's value quoted whole can make a reply too big to send)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


class TangramError(Exception):
    """Base of every error raised by tangram."""

    code = "internal"
    retryable = False

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s

    def to_reply(self) -> ErrorReply:
        """The wire form of this error."""
        return ErrorReply(
            code=self.code,
            message=self.message,
            retryable=self.retryable,
            retry_after_s=self.retry_after_s,
        )


class CallerError(TangramError):
    """The caller sent something wrong; ``hint`` says how to fix it."""

    code = "bad_request"

    def __init__(self, message: str, *, hint: str = "") -> None:
        super().__init__(f"{message} ({hint})" if hint else message)
        self.hint = hint


class InvalidRequest(CallerError):
    code = "invalid_request"


class NotFound(CallerError):
    code = "not_found"


class Fenced(CallerError):
    """The sender's incarnation was declared failed and is fenced: nothing from it counts
    any more (a node agent that hears this stops; its supervisor starts a new one)."""

    code = "fenced"


class RemoteError(TangramError):
    """A service replied with an error; ``code`` is the machine-readable reason."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        retryable: bool = False,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.code = code
        self.retryable = retryable


class Busy(RemoteError):
    def __init__(self, message: str, *, retry_after_s: float = 0.05) -> None:
        super().__init__("busy", message, retryable=True, retry_after_s=retry_after_s)


class Unavailable(TangramError):
    code = "unavailable"
    retryable = True


class ResultTimeout(TangramError):
    code = "timeout"
    retryable = True


class ServiceDead(TangramError):
    code = "service_dead"


class InternalError(TangramError):
    code = "internal"


_BY_CODE: dict[str, type[TangramError]] = {
    InvalidRequest.code: InvalidRequest,
    NotFound.code: NotFound,
    Fenced.code: Fenced,
    CallerError.code: CallerError,
}


def from_reply(reply: ErrorReply) -> TangramError:
    """Rebuild the exception that an :class:`ErrorReply` stands for."""
    if reply.code == "busy":
        return Busy(reply.message, retry_after_s=reply.retry_after_s or 0.05)
    caller = _BY_CODE.get(reply.code)
    if caller is not None:
        return caller(reply.message)
    return RemoteError(
        reply.code, reply.message, retryable=reply.retryable, retry_after_s=reply.retry_after_s
    )
