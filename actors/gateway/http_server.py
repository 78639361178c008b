"""A lean HTTP/1.1 server for an ASGI app, on the caller's trio loop: the gateway's default.

Why not hypercorn (the gateway's first server, still `http_server = "hypercorn"`): measured on
this 2-core VM, hypercorn with h11 costs ~0.4 ms of CPU a request before the app runs, this server
~0.03 ms (docs/performance-history.md, "Gateway throughput"). The gateway handles its requests on one
core, so that cost is what kept 32 concurrent requests from reaching the generators together.

What it speaks (what OpenAI clients send, and nothing it cannot do right):
- HTTP/1.1 and 1.0 requests, parsed strictly (http_parser.py: no request smuggling); keep-alive
  (1.1 unless `Connection: close`; 1.0 only with `Connection: keep-alive`); pipelined requests
  are answered in order;
- request bodies by `Content-Length` or `Transfer-Encoding: chunked`; `Expect: 100-continue`,
  answered once the head has passed its checks (a body over the limit gets 413, not 100);
- responses with the app's `content-length` as they are; without one (server-sent events),
  chunked; HEAD answers carry no body;
- refusals, then the connection closed: the parser's (400, 413, 431, 501, 505), 408 (a head not
  complete within `head_timeout_s` of its first byte, or a body within `body_timeout_s` of its
  head), 503 (a connection past `max_connections`, at once). An idle keep-alive connection is
  closed after `keep_alive_s`. A refusal lingers: the answer is sent, the write side shut, and
  what the client still sends is read and dropped for up to LINGER_S, so that the close does
  not reset the connection before the client has read why.

Invariant: one connection runs one request at a time; its ASGI `receive` gives the whole body
once, then waits until the response is sent (a client that disconnects mid-response has its
send fail, which ends only that connection's task). An app that raises before starting its
response gets a 500; one that raises after has its connection closed. At most
`max_connections` connections are served at once, each holding at most about
max_head_bytes + max_body_bytes + RECEIVE_BYTES of request bytes (http_parser.py's invariant).
"""
from __future__ import annotations

import contextlib
import logging
import socket as stdlib_socket
import threading
from http import HTTPStatus
from typing import Any, Callable, Iterator

import trio
from pydantic import Field

from postrain.core import Options

from .http_parser import HTTPRefusal, RequestHead, RequestParser

log = logging.getLogger("postrain.gateway")

RECEIVE_BYTES = 64 * 1024
LINGER_S = 1.0


class _Closed(Exception):
    """The client closed the connection (between requests, or in the middle of one)."""


class ServerLimits(Options):
    """What the clients of one server may hold. Memory at most about max_connections x
    (max_head_bytes + max_body_bytes): 8 GiB with the defaults, reached only by that many
    clients each sending the largest body at once."""

    max_connections: int = Field(1024, ge=1, description="connections served at once; past it a new "
                                 "connection is answered 503 and closed")
    max_head_bytes: int = Field(64 * 1024, ge=1024, description="a request's line and headers (and a "
                                "chunked body's trailers), bytes; past it 431")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=0, description="a request's body, bytes; past it 413, "
                                "before any of it is read")
    head_timeout_s: float = Field(10.0, gt=0, description="from a request's first byte to the end of its "
                                  "head, seconds; past it 408 (a client trickling its head: slowloris)")
    body_timeout_s: float = Field(60.0, gt=0, description="from the end of a request's head to the end of "
                                  "its body, seconds; past it 408")
    keep_alive_s: float = Field(75.0, gt=0, description="an idle connection between requests is closed "
                                "after this many seconds")


def listening_socket(host: str, port: int, what: str) -> tuple[stdlib_socket.socket, str]:
    """(a socket listening on host:port, its URL "http://HOST:PORT"); port 0: a free one. OSError
    naming `what` (the server) and the fix when the address is taken or not this machine's."""
    sock = stdlib_socket.socket(stdlib_socket.AF_INET6 if ":" in host else stdlib_socket.AF_INET)
    sock.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"{what} cannot listen on {host}:{port} ({exc.strerror}); fix: choose another port "
                      "(0: a free one) or host") from None
    sock.listen(1024)
    bound_host, bound_port = sock.getsockname()[:2]
    return sock, f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{bound_port}"


