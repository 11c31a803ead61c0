"""A fault-injecting HTTP/1.1 proxy for the object-store tests: it sits on 127.0.0.1 (a
free port) between a client and an S3-compatible server (moto's), and does something to
some of the requests it relays.

    with FaultProxy(server.endpoint, seed=1, error=0.1, drop_before=0.05) as proxy:
        env = {**server.env, "AWS_ENDPOINT_URL": proxy.endpoint}
        ...
        proxy.counts  # {"forward": 120, "error": 13, "drop_before": 6, "drop_after": 0}

It parses both directions into messages (request line or status line, headers, then a
body framed by ``Content-Length`` or ``Transfer-Encoding: chunked``; no body for an
answer to HEAD, for 1xx, 204 and 304), so it acts on each request of a keep-alive
connection. Per request it draws, with a seeded random generator, one of:

* ``error``: answers ``503 Slow Down`` with an S3 error document itself (the server
  never sees the request);
* ``drop_before``: closes the client's connection without forwarding the request;
* ``drop_after``: forwards the request, reads the server's whole answer, then closes the
  client's connection instead of relaying it (the server did the work; its answer is
  lost);
* ``forward``: relays the request and the answer untouched.

Only requests accepted by ``when`` (a predicate on :class:`Request`) are subject to
faults; ``limit`` caps how many faults are injected (then everything is forwarded).
:meth:`FaultProxy.set` changes all of this while the proxy runs. Each client connection
has its own thread and its own connection to the server.

:meth:`FaultProxy.stall` makes it stop answering, as a server stopped with ``SIGSTOP``
does: from the first request a predicate accepts, every request (``stall``) is read and
held, connections are still accepted, and nothing comes back; :meth:`FaultProxy.resume`
then forwards what was held (as a continued server answers what queued up, to clients
that may have given up) and relays everything again. ``observe`` (a callable) sees each
request before anything is done with it, e.g. to ``SIGSTOP`` the server at a chosen
request.
"""

from __future__ import annotations

import contextlib
import random
import socket
import socketserver
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from io import BufferedIOBase
from urllib.parse import urlsplit

KINDS = ("forward", "error", "drop_before", "drop_after", "stall")
_MAX_LINE = 65536
_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
    b"<RequestId>fault-proxy</RequestId><HostId>fault-proxy</HostId></Error>"
)


class _Closed(Exception):
    """The peer closed its connection (cleanly, between messages, or not)."""


@dataclass
class Request:
    """One parsed request: ``headers`` keys are lower case; ``raw`` is what is forwarded."""

    method: str
    target: str  # path and query, as sent
    headers: dict[str, str]
    raw: bytes = field(repr=False)

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    @property
    def query(self) -> str:
        return self.target.split("?", 1)[1] if "?" in self.target else ""


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    raw: bytes = field(repr=False)
    until_close: bool  # framed by the end of the connection: it cannot be kept alive


def _line(stream: BufferedIOBase) -> bytes:
    line = stream.readline(_MAX_LINE)
    if not line:
        raise _Closed
    if not line.endswith(b"\n"):
        raise ValueError("an HTTP line too long or cut off")
    return line


def _head(stream: BufferedIOBase) -> tuple[bytes, bytes, dict[str, str]]:
    """The start line, the raw header lines (with the empty line), and the headers."""
    start = _line(stream)
    while start in (b"\r\n", b"\n"):  # tolerated between messages
        start = _line(stream)
    lines: list[bytes] = []
    headers: dict[str, str] = {}
    while True:
        line = _line(stream)
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return start, b"".join(lines), headers


