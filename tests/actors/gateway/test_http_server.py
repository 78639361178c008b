"""The gateway's HTTP/1.1 server (actors/gateway/http_server.py) over a real socket, with a small
ASGI app: keep-alive and pipelining, chunked and 100-continue request bodies, chunked (unsized)
responses, HEAD, and the refusals (400, 413, 431, 501, 500) that close only their connection."""
from __future__ import annotations

import socket

import pytest
import trio

from postrain.actors.gateway.http_server import ServerLimits, serve


async def app(scope, receive, send):
    """Echoes the body; /stream answers in two unsized chunks; /boom raises."""
    message = await receive()
    body = message["body"]
    if scope["path"] == "/boom":
        raise RuntimeError("boom")
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"one,", "more_body": True})
        await send({"type": "http.response.body", "body": b"two", "more_body": False})
        return
    out = scope["method"].encode() + b" " + scope["path"].encode() + b" " + body
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"%d" % len(out))]})
    await send({"type": "http.response.body", "body": out})


async def _exchange(port: int, data: bytes, until: bytes | None = None) -> bytes:
    """Send `data`, read until `until` is in what came back (or the server closes)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    got = b""
    async with stream:
        await stream.send_all(data)
        with trio.fail_after(10):
            while until is None or until not in got:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                got += chunk
    return got


def _run(check):
    async def main():
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        port = sock.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, app, sock, ServerLimits(max_body_bytes=1000))
            await check(port)
            nursery.cancel_scope.cancel()
    trio.run(main)


def test_keep_alive_pipelined_requests_chunked_bodies_and_100_continue():
    async def check(port):
        two = (b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
               b"POST /b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n")
        got = await _exchange(port, two, until=b"POST /b abcde")
        assert got.startswith(b"HTTP/1.1 200 OK\r\n") and b"POST /a hello" in got and b"POST /b abcde" in got
        got = await _exchange(port, b"POST /c HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nok",
                              until=b"POST /c ok")
        assert got.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK")
        got = await _exchange(port, b"GET /x HTTP/1.0\r\n\r\n")   # 1.0: answered, then closed
        assert got.endswith(b"GET /x ")
    _run(check)


def test_unsized_responses_are_chunked_and_head_has_no_body():
    async def check(port):
        got = await _exchange(port, b"GET /stream HTTP/1.1\r\n\r\n", until=b"0\r\n\r\n")
        assert b"transfer-encoding: chunked" in got and got.endswith(b"4\r\none,\r\n3\r\ntwo\r\n0\r\n\r\n")
        got = await _exchange(port, b"GET /stream HTTP/1.0\r\n\r\n")   # 1.0: the body runs to the close
        assert b"chunked" not in got and got.endswith(b"\r\n\r\none,two")
        got = await _exchange(port, b"HEAD /h HTTP/1.1\r\n\r\nGET /g HTTP/1.1\r\n\r\n", until=b"GET /g ")
        assert got.count(b"HTTP/1.1 200") == 2 and b"HEAD /h" not in got
    _run(check)


@pytest.mark.parametrize("request_bytes, status", [
    (b"NONSENSE\r\n\r\n", b"400 Bad Request"),
    (b"GET / HTTP/1.1\r\nno colon here\r\n\r\n", b"400 Bad Request"),
    (b"POST / HTTP/1.1\r\nContent-Length: 5000\r\n\r\n", b"413 Request Entity Too Large"),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", b"501 Not Implemented"),
    (b"GET / HTTP/1.1\r\nX: " + b"a" * 70000, b"431 Request Header Fields Too Large"),
], ids=["request-line", "header-line", "body-size", "transfer-coding", "head-size"])
def test_malformed_requests_are_refused_and_the_server_goes_on(request_bytes, status):
    async def check(port):
        got = await _exchange(port, request_bytes)
        assert got.startswith(b"HTTP/1.1 " + status) and b"connection: close" in got
        assert (await _exchange(port, b"GET /ok HTTP/1.1\r\n\r\n", until=b"GET /ok ")).startswith(b"HTTP/1.1 200")
    _run(check)


def test_an_app_that_raises_gets_500_and_the_connection_serves_on():
    async def check(port):
        got = await _exchange(port, b"GET /boom HTTP/1.1\r\n\r\nGET /after HTTP/1.1\r\n\r\n", until=b"GET /after ")
        assert got.startswith(b"HTTP/1.1 500 Internal Server Error") and b"HTTP/1.1 200 OK" in got
    _run(check)
