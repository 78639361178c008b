"""A lean HTTP/1.1 server for an ASGI app, on the caller's trio loop: the gateway's default.

Why not hypercorn (the gateway's first server, still `http_server = "hypercorn"`): measured on
this 2-core VM, hypercorn with h11 costs ~0.4 ms of CPU a request before the app runs, this server
~0.03 ms (docs/performance.md, "Gateway throughput"). The gateway handles its requests on one
core, so that cost is what kept 32 concurrent requests from reaching the generators together.

What it speaks (what OpenAI clients send, and nothing it cannot do right):
- HTTP/1.1 and 1.0 requests; keep-alive (1.1 unless `Connection: close`; 1.0 only with
  `Connection: keep-alive`); pipelined requests are answered in order;
- request bodies by `Content-Length` or `Transfer-Encoding: chunked`; `Expect: 100-continue`;
- responses with the app's `content-length` as they are; without one (server-sent events),
  chunked; HEAD answers carry no body;
- refusals, then the connection closed: 400 (malformed request line, header or chunk), 413
  (body over `max_body_bytes`), 431 (head over `MAX_HEAD_BYTES`), 501 (another transfer coding),
  408 (a request not complete within `read_timeout_s`). An idle keep-alive connection is closed
  after `keep_alive_s`.

Invariant: one connection runs one request at a time; its ASGI `receive` gives the whole body
once, then waits until the response is sent (a client that disconnects mid-response has its
send fail, which ends only that connection's task). An app that raises before starting its
response gets a 500; one that raises after has its connection closed.
"""
from __future__ import annotations

import logging
import socket as stdlib_socket
from dataclasses import dataclass
from http import HTTPStatus

import trio

log = logging.getLogger("postrain.gateway")

MAX_HEAD_BYTES = 64 * 1024
RECEIVE_BYTES = 64 * 1024


class _Refusal(Exception):
    """A request this server answers itself (status, message), then closes the connection."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class _Closed(Exception):
    """The client closed the connection (between requests, or in the middle of one)."""


@dataclass
class ServerLimits:
    max_body_bytes: int = 64 * 1024 * 1024
    read_timeout_s: float = 60.0       # from a request's first byte to its last
    keep_alive_s: float = 75.0         # an idle connection between requests


async def serve(app, sock: stdlib_socket.socket, limits: ServerLimits | None = None,
                *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve `app` on the listening `sock` until cancelled. Cancelled: every connection is cut."""
    limits = limits or ServerLimits()
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    await trio.serve_listeners(lambda stream: _Connection(app, stream, limits).run(), [listener],
                               task_status=task_status)


