"""The S3 client of :mod:`distckpt.storage.s3`, and the deadline on its requests.

Every request, its retries included, ends within a :class:`Deadline`
(``$DISTCKPT_S3_TIMEOUT``): socket time-outs cut a try that waits on a silent service,
and no retry starts that could end after the deadline (hooks in botocore's own retry
loop, :func:`_before_try` and :func:`_after_try`). A request that got no answer marks the
service silent (:class:`_Service`): the requests in flight stop after their try, and
every later one fails at once, until the service answers a probe again.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from distckpt import settings
from distckpt.errors import StorageError

log = logging.getLogger("distckpt.storage.s3")

T = TypeVar("T")

#: Tries of one request (botocore's standard retry mode) unless AWS_MAX_ATTEMPTS is set.
MAX_ATTEMPTS = 8

#: Seconds one request may wait on a service that does not answer (see :class:`Deadline`).
TIMEOUT_ENV = settings.S3_TIMEOUT.name
#: The default deadline is a third of ``$DISTCKPT_TIMEOUT``, but never less than this.
MIN_DEFAULT_TIMEOUT = 30.0
# Answers botocore retries besides 5xx and 429 (its standard mode's transient and
# throttling codes that S3 sends).
_RETRIED = {"RequestTimeout", "RequestTimeoutException", "Throttling", "SlowDown"}


@dataclass(frozen=True)
class Deadline:
    """How long one request may take when the service does not answer: ``total``
    seconds, its retries included.

    A try that waits on a silent service is cut by the socket time-outs: ``connect``
    (for the connection, and for each send of the body) and ``read`` (for each read of
    the socket, so a slow transfer that keeps moving is never cut). A retry starts only
    while a whole try (:attr:`one_try`) still fits before ``total``. A request that keeps
    getting answers (a body that arrives slowly, a listing of many pages: each page is
    one request) is never cut short by the deadline.
    """

    total: float

    @property
    def connect(self) -> float:
        return min(10.0, self.total / 4)

    @property
    def read(self) -> float:
        return min(60.0, self.total / 2 - self.connect)

    @property
    def one_try(self) -> float:
        """The longest one try waits on a silent service (botocore also waits up to 1 s
        for a ``100 Continue``)."""
        return self.connect + self.read + 1.0

    def may_retry(self, start: float) -> bool:
        """Whether a request that started at ``start`` (``time.monotonic()``) may try again."""
        return time.monotonic() - start + self.one_try <= self.total


def deadline() -> Deadline:
    """The deadline of this process's requests: ``$DISTCKPT_S3_TIMEOUT`` seconds (at
    least 2), else a third of ``$DISTCKPT_TIMEOUT`` but at least
    :data:`MIN_DEFAULT_TIMEOUT` (100 s by default), so that a rank whose service stops
    answering fails (within twice the deadline) before the other ranks' collectives time
    out waiting for it."""
    total = settings.S3_TIMEOUT.get()
    if total is None:
        return Deadline(max(MIN_DEFAULT_TIMEOUT, settings.TIMEOUT.value() / 3))
    return Deadline(total)


class _Service:
    """This process's client for one endpoint, and whether its service stopped answering.

    A request that got no answer (:func:`_transient`, after its retries) marks the
    service silent: the requests in flight then stop at the end of their try, and every
    new one fails at once (so a failing save's clean-up, and the lease heartbeats, do not
    wait a deadline each), while one probe at a time asks for the bucket. The first
    answer to anything, the probe's or another request's, ends it.
    """

    def __init__(self, limits: Deadline) -> None:
        self.deadline = limits
        self._lock = threading.Lock()
        #: ``time.monotonic()`` when a request last found the service silent; None
        #: while it answers.
        self.silent_since: float | None = None
        self._probing = False
        self._answered = threading.Event()
        self._answered.set()
        self.client = _new_client(self)

    def answered(self) -> None:
        if self.silent_since is not None:
            with self._lock:
                self.silent_since = None
                self._answered.set()

    def fell_silent(self, bucket: str) -> None:
        with self._lock:
            if self.silent_since is not None:
                return
            self.silent_since = time.monotonic()
            self._answered.clear()
            start, self._probing = not self._probing, True
        if start:
            threading.Thread(
                target=self._probe, args=(bucket,), name="distckpt-s3-probe", daemon=True
            ).start()

    def _probe(self, bucket: str) -> None:
        while True:
            with self._lock:
                if self.silent_since is None:
                    self._probing = False
                    return
            try:
                self.client.head_bucket(Bucket=bucket)
            except Exception as exc:
                if transient(exc):  # still no answer
                    self._answered.wait(min(1.0, self.deadline.connect))
                    continue
            self.answered()

    def may_retry(self, start: float) -> bool:
        return self.silent_since is None and self.deadline.may_retry(start)

    def wait(self, timeout: float | None) -> bool:
        return self._answered.wait(timeout)


_clients: dict[tuple[int, str | None, float], _Service] = {}
_clients_lock = threading.Lock()


def current_service() -> _Service:
    limits = deadline()
    key = (os.getpid(), os.environ.get("AWS_ENDPOINT_URL"), limits.total)
    found = _clients.get(key)
    if found is not None:
        return found
    with _clients_lock:
        if key not in _clients:
            for old in [k for k in _clients if k[0] != key[0]]:
                del _clients[old]  # a parent's client does not survive a fork
            _clients[key] = _Service(limits)
        return _clients[key]


def client() -> Any:
    """This process's S3 client for the current endpoint (thread-safe; a forked child
    makes its own)."""
    return current_service().client


def answering(timeout: float | None = None) -> bool:
    """Wait until the service of the current endpoint answers again, after a request
    found it silent (at once when none did); False when ``timeout`` seconds pass first.
    Until then every request fails at once with :class:`~distckpt.errors.StorageError`."""
    return current_service().wait(timeout)


def _new_client(service: _Service) -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise StorageError("s3:// locations need boto3: pip install 'distckpt[s3]'") from None
    options: dict[str, Any] = {
        "max_pool_connections": 64,
        "connect_timeout": service.deadline.connect,
        "read_timeout": service.deadline.read,
        "tcp_keepalive": True,
    }
    if not (os.environ.get("AWS_MAX_ATTEMPTS") or os.environ.get("AWS_RETRY_MODE")):
        # total_max_attempts counts the first try; botocore's max_attempts would not.
        options["retries"] = {"mode": "standard", "total_max_attempts": MAX_ATTEMPTS}
    made = boto3.session.Session().client("s3", config=Config(**options))
    # First, so that they decide before botocore's own retry handler sleeps.
    made.meta.events.register_first("request-created.s3", functools.partial(_before_try, service))
    made.meta.events.register_first("needs-retry.s3", functools.partial(_after_try, service))
    return made


# -- the deadline inside botocore's retries ------------------------------------------
#
# botocore runs a request and its retries in the calling thread: "request-created" comes
# before each try, "needs-retry" after it. Both see the request's context dict, where the
# first try notes when the request started (or when the operation around it did, see
# _one_deadline) and each failed try leaves its error. A handler that raises ends the
# request with that error, as if the retries were used up.

_START = "distckpt_start"
_FAILURE = "distckpt_failure"
_local = threading.local()


@contextlib.contextmanager
def one_deadline() -> Iterator[float]:
    """The requests made inside (a conditional write and its read-back, a GET and the
    reads of its body) share one deadline: the outermost's start, which it yields."""
    start = getattr(_local, "start", None)
    if start is not None:
        yield start
        return
    _local.start = start = time.monotonic()
    try:
        yield start
    finally:
        _local.start = None