async def serve(app, sock: stdlib_socket.socket, limits: ServerLimits | None = None,
                *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve `app` on the listening `sock` until cancelled. Cancelled: every connection is cut."""
    limits = limits or ServerLimits()
    slots = trio.CapacityLimiter(limits.max_connections)

    async def handle(stream: trio.SocketStream) -> None:
        connection = _Connection(app, stream, limits)
        try:
            slots.acquire_nowait()
        except trio.WouldBlock:
            await connection.turn_away(f"this server serves {limits.max_connections} connections at once "
                                       f"(max_connections); retry later")
            return
        try:
            await connection.run()
        finally:
            slots.release()

    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    await trio.serve_listeners(handle, [listener], task_status=task_status)


class _Connection:
    """One client connection: requests read and answered one after another."""

    def __init__(self, app, stream: trio.SocketStream, limits: ServerLimits):
        self.app, self.stream, self.limits = app, stream, limits
        self.parser = RequestParser(limits.max_head_bytes, limits.max_body_bytes)
        try:
            self.client = _address(stream.socket.getpeername())
            self.server = _address(stream.socket.getsockname())
        except OSError:
            self.client = self.server = None

    async def run(self) -> None:
        """Answer requests until the client closes, asks to close, idles or breaks the protocol.
        Cancelled: the connection is cut where it stands."""
        try:
            while await self._next_request_begins():
                parser, limits = self.parser, self.limits
                head = await self._read_within(parser.read_head, limits.head_timeout_s, "the request head")
                if head.expect_continue:   # the head has passed its checks, the body's size included
                    await self.stream.send_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                body = await self._read_within(parser.read_body, limits.body_timeout_s, "the request body")
                if not await self._answer(self._scope(head), body) or not head.keep_alive:
                    return
        except HTTPRefusal as refusal:
            await self._refuse(refusal)
        except (_Closed, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await self._close()

    async def turn_away(self, message: str) -> None:
        """Answer 503 with `message` and `Retry-After: 1` without reading a request, then close."""
        try:
            await self._refuse(HTTPRefusal(503, message), retry_after_s=1)
        finally:
            await self._close()

    # ---------------------------------------------------------------- reading
    async def _next_request_begins(self) -> bool:
        """Whether a request's first byte is in within keep_alive_s (False: the connection idled)."""
        with trio.move_on_after(self.limits.keep_alive_s):
            await self._read(lambda: True if self.parser.num_buffered_bytes else None)
            return True
        return False

    async def _read_within(self, step, timeout_s: float, what: str):
        """`step()`'s first value that is not None, receiving as it needs; 408 past `timeout_s`."""
        with trio.move_on_after(timeout_s):
            return await self._read(step)
        raise HTTPRefusal(408, f"{what} was not complete within {timeout_s:g} s")

    async def _read(self, step):
        """Receive until `step()` is not None; return it. _Closed when the client closes first."""
        while (value := step()) is None:
            data = await self.stream.receive_some(RECEIVE_BYTES)
            if not data:
                raise _Closed()
            self.parser.feed(data)
        return value

    def _scope(self, head: RequestHead) -> dict:
        path, _, query = head.target.partition(b"?")
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
                "http_version": head.version, "method": head.method, "scheme": "http", "path": _unquote(path), "raw_path": path,
                "query_string": query, "root_path": "", "headers": head.headers,
                "client": self.client, "server": self.server}

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

    async def _respond(self, status: int, message: str, keep_open: bool,
                       retry_after_s: int | None = None) -> None:
        body = (message + "\n").encode()
        headers = (b"content-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n" % len(body)
                   + (b"" if keep_open else b"connection: close\r\n")
                   + (b"" if retry_after_s is None else b"retry-after: %d\r\n" % retry_after_s))
        await self.stream.send_all(_status_line(status) + headers + b"\r\n" + body)

    async def _refuse(self, refusal: HTTPRefusal, retry_after_s: int | None = None) -> None:
        """Answer the refusal, shut the write side, then read and drop what the client still sends
        until it closes or LINGER_S pass (the module's note). Cancelled: stops where it stands."""
        with trio.move_on_after(LINGER_S):
            try:
                await self._respond(refusal.status, str(refusal), keep_open=False, retry_after_s=retry_after_s)
                await self.stream.send_eof()
                while await self.stream.receive_some(RECEIVE_BYTES):
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    async def _close(self) -> None:
        """Close the stream, shielded from cancellation and bounded in time."""
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            await self.stream.aclose()


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



@contextlib.contextmanager
def served_in_thread(start: Callable[..., Any], *args: Any, timeout_s: float = 120) -> Iterator[tuple[int, Any]]:
    """(port, what `start` reported) while the block runs: `await nursery.start(start, *args, sock)`
    on a loopback socket of a free port, in a daemon thread with its own trio loop (a bench's or
    a test's server beside its client); the server stops at the block's end."""
    sock, _ = listening_socket("127.0.0.1", 0, "the server")
    started, box = threading.Event(), {}

    async def main():
        box["token"], box["stop"] = trio.lowlevel.current_trio_token(), trio.Event()
        async with trio.open_nursery() as nursery:
            box["value"] = await nursery.start(start, *args, sock)
            started.set()
            await box["stop"].wait()
            nursery.cancel_scope.cancel()
    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    if not started.wait(timeout_s):
        raise RuntimeError(f"the server did not start within {timeout_s:g} s")
    try:
        yield sock.getsockname()[1], box["value"]
    finally:
        trio.from_thread.run_sync(box["stop"].set, trio_token=box["token"])
        thread.join(60)
