"""Retrying object-store calls: transient failures (5xx, throttling, timeouts, dropped connections)
are retried with exponential backoff up to a bound; anything else (403, a missing bucket) is raised
at once, because waiting cannot fix it and would only hide it.
"""

from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["RetryPolicy", "is_transient"]

log = logging.getLogger("checkpoint_manager")

_T = TypeVar("_T")

_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "RequestLimitExceeded",
        "TooManyRequests",
    }
)
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.EBUSY,  # s3fs: 503 SlowDown / ServiceUnavailable
        errno.EAGAIN,
        errno.ETIMEDOUT,
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.EPIPE,
        errno.EREMOTEIO,  # s3fs: 500 InternalError
    }
)
# by class name, so botocore/aiohttp need not be importable here
_TRANSIENT_CLASSES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "HTTPClientError",
        "ResponseParserError",
        "IncompleteRead",
        "ClientPayloadError",
        "ClientConnectionError",
        "ServerDisconnectedError",
        "FSTimeoutError",
    }
)


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen and len(seen) < 16:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def is_transient(exc: BaseException) -> bool:
    """Whether retrying ``exc`` may succeed: decided by the HTTP status or S3 error code when there
    is one (anywhere in the cause chain), else by the exception's kind."""
    for link in _chain(exc):
        response = getattr(link, "response", None)
        if isinstance(response, dict):  # botocore ClientError: the server's own verdict
            error = response.get("Error") or {}
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            return error.get("Code") in _TRANSIENT_CODES or status in _TRANSIENT_STATUS
    for link in _chain(exc):
        if isinstance(link, (PermissionError, FileNotFoundError, FileExistsError, IsADirectoryError)):
            return False
        if isinstance(link, (TimeoutError, ConnectionError)):
            return True
        if any(cls.__name__ in _TRANSIENT_CLASSES for cls in type(link).__mro__):
            return True
        if isinstance(link, OSError) and link.errno in _TRANSIENT_ERRNOS:
            return True
    return False


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries in all (1: no retry), sleeping ``backoff_s * 2**i`` (with jitter, capped) between."""

    attempts: int = 5
    backoff_s: float = 0.5
    max_backoff_s: float = 20.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")
        if self.backoff_s < 0:
            raise ValueError(f"backoff_s must be >= 0, got {self.backoff_s}")

    def delay(self, attempt: int) -> float:
        base = min(self.max_backoff_s, self.backoff_s * (2**attempt))
        return float(base * (0.5 + random.random() / 2))  # jitter: ranks retrying together spread out

    def call(self, fn: Callable[[], _T], what: str) -> _T:
        """``fn()``, retried while it fails transiently; the last error is raised with a note."""
        for attempt in range(self.attempts):
            try:
                return fn()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                if attempt + 1 >= self.attempts:
                    exc.add_note(f"checkpoint_manager: {what} failed {self.attempts} times (transient errors)")
                    raise
                wait = self.delay(attempt)
                log.warning(
                    "%s: transient error (%s: %s); retry %d/%d in %.2fs",
                    what,
                    type(exc).__name__,
                    exc,
                    attempt + 1,
                    self.attempts - 1,
                    wait,
                )
                time.sleep(wait)
        raise AssertionError("unreachable")  # pragma: no cover
