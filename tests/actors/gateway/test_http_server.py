"""The gateway's HTTP/1.1 server (actors/gateway/http_server.py) over a real socket, with a small
ASGI app: keep-alive and pipelining, chunked and 100-continue request bodies, chunked (unsized)
responses, HEAD, and the refusals (400, 413, 431, 501, 500) that close only their connection.

Hardening: a smuggled request behind bad framing is never served (the connection closes after the
400); `100 Continue` only after the size check; a client trickling its head is closed (408) and an
idle one too, while others are served; a flood of connections past `max_connections` is answered
503 at once, while the connections within it, and new ones after it, are served; and any bytes
(hypothesis) get answers with known statuses or a close, the server serving on."""
from __future__ import annotations

import re
import socket

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from postrain.actors.gateway.http_server import ServerLimits, serve
from threaded_server import served  # tests/actors/threaded_server.py


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


def get(path: bytes) -> bytes:
    return b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n"


async def _receive_until(stream: trio.SocketStream, until: bytes | None = None) -> bytes:
    """What comes back until `until` is in it, or the server closes."""
    got = b""
    while until is None or until not in got:
        chunk = await stream.receive_some(65536)
        if not chunk:
            break
        got += chunk
    return got


async def _exchange(port: int, data: bytes, until: bytes | None = None) -> bytes:
    """Send `data` on a new connection, read until `until` is in what came back (or the server closes)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        with trio.fail_after(10):
            return await _receive_until(stream, until)


def _run(check, limits: ServerLimits = ServerLimits(max_body_bytes=1000)):
    async def main():
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        port = sock.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, app, sock, limits)
            with trio.fail_after(30):
                await check(port)
            nursery.cancel_scope.cancel()
    trio.run(main)


def test_keep_alive_pipelined_requests_chunked_bodies_and_100_continue():
    async def check(port):
        two = (b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
               b"POST /b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n")
        got = await _exchange(port, two, until=b"POST /b abcde")
        assert got.startswith(b"HTTP/1.1 200 OK\r\n") and b"POST /a hello" in got and b"POST /b abcde" in got
        got = await _exchange(port, b"POST /c HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                                    b"Content-Length: 2\r\n\r\nok", until=b"POST /c ok")
        assert got.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK")
        got = await _exchange(port, b"GET /x HTTP/1.0\r\n\r\n")   # 1.0: answered, then closed
        assert got.endswith(b"GET /x ")
    _run(check)


def test_unsized_responses_are_chunked_and_head_has_no_body():
    async def check(port):
        got = await _exchange(port, get(b"/stream"), until=b"0\r\n\r\n")
        assert b"transfer-encoding: chunked" in got and got.endswith(b"4\r\none,\r\n3\r\ntwo\r\n0\r\n\r\n")
        got = await _exchange(port, b"GET /stream HTTP/1.0\r\n\r\n")   # 1.0: the body runs to the close
        assert b"chunked" not in got and got.endswith(b"\r\n\r\none,two")
        got = await _exchange(port, b"HEAD /h HTTP/1.1\r\nHost: x\r\n\r\n" + get(b"/g"), until=b"GET /g ")
        assert got.count(b"HTTP/1.1 200") == 2 and b"HEAD /h" not in got
    _run(check)


@pytest.mark.parametrize("request_bytes, status", [
    (b"NONSENSE\r\n\r\n", b"400 Bad Request"),
    (b"GET / HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", b"400 Bad Request"),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n", b"413 Request Entity Too Large"),
    (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", b"501 Not Implemented"),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 70000, b"431 Request Header Fields Too Large"),
], ids=["request-line", "header-line", "body-size", "transfer-coding", "head-size"])
def test_malformed_requests_are_refused_and_the_server_goes_on(request_bytes, status):
    async def check(port):
        got = await _exchange(port, request_bytes)
        assert got.startswith(b"HTTP/1.1 " + status) and b"connection: close" in got
        assert (await _exchange(port, get(b"/ok"), until=b"GET /ok ")).startswith(b"HTTP/1.1 200")
    _run(check)


def test_an_app_that_raises_gets_500_and_the_connection_serves_on():
    async def check(port):
        got = await _exchange(port, get(b"/boom") + get(b"/after"), until=b"GET /after ")
        assert got.startswith(b"HTTP/1.1 500 Internal Server Error") and b"HTTP/1.1 200 OK" in got
    _run(check)


@pytest.mark.parametrize("framing, status", [
    (b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", b"400"),
    (b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n0\r\n\r\n", b"400"),
    (b"Content-Length: +5\r\n\r\nhello", b"400"),
    (b"Content-Length: 1_0\r\n\r\n0123456789", b"400"),
    (b"Content-Length: 5\r\nContent-Length: 0\r\n\r\nhello", b"400"),
    (b"Transfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n", b"400"),
    (b"Transfer-Encoding: chunked\r\n\r\n-2\r\n", b"400"),
    (b"Transfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n", b"501"),
], ids=["cl-te", "te-cl", "cl-plus", "cl-underscore", "cl-differing", "chunk-0x", "chunk-negative",
        "te-chunked-identity"])
def test_a_request_pipelined_behind_bad_framing_is_never_served(framing, status):
    async def check(port):
        got = await _exchange(port, b"POST /a HTTP/1.1\r\nHost: x\r\n" + framing + get(b"/smuggled"))
        assert got.startswith(b"HTTP/1.1 " + status) and b"connection: close" in got
        assert got.count(b"HTTP/1.1 ") == 1 and b"/smuggled" not in got
    _run(check)


def test_100_continue_comes_only_after_the_size_check():
    async def check(port):
        got = await _exchange(port, b"POST /big HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                                    b"Content-Length: 5000\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 413") and b"100 Continue" not in got
        got = await _exchange(port, b"POST /ok HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                                    b"Transfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
                              until=b"POST /ok ok")
        assert got.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK")
    _run(check)


async def _trickle(stream: trio.SocketStream) -> None:
    """Send a head that never ends, one byte at a time (slowloris), until the server cuts the connection."""
    try:
        await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        while True:
            await stream.send_all(b"a")
            await trio.sleep(0.02)   # the attack's pace, not a wait on the server
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


def test_a_client_trickling_its_head_and_an_idle_one_are_closed_while_others_are_served():
    async def check(port):
        async with trio.open_nursery() as nursery:
            slow = await trio.open_tcp_stream("127.0.0.1", port)
            nursery.start_soon(_trickle, slow)
            idle = await trio.open_tcp_stream("127.0.0.1", port)
            await idle.send_all(get(b"/first"))
            assert (await _receive_until(idle, b"GET /first ")).startswith(b"HTTP/1.1 200")
            assert (await _exchange(port, get(b"/other"), until=b"GET /other ")).startswith(b"HTTP/1.1 200")
            got = await _receive_until(slow)   # to the close
            assert got.startswith(b"HTTP/1.1 408") and b"request head was not complete within 0.5 s" in got
            assert await _receive_until(idle) == b""   # closed after keep_alive_s
            nursery.cancel_scope.cancel()
    _run(check, ServerLimits(head_timeout_s=0.5, keep_alive_s=1))


def test_a_connection_flood_is_turned_away_while_admitted_and_later_connections_are_served():
    num_flood = 200

    async def check(port):
        held = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(8)]
        for i, stream in enumerate(held):   # each answered, so each holds one of the 8 slots
            await stream.send_all(get(b"/held%d" % i))
            assert (await _receive_until(stream, b"/held%d " % i)).startswith(b"HTTP/1.1 200")
        answers = []

        async def flood_one():
            answers.append(await _exchange(port, get(b"/flood")))   # to the close

        async with trio.open_nursery() as nursery:
            for _ in range(num_flood):
                nursery.start_soon(flood_one)
            await held[0].send_all(get(b"/during"))
            assert (await _receive_until(held[0], b"GET /during ")).startswith(b"HTTP/1.1 200")
        assert len(answers) == num_flood
        assert all(a.startswith(b"HTTP/1.1 503") and b"retry-after: 1\r\n" in a for a in answers), answers[0]
        for stream in held[1:]:
            await stream.aclose()
        got = b""
        while not got.startswith(b"HTTP/1.1 200"):   # once the server has seen them close (no sleep:
            await trio.testing.wait_all_tasks_blocked()   # a retry only if the kernel was slower to tell it)
            got = await _exchange(port, get(b"/after"), until=b"\r\n\r\n")
            assert got.startswith((b"HTTP/1.1 200", b"HTTP/1.1 503"))
        await held[0].aclose()
    _run(check, ServerLimits(max_connections=8))


@pytest.fixture(scope="module")
def server_port():
    """The port of a server of the test app, run in a thread for the module."""
    with served(app, ServerLimits(max_body_bytes=1000)) as port:
        yield port


def _send_and_read_to_the_close(port: int, data: bytes) -> bytes:
    """Send `data`, end the sending side, and read until the server closes (a 10 s socket timeout
    guards a hang: it fails the test)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall(data)
        client.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := client.recv(65536):
            got += chunk
    return got


BASES = [get(b"/a"), b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc",
         b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3;e\r\nabc\r\n0\r\n\r\n"]


@st.composite
def noisy_requests(draw) -> bytes:
    """Two requests, pipelined, with a few bytes inserted, dropped or replaced."""
    data = bytearray(draw(st.sampled_from(BASES)) + draw(st.sampled_from(BASES)))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data) - 1))
        byte = draw(st.sampled_from(b"\r\n :;,0x-+_\t\x00aF9") | st.integers(0, 255))
        if draw(st.booleans()):
            data.insert(at, byte)
        else:
            data[at] = byte
    return bytes(data)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(noisy_requests(), st.binary(max_size=300)))
def test_any_bytes_get_answers_with_known_statuses_or_a_close_and_the_server_serves_on(server_port, data):
    got = _send_and_read_to_the_close(server_port, data)
    assert got == b"" or got.startswith(b"HTTP/1.1 ")
    assert set(re.findall(rb"HTTP/1\.1 (\d{3}) ", got)) <= {b"100", b"200", b"400", b"413", b"431", b"501", b"505"}
    assert _send_and_read_to_the_close(server_port, get(b"/ok")).startswith(b"HTTP/1.1 200")