def _before_try(service: _Service, request: Any, **_: Any) -> None:
    context = getattr(request, "context", None)
    if context is None:
        return
    start = context.get(_START)
    if start is None:  # the first try
        outer = getattr(_local, "start", None)
        context[_START] = time.monotonic() if outer is None else outer
    elif not service.may_retry(start) and context.get(_FAILURE) is not None:
        raise context[_FAILURE]  # botocore's back-off slept past the deadline


def _after_try(
    service: _Service,
    response: Any = None,
    caught_exception: BaseException | None = None,
    request_dict: dict[str, Any] | None = None,
    operation: Any = None,
    **_: Any,
) -> None:
    if response is not None:
        service.answered()
    failure: BaseException | None = caught_exception
    if failure is None and response is not None:
        status, parsed = response[0].status_code, response[1]
        code = parsed.get("Error", {}).get("Code") if isinstance(parsed, dict) else None
        if status >= 500 or status == 429 or code in _RETRIED:
            from botocore.exceptions import ClientError

            failure = ClientError(parsed, operation.name if operation is not None else "")
    if failure is None:
        return
    context = (request_dict or {}).get("context", {})
    context[_FAILURE] = failure
    if not service.may_retry(context.get(_START, time.monotonic())):
        raise failure


def error_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        error = response.get("Error", {})
        code = error.get("Code") or str(response.get("ResponseMetadata", {}).get("HTTPStatusCode"))
        return str(code)
    return None


def back_off(attempt: int, start: float | None = None) -> None:
    """Back off before try ``attempt + 1``; never past the point where the request that
    started at ``start`` could no longer make that try (see :class:`Deadline`)."""
    delay = min(5.0, 0.05 * 2**attempt) * (0.5 + random.random())
    if start is not None:
        limits = current_service().deadline
        delay = min(delay, max(0.0, start + limits.total - limits.one_try - time.monotonic()))
    time.sleep(delay)


def body_retry(fn: Callable[[], T]) -> T:
    """``fn`` (a GET and the read of its body), tried again if the body is cut off, within
    one deadline."""
    with one_deadline() as start:
        for attempt in range(MAX_ATTEMPTS):
            try:
                return fn()
            except Exception as exc:
                if (
                    error_code(exc) is not None
                    or attempt + 1 == MAX_ATTEMPTS
                    or not transient(exc)
                    or not current_service().may_retry(start)
                ):
                    raise
                log.debug("retrying a read cut off: %s", one_line(exc))
                back_off(attempt, start)
    raise AssertionError("unreachable")


def transient(exc: BaseException) -> bool:
    names = {t.__name__ for t in type(exc).__mro__}
    return bool(
        names
        & {
            "ResponseStreamingError",
            "IncompleteReadError",
            "ProtocolError",
            "ConnectionError",
            "ReadTimeoutError",
            "IncompleteRead",
            "ConnectionClosedError",
            "EndpointConnectionError",
        }
    )


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]
