"""Fault injection for tests: an HTTP proxy in front of the local S3 server.

No product code changes: point the S3 endpoint (AWS_ENDPOINT_URL) at the proxy.
"""

from __future__ import annotations

import http.client
import http.server
import threading
import time


class FaultProxy:
    """HTTP proxy on 127.0.0.1 forwarding to moto.

    ``fail_next(n)``: the next *n* requests get a 503 without reaching moto.
    ``deny_matching(n, ...)``: the next *n* matching requests get a 403 AccessDenied.
    ``swallow_next(n)``: the next *n* requests reach moto, but the client gets a
    503 (an ambiguous failure: the write happened).
    ``fail_matching(n, ...)`` / ``swallow_matching(n, ...)``: the same for the next *n*
    requests with that method whose path contains a substring (e.g. the PUT of a manifest
    entry, the copy of a publish).
    ``strip_request_headers``: header names (lower case) removed before forwarding, e.g.
    ``{"if-none-match"}`` for a store that ignores conditional writes.
    ``log``: with ``record = True``, (method, path) of every request, in order.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._fail = 0
        self._swallow = 0
        self._fail_until = 0.0
        self._stall_s = 0.0
        self._rules: list[list] = []  # [action, remaining, method or None, substring, header or None]
        self.requests = 0
        self.strip_request_headers: set[str] = set()
        self.record = False
        self.log: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    chunks = []
                    while True:
                        n = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if n == 0:
                            while self.rfile.readline().strip():
                                pass
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(n))
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _reply(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
                if self.command == "HEAD" and status >= 400:
                    # an error to a HEAD has no body, so no body type either: pyarrow 26's Azure
                    # client aborts the process (std::terminate) parsing the empty "XML" otherwise
                    headers, body = [(k, v) for k, v in headers if k.lower() != "content-type"], b""
                self.send_response(status)
                for k, v in headers:
                    if k.lower() not in ("transfer-encoding", "content-length", "connection", "server", "date"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _handle(self) -> None:
                body = self._body()
                with proxy._lock:
                    proxy.requests += 1
                    if proxy.record:
                        proxy.log.append((self.command, self.path))
                    fail = proxy._fail > 0
                    proxy._fail -= fail
                    fail = fail or time.time() < proxy._fail_until
                    stall = proxy._stall_s
                    swallow = not fail and proxy._swallow > 0
                    deny = False
                    proxy._swallow -= swallow
                    for rule in proxy._rules:
                        action, left, method, part, header = rule
                        if (
                            left > 0
                            and (method is None or method == self.command)
                            and part in self.path
                            and (header is None or header.lower() in (k.lower() for k in self.headers))
                        ):
                            rule[1] -= 1
                            deny = deny or action == "deny"
                            fail = fail or action == "fail"
                            swallow = not fail and (swallow or action == "swallow")
                            break
                    strip = set(proxy.strip_request_headers)
                err = (
                    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>ServiceUnavailable</Code>'
                    b"<Message>injected by FaultProxy</Message></Error>"
                )
                if stall:
                    time.sleep(stall)
                if deny:
                    denied = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>'
                    self._reply(403, [("Content-Type", "application/xml")], denied)
                    return
                if fail:
                    self._reply(503, [("Content-Type", "application/xml")], err)
                    return
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() not in ("transfer-encoding", "content-length", "connection", "expect", *strip)
                }
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                if swallow:
                    self._reply(503, [("Content-Type", "application/xml")], err)
                elif self.command == "HEAD":
                    self.send_response(resp.status)
                    for k, v in resp.getheaders():
                        if k.lower() not in ("transfer-encoding", "connection", "server", "date"):
                            self.send_header(k, v)
                    self.end_headers()
                else:
                    self._reply(resp.status, resp.getheaders(), data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def fail_next(self, n: int) -> None:
        with self._lock:
            self._fail = n

    def swallow_next(self, n: int) -> None:
        with self._lock:
            self._swallow = n

    def fail_matching(
        self, n: int, path_contains: str, *, method: str | None = None, header: str | None = None
    ) -> None:
        """The next *n* requests (of *method*, carrying *header*) whose path contains
        *path_contains* get a 503 without reaching moto."""
        with self._lock:
            self._rules.append(["fail", n, method, path_contains, header])

    def deny_matching(self, n: int, path_contains: str, *, method: str | None = None) -> None:
        """The next *n* matching requests get a 403 AccessDenied without reaching moto."""
        with self._lock:
            self._rules.append(["deny", n, method, path_contains, None])

    def swallow_matching(
        self, n: int, path_contains: str, *, method: str | None = None, header: str | None = None
    ) -> None:
        """The next *n* matching requests reach moto, but the client gets a 503."""
        with self._lock:
            self._rules.append(["swallow", n, method, path_contains, header])

    def clear_rules(self) -> None:
        with self._lock:
            self._rules.clear()
            self.strip_request_headers = set()
            self.record = False
            self.log = []

    def fail_for(self, seconds: float) -> None:
        """Every request fails with 503 for the next `seconds`."""
        with self._lock:
            self._fail_until = time.time() + seconds

    def stall(self, seconds: float) -> None:
        """Delay every request by `seconds` (0 ends it)."""
        with self._lock:
            self._stall_s = seconds

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
