"""A real S3 server on loopback for tests and benchmarks: moto's server mode, plus a fault proxy.

``MotoS3`` starts moto's server on 127.0.0.1 (a thread, or its own process) on a port the server
binds itself, and waits (bounded) until it answers. ``FaultProxy`` sits in front of it and forwards every request unchanged, except
that it can fail every k-th request with a transient 503, deny matching requests with a permanent
403, or hold matching requests until released (so a test can kill a writer mid-upload). s3fs talks
to either through ``client_kwargs={"endpoint_url": ...}`` with dummy credentials.
"""

from __future__ import annotations

import contextlib
import http.client
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["FaultProxy", "MotoS3", "storage_options"]

STARTUP_TIMEOUT_S = 120.0  # a hang guard only: every wait ends as soon as the server answers
DUMMY_KEY = "testing-key-id"
DUMMY_SECRET = "testing-secret-do-not-log"


def _wait_listening(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"S3 test server on port {port} did not start within {timeout_s}s") from None
            time.sleep(0.05)


def storage_options(endpoint: str, *, botocore_retries: bool = True) -> dict[str, Any]:
    """s3fs options for a loopback endpoint; ``botocore_retries=False`` leaves retrying to us."""
    opts: dict[str, Any] = {
        "key": DUMMY_KEY,
        "secret": DUMMY_SECRET,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "skip_instance_cache": True,
    }
    if not botocore_retries:
        opts["config_kwargs"] = {"retries": {"total_max_attempts": 1, "mode": "standard"}}
    return opts


class MotoS3:
    """moto's S3 server on 127.0.0.1: a thread of this process, or its own process (``process=True``:
    the server then does not compete for this process's GIL).

    The server binds port 0 and the port is read back from it (the thread's socket, or the line the
    process prints): no other server can take the port between choosing and binding it.
    """

    def __init__(self, *, process: bool = False) -> None:
        self.port = 0
        self.endpoint = ""
        self._process = process
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        self.server: Any = None

    def __enter__(self) -> MotoS3:
        try:
            self.port = self._start_process() if self._process else self._start_thread()
            _wait_listening(self.port, STARTUP_TIMEOUT_S)
        except BaseException:
            self.__exit__()
            raise
        self.endpoint = f"http://127.0.0.1:{self.port}"
        return self

    def _start_thread(self) -> int:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        return int(self.server.get_host_and_port()[1])

    def _start_process(self) -> int:
        """Start ``python -m moto.server -p 0`` and read its port from the line it prints once bound."""
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in __exit__) a file, not a pipe: a full pipe would stall the server
        argv = [sys.executable, "-u", "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"]
        self._proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            self._log.seek(0)
            found = re.search(rb"Running on http://127\.0\.0\.1:(\d+)", self._log.read())
            if found:
                return int(found.group(1))
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self._log.seek(0)
                output = self._log.read().decode(errors="replace")[-2000:]
                state = f"exited {self._proc.returncode}" if self._proc.poll() is not None else "never bound a port"
                raise RuntimeError(f"moto's S3 server {state} (within {STARTUP_TIMEOUT_S}s):\n{output}")
            time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
            self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def make_bucket(self) -> str:
        """A fresh, empty bucket (each test its own: no state leaks between tests)."""
        name = f"ckpt-{uuid.uuid4().hex[:12]}"
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("PUT", f"/{name}", headers={"Content-Length": "0"})
            response = conn.getresponse()
            body = response.read()
            if response.status != 200:
                raise RuntimeError(f"creating bucket {name}: HTTP {response.status} {body[:200]!r}")
        finally:
            conn.close()
        return name


_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}
Matcher = Callable[[str, str], bool]


class FaultProxy:
    """A loopback HTTP proxy in front of ``upstream_port`` that injects S3 failures on request."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.fail_every = 0  # every k-th request (when k > 0) gets a 503 ServiceUnavailable
        self.fail_match: Matcher | None = None  # ... counting only requests this matches
        self.deny: Matcher | None = None  # matching requests get a 403 AccessDenied
        self.stall: Matcher | None = None  # matching requests hang until ``release``, then are dropped
        self.stalled = threading.Event()  # set once a request is being held
        self.release = threading.Event()
        self.requests = 0
        self.injected = 0
        self.denied = 0
        self.log: list[tuple[str, str, int]] = []
        self._counted = 0
        self._mutex = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return None

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().strip().split(b";")[0], 16)
                        if size == 0:
                            while self.rfile.readline().strip():
                                pass
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _reply(self, status: int, code: str, message: str) -> None:
                body = (
                    f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                    f"<Message>{message}</Message><RequestId>proxy</RequestId></Error>"
                ).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _handle(self) -> None:
                body = self._body()
                method, path = self.command, self.path
                verdict = proxy._verdict(method, path)
                if verdict == "deny":
                    self._reply(403, "AccessDenied", "Access Denied")
                    return
                if verdict == "fail":
                    self._reply(503, "ServiceUnavailable", "Service temporarily unavailable (injected by the test proxy).")
                    return
                if verdict == "stall":  # held, then dropped: it never reaches the server
                    proxy.stalled.set()
                    proxy.release.wait(120)
                    self.close_connection = True
                    return
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                    headers["Content-Length"] = str(len(body))
                    conn.request(method, path, body=body, headers=headers)
                    response = conn.getresponse()
                    data = response.read()
                    self.send_response(response.status)
                    for key, value in response.getheaders():
                        if key.lower() not in _HOP and key.lower() != "content-length":
                            self.send_header(key, value)
                    length = response.getheader("Content-Length") if method == "HEAD" else str(len(data))
                    self.send_header("Content-Length", length or "0")
                    self.end_headers()
                    if method != "HEAD":
                        self.wfile.write(data)
                    with proxy._mutex:
                        proxy.log.append((method, path, response.status))
                finally:
                    conn.close()

            def _safe(self) -> None:
                try:
                    self._handle()
                except (BrokenPipeError, ConnectionResetError):  # the client went away (or was killed)
                    self.close_connection = True

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _safe

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)  # port 0: no race for a free one
        self.port = int(self.server.server_address[1])
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, name="s3-fault-proxy", daemon=True)

    def _verdict(self, method: str, path: str) -> str:
        with self._mutex:
            self.requests += 1
            if self.deny is not None and self.deny(method, path):
                self.denied += 1
                return "deny"
            if self.stall is not None and self.stall(method, path):
                return "stall"
            if self.fail_every and (self.fail_match is None or self.fail_match(method, path)):
                self._counted += 1
                if self._counted % self.fail_every == 0:
                    self.injected += 1
                    return "fail"
        return "pass"

    def reset(self) -> None:
        with self._mutex:
            self.fail_every, self.fail_match, self.deny, self.stall = 0, None, None, None
            self.requests = self.injected = self.denied = self._counted = 0
            self.log.clear()
        self.release.set()
        self.stalled.clear()
        self.release = threading.Event()

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        _wait_listening(self.port, STARTUP_TIMEOUT_S)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        with contextlib.suppress(RuntimeError):
            self._thread.join(timeout=5)