class _Connection:
    """One client connection: requests read and answered one after another."""

    def __init__(self, app, stream: trio.SocketStream, limits: ServerLimits):
        self.app, self.stream, self.limits = app, stream, limits
        self.buffer = bytearray()
        try:
            self.client = _address(stream.socket.getpeername())
            self.server = _address(stream.socket.getsockname())
        except OSError:
            self.client = self.server = None

    async def run(self) -> None:
        """Answer requests until the client closes, asks to close, or breaks the protocol.
        Cancelled: the connection is cut where it stands."""
        try:
            while True:
                with trio.move_on_after(self.limits.keep_alive_s) as idle:
                    await self._fill_until(lambda: True if self.buffer else None)
                if idle.cancelled_caught:
                    return
                with trio.fail_after(self.limits.read_timeout_s):
                    scope, body, keep_alive = await self._read_request()
                if not await self._answer(scope, body) or not keep_alive:
                    return
        except _Refusal as refusal:
            await self._refuse(refusal.status, str(refusal))
        except trio.TooSlowError:
            await self._refuse(408, f"the request was not complete within {self.limits.read_timeout_s:g} s")
        except (_Closed, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await self.stream.aclose()

    # ---------------------------------------------------------------- reading
    async def _fill_until(self, found):
        """Receive until `found()` is not None; return it. _Closed when the client closes."""
        while (value := found()) is None:
            chunk = await self.stream.receive_some(RECEIVE_BYTES)
            if not chunk:
                raise _Closed()
            self.buffer += chunk
        return value

    def _take(self, num_bytes: int) -> bytes:
        taken = bytes(self.buffer[:num_bytes])
        del self.buffer[:num_bytes]
        return taken

    def _head_end(self):
        at = self.buffer.find(b"\r\n\r\n")
        if at < 0 and len(self.buffer) > MAX_HEAD_BYTES:
            raise _Refusal(431, f"the request head is over {MAX_HEAD_BYTES} bytes")
        return at if at >= 0 else None

    async def _read_request(self) -> tuple[dict, bytes, bool]:
        """The ASGI scope, the whole body and whether the connection stays open after it."""
        end = await self._fill_until(self._head_end)
        if end > MAX_HEAD_BYTES:
            raise _Refusal(431, f"the request head is over {MAX_HEAD_BYTES} bytes")
        lines = self._take(end + 4)[:-4].split(b"\r\n")
        method, target, version = _request_line(lines[0])
        headers = [_header(line) for line in lines[1:]]
        fields = {}
        for name, value in headers:
            fields[name] = fields[name] + b", " + value if name in fields else value
        connection = fields.get(b"connection", b"").lower()
        keep_alive = (b"close" not in connection if version == "1.1" else b"keep-alive" in connection)
        if fields.get(b"expect", b"").lower() == b"100-continue":
            await self.stream.send_all(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = await self._read_body(fields)
        path, _, query = target.partition(b"?")
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": version,
                 "method": method, "scheme": "http", "path": _unquote(path), "raw_path": path,
                 "query_string": query, "root_path": "", "headers": headers,
                 "client": self.client, "server": self.server}
        return scope, body, keep_alive

    async def _read_body(self, fields: dict) -> bytes:
        coding = fields.get(b"transfer-encoding", b"").lower().strip()
        if coding and coding != b"chunked":
            raise _Refusal(501, f"transfer-encoding {coding.decode('latin-1')!r} is not supported; send "
                                f"the body with Content-Length or chunked")
        if coding == b"chunked":
            return await self._read_chunked()
        try:
            length = int(fields.get(b"content-length", b"0"))
        except ValueError:
            raise _Refusal(400, "Content-Length is not an integer") from None
        if length < 0:
            raise _Refusal(400, "Content-Length is negative")
        self._check_size(length)
        await self._fill_until(lambda: True if len(self.buffer) >= length else None)
        return self._take(length)

    async def _read_chunked(self) -> bytes:
        body = bytearray()
        while True:
            end = await self._fill_until(lambda: _find_line(self.buffer))
            size_text = self._take(end + 2)[:-2].split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise _Refusal(400, f"a chunk size is not hexadecimal: {size_text[:20]!r}") from None
            if size == 0:   # trailers, if any, end with an empty line
                while (end := await self._fill_until(lambda: _find_line(self.buffer))) != 0:
                    self._take(end + 2)
                self._take(2)
                return bytes(body)
            self._check_size(len(body) + size)
            await self._fill_until(lambda: True if len(self.buffer) >= size + 2 else None)
            body += self._take(size)
            if self._take(2) != b"\r\n":
                raise _Refusal(400, "a chunk does not end with CRLF")

    def _check_size(self, num_bytes: int) -> None:
        if num_bytes > self.limits.max_body_bytes:
            raise _Refusal(413, f"the request body is over {self.limits.max_body_bytes} bytes")

    # ---------------------------------------------------------------- answering
    async def _answer(self, scope: dict, body: bytes) -> bool:
        """Run the app for one request; whether the connection can serve another."""
        head_only = scope["method"] == "HEAD"
        can_chunk = scope["http_version"] == "1.1"   # a 1.0 client reads an unsized body to the close
        state = {"started": False, "chunked": False, "done": False, "close_after": False}
        status_headers: list = []
        delivered = trio.Event()

        async def receive():
            if not delivered.is_set():
                delivered.set()
                return {"type": "http.request", "body": body, "more_body": False}
            await trio.sleep_forever()   # no disconnect is reported while the response is written

        async def send(message):
            kind = message["type"]
            if kind == "http.response.start":
                status_headers[:] = [message["status"], list(message.get("headers", []))]
                return
            if kind != "http.response.body" or state["done"]:
                return
            chunk, more = message.get("body", b""), message.get("more_body", False)
            out = b""
            if not state["started"]:
                state["started"] = True
                status, headers = status_headers
                sized = any(k.lower() == b"content-length" for k, _ in headers)
                state["chunked"] = not head_only and not sized and can_chunk
                state["close_after"] = not head_only and not sized and not can_chunk
                if state["chunked"]:
                    headers = headers + [(b"transfer-encoding", b"chunked")]
                out = _status_line(status) + b"".join(k + b": " + v + b"\r\n" for k, v in headers) + b"\r\n"
            if not head_only:
                out += (b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunk else b"") if state["chunked"] else chunk
                if state["chunked"] and not more:
                    out += b"0\r\n\r\n"
            state["done"] = not more
            if out:
                await self.stream.send_all(out)

        try:
            await self.app(scope, receive, send)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return False   # the client went away while its answer was written
        except Exception:
            log.exception("gateway: %s %s failed", scope["method"], scope["path"])
            if state["started"]:
                return False
            await self._respond(500, "internal server error", keep_open=True)
            return True
        if not state["started"]:   # the app sent nothing
            await self._respond(500, "the app gave no response", keep_open=True)
        return state["done"] and not state["close_after"]

    async def _respond(self, status: int, message: str, keep_open: bool) -> None:
        body = (message + "\n").encode()
        headers = (b"content-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n" % len(body)
                   + (b"" if keep_open else b"connection: close\r\n"))
        await self.stream.send_all(_status_line(status) + headers + b"\r\n" + body)

    async def _refuse(self, status: int, message: str) -> None:
        with trio.move_on_after(1):
            try:
                await self._respond(status, message, keep_open=False)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass


def _request_line(line: bytes) -> tuple[str, bytes, str]:
    parts = line.split(b" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[2].startswith(b"HTTP/1."):
        raise _Refusal(400, f"malformed request line {line[:80]!r}")
    return parts[0].decode("ascii").upper(), parts[1], parts[2][5:].decode("ascii")


def _header(line: bytes) -> tuple[bytes, bytes]:
    name, colon, value = line.partition(b":")
    if not colon or not name or name != name.strip():
        raise _Refusal(400, f"malformed header line {line[:80]!r}")
    return name.lower(), value.strip()


def _find_line(buffer: bytearray):
    at = buffer.find(b"\r\n")
    if at < 0 and len(buffer) > MAX_HEAD_BYTES:
        raise _Refusal(400, "a chunk-size line is too long")
    return at if at >= 0 else None


def _status_line(status: int) -> bytes:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = ""
    return f"HTTP/1.1 {status} {reason}\r\n".encode("latin-1")


def _unquote(path: bytes) -> str:
    from urllib.parse import unquote
    return unquote(path.decode("latin-1")) if b"%" in path else path.decode("latin-1")


def _address(address) -> tuple[str, int] | None:
    return (address[0], address[1]) if isinstance(address, tuple) and len(address) >= 2 else None