def _exactly(stream: BufferedIOBase, n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise _Closed
    return data


def _body(stream: BufferedIOBase, headers: dict[str, str]) -> bytes | None:
    """The raw body framed by ``headers`` (chunked: as sent, trailers included), or None
    when it is framed by neither (it then runs to the end of the connection)."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        parts = []
        while True:
            size_line = _line(stream)
            parts.append(size_line)
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    trailer = _line(stream)
                    parts.append(trailer)
                    if trailer in (b"\r\n", b"\n"):
                        return b"".join(parts)
            parts.append(_exactly(stream, size + 2))  # data and its CRLF
    if "content-length" in headers:
        return _exactly(stream, int(headers["content-length"]))
    return None


def read_request(stream: BufferedIOBase, answer: BufferedIOBase | None = None) -> Request:
    """The next request on ``stream``; an ``Expect: 100-continue`` is answered on
    ``answer`` (the proxy reads the whole body before deciding what to do with it)."""
    start, header_lines, headers = _head(stream)
    method, target, _version = start.decode("latin-1").split(" ", 2)
    expects = headers.get("expect", "").lower() == "100-continue"
    if expects and answer is not None:
        answer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        answer.flush()
    body = _body(stream, headers) or b""
    if expects:
        # The server gets the request whole, so it must not answer 100 itself.
        header_lines = b"".join(
            line
            for line in header_lines.splitlines(keepends=True)
            if not line.lower().startswith(b"expect:")
        )
    return Request(method, target, headers, start + header_lines + body)


def read_response(stream: BufferedIOBase, method: str) -> Response:
    while True:
        start, header_lines, headers = _head(stream)
        status = int(start.split(b" ", 2)[1])
        if not 100 <= status < 200 or status == 101:
            break  # 1xx answers are interim: the real one follows
    raw = start + header_lines
    if method == "HEAD" or status in (204, 304):
        return Response(status, headers, raw, False)
    body = _body(stream, headers)
    if body is None:
        rest = stream.read()  # to the end of the connection
        return Response(status, headers, raw + rest, True)
    return Response(status, headers, raw + body, False)


def _wants_close(version_line: bytes, headers: dict[str, str]) -> bool:
    connection = headers.get("connection", "").lower()
    if version_line.startswith(b"HTTP/1.0"):
        return "keep-alive" not in connection
    return "close" in connection


class FaultProxy:
    """A fault-injecting proxy in front of ``upstream`` (``http://host:port``)."""

    def __init__(
        self,
        upstream: str,
        *,
        seed: int = 0,
        error: float = 0.0,
        drop_before: float = 0.0,
        drop_after: float = 0.0,
        when: Callable[[Request], bool] | None = None,
        limit: int | None = None,
        observe: Callable[[Request], None] | None = None,
    ) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or parts.hostname is None or parts.port is None:
            raise ValueError(f"{upstream}: need http://host:port")
        self.upstream = (parts.hostname, parts.port)
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self.counts: Counter[str] = Counter({k: 0 for k in KINDS})
        #: (method, target, what was done), in the order requests were decided.
        self.log: list[tuple[str, str, str]] = []
        self.error = self.drop_before = self.drop_after = 0.0
        self.when: Callable[[Request], bool] | None = None
        self.limit: int | None = None
        self.observe = observe
        self._stall_from: Callable[[Request], bool] | None = None
        self._stalled = False
        self._resumed = threading.Event()
        self._resumed.set()
        #: Set once the stall began (a request was held).
        self.stalled = threading.Event()
        self.set(
            error=error, drop_before=drop_before, drop_after=drop_after, when=when, limit=limit
        )
        self._server: socketserver.ThreadingTCPServer | None = None
        self._thread: threading.Thread | None = None
        self.endpoint = ""

    def set(
        self,
        *,
        error: float | None = None,
        drop_before: float | None = None,
        drop_after: float | None = None,
        when: Callable[[Request], bool] | None = None,
        limit: int | None = None,
        clear_filter: bool = False,
    ) -> None:
        """Change the probabilities (those given), the filter (given, or cleared with
        ``clear_filter``) and the cap on faults from now on (``limit`` counts faults
        injected from this call; None: no cap)."""
        with self._lock:
            if error is not None:
                self.error = error
            if drop_before is not None:
                self.drop_before = drop_before
            if drop_after is not None:
                self.drop_after = drop_after
            if sum((self.error, self.drop_before, self.drop_after)) > 1.0 + 1e-9:
                raise ValueError("the fault probabilities add up to more than 1")
            if when is not None or clear_filter:
                self.when = when
            self.limit = limit

    def calm(self) -> None:
        """No more faults: forward everything."""
        self.set(error=0.0, drop_before=0.0, drop_after=0.0, clear_filter=True)

    def stall(self, after: Callable[[Request], bool] | None = None) -> None:
        """Stop answering from the first request ``after`` accepts (None: from the next
        request): it and every later request are held until :meth:`resume`."""
        with self._lock:
            self._stall_from = after or (lambda request: True)
            self._resumed.clear()

    def resume(self) -> None:
        """Forward the held requests and relay everything from now on."""
        with self._lock:
            self._stall_from = None
            self._stalled = False
            self.stalled.clear()
            self._resumed.set()

    @property
    def faults(self) -> int:
        with self._lock:
            return sum(self.counts[k] for k in KINDS if k != "forward")

    def decide(self, request: Request) -> str:
        """What to do with ``request`` (counted)."""
        with self._lock:
            kind = "forward"
            if self._stall_from is not None and (self._stalled or self._stall_from(request)):
                self._stalled = True
                self.stalled.set()
                kind = "stall"
            elif (self.limit is None or self.limit > 0) and (
                self.when is None or self.when(request)
            ):
                x = self._rng.random()
                if x < self.error:
                    kind = "error"
                elif x < self.error + self.drop_before:
                    kind = "drop_before"
                elif x < self.error + self.drop_before + self.drop_after:
                    kind = "drop_after"
                if kind != "forward" and self.limit is not None:
                    self.limit -= 1
            self.counts[kind] += 1
            self.log.append((request.method, request.target, kind))
            return kind

    # -- running ------------------------------------------------------------------

    def __enter__(self) -> FaultProxy:
        proxy = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                proxy._serve(self.connection, self.rfile, self.wfile)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

            def handle_error(self, request: object, client_address: object) -> None:
                pass  # a client that went away: nothing to report

        self._server = Server(("127.0.0.1", 0), Handler)
        port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._resumed.set()  # no thread stays held
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(10)

    def _serve(self, client: socket.socket, rfile: BufferedIOBase, wfile: BufferedIOBase) -> None:
        upstream: socket.socket | None = None
        up_r: BufferedIOBase | None = None
        try:
            while True:
                try:
                    request = read_request(rfile, wfile)
                except (_Closed, OSError, ValueError):
                    return
                if self.observe is not None:
                    self.observe(request)
                kind = self.decide(request)
                if kind == "stall":
                    self._resumed.wait()
                if kind == "drop_before":
                    return
                if kind == "error":
                    wfile.write(
                        b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                        b"Content-Length: %d\r\nx-amz-request-id: fault-proxy\r\n\r\n%s"
                        % (len(_SLOW_DOWN), _SLOW_DOWN)
                    )
                    wfile.flush()
                    continue
                response = None
                for _ in range(2):  # a kept-alive connection the server closed: reconnect
                    reused = upstream is not None
                    if upstream is None:
                        upstream = socket.create_connection(self.upstream, timeout=120)
                        up_r = upstream.makefile("rb")
                    assert up_r is not None
                    try:
                        upstream.sendall(request.raw)
                        response = read_response(up_r, request.method)
                        break
                    except (_Closed, OSError, ValueError):
                        up_r.close()
                        upstream.close()
                        upstream = up_r = None
                        if not reused:
                            break
                if response is None:
                    return  # the server went away: so does the client's connection
                if kind == "drop_after":
                    return
                wfile.write(response.raw)
                wfile.flush()
                status_line = response.raw.split(b"\r\n", 1)[0]
                if response.until_close or _wants_close(status_line, response.headers):
                    return
                if _wants_close(request.raw.split(b"\r\n", 1)[0], request.headers):
                    return
        except OSError:
            return
        finally:
            if upstream is not None:
                if up_r is not None:
                    up_r.close()
                upstream.close()
            _hang_up(client)


def _hang_up(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
