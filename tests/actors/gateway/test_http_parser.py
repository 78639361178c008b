"""The gateway's strict HTTP/1.1 request parser (actors/gateway/http_parser.py), sans I/O.

A corpus of requests, each parsed whole and fed one byte at a time: the smuggling cases the
security review found (Content-Length with a sign, `_` or inner space, chunk sizes `0x5` and
`-2`, Content-Length beside Transfer-Encoding, differing duplicate lengths, `chunked, identity`)
are refused with the status RFC 9112 names, and well-framed requests give their body. Then
hypothesis: any bytes, in any split, are parsed or refused (never another exception, never a
different outcome for another split), and every request a plain encoder writes parses back.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from postrain.actors.gateway.http_parser import MAX_CHUNK_LINE_BYTES, HTTPRefusal, RequestParser

MAX_HEAD_BYTES, MAX_BODY_BYTES = 1024, 100
REFUSALS = {400, 413, 431, 501, 505}


def post(*fields: bytes, body: bytes = b"", version: bytes = b"HTTP/1.1") -> bytes:
    head = b"POST /v1/x " + version + b"\r\nHost: x\r\n" + b"".join(f + b"\r\n" for f in fields)
    return head + b"\r\n" + body


def chunked(body: bytes, *fields: bytes) -> bytes:
    return post(b"Transfer-Encoding: chunked", *fields, body=body)


CORPUS = [   # (id, request, the body it gives, or the status it is refused with)
    ("content-length", post(b"Content-Length: 5", body=b"hello"), b"hello"),
    ("content-length-leading-zeros", post(b"Content-Length: 005", body=b"hello"), b"hello"),
    ("content-length-repeated", post(b"Content-Length: 5", b"content-length: 5, 5", body=b"hello"), b"hello"),
    ("no-body", b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", b""),
    ("http-1.0-no-host", b"GET / HTTP/1.0\r\n\r\n", b""),
    ("chunked-extensions-trailers", chunked(b"3;a=b\r\nabc\r\n2 ; c\r\nde\r\n0\r\nX-T: 1\r\n\r\n"), b"abcde"),
    ("chunked-upper-hex", chunked(b"A\r\n0123456789\r\n0\r\n\r\n"), b"0123456789"),
    ("chunked-any-case", post(b"Transfer-Encoding: Chunked", body=b"1\r\nz\r\n0\r\n\r\n"), b"z"),
    ("cl-and-te", post(b"Content-Length: 4", b"Transfer-Encoding: chunked", body=b"0\r\n\r\n"), 400),
    ("te-and-cl", post(b"Transfer-Encoding: chunked", b"Content-Length: 4", body=b"0\r\n\r\n"), 400),
    ("cl-plus", post(b"Content-Length: +5", body=b"hello"), 400),
    ("cl-underscore", post(b"Content-Length: 1_0", body=b"0123456789"), 400),
    ("cl-minus", post(b"Content-Length: -1"), 400),
    ("cl-inner-space", post(b"Content-Length: 1 0", body=b"0123456789"), 400),
    ("cl-hex", post(b"Content-Length: 0x5", body=b"hello"), 400),
    ("cl-empty", post(b"Content-Length: "), 400),
    ("cl-unicode-digit", post("Content-Length: \u0665".encode()), 400),
    ("cl-19-digits", post(b"Content-Length: " + b"1" * 19), 400),
    ("cl-differing-fields", post(b"Content-Length: 5", b"Content-Length: 6", body=b"hello!"), 400),
    ("cl-differing-list", post(b"Content-Length: 5, 6", body=b"hello!"), 400),
    ("cl-over-limit", post(b"Content-Length: 101"), 413),
    ("chunk-0x", chunked(b"0x5\r\nhello\r\n0\r\n\r\n"), 400),
    ("chunk-negative", chunked(b"-2\r\nGET /smuggled HTTP/1.1\r\n\r\n"), 400),
    ("chunk-plus", chunked(b"+5\r\nhello\r\n0\r\n\r\n"), 400),
    ("chunk-underscore", chunked(b"5_0\r\nhello\r\n0\r\n\r\n"), 400),
    ("chunk-leading-space", chunked(b" 5\r\nhello\r\n0\r\n\r\n"), 400),
    ("chunk-17-hex-digits", chunked(b"1" * 17 + b"\r\n"), 400),
    ("chunk-empty-size", chunked(b";x\r\n"), 400),
    ("chunk-bare-lf-in-extension", chunked(b"5;a\nb\r\nhello\r\n0\r\n\r\n"), 400),
    ("chunk-data-without-crlf", chunked(b"3\r\nabcX\r\n0\r\n\r\n"), 400),
    ("chunk-line-too-long", chunked(b"1;" + b"x" * MAX_CHUNK_LINE_BYTES + b"\r\n"), 400),
    ("chunks-over-limit", chunked(b"40\r\n" + b"a" * 64 + b"\r\n40\r\n"), 413),
    ("te-chunked-identity", post(b"Transfer-Encoding: chunked, identity", body=b"0\r\n\r\n"), 501),
    ("te-identity", post(b"Transfer-Encoding: identity"), 501),
    ("te-gzip-chunked", post(b"Transfer-Encoding: gzip, chunked", body=b"0\r\n\r\n"), 501),
    ("te-twice", post(b"Transfer-Encoding: chunked", b"Transfer-Encoding: chunked", body=b"0\r\n\r\n"), 501),
    ("te-http-1.0", post(b"Transfer-Encoding: chunked", body=b"0\r\n\r\n", version=b"HTTP/1.0"), 400),
    ("space-before-colon", post(b"Content-Length : 5", body=b"hello"), 400),
    ("folded-line", post(b"X-A: 1", b" folded"), 400),
    ("bare-lf-in-value", post(b"X-A: 1\nContent-Length: 5", body=b"hello"), 400),
    ("bare-cr-in-value", post(b"X-A: 1\rContent-Length: 5", body=b"hello"), 400),
    ("nul-in-value", post(b"X-A: a\x00b"), 400),
    ("no-host", b"GET / HTTP/1.1\r\n\r\n", 400),
    ("two-hosts", post(b"Host: y"), 400),
    ("request-line-double-space", b"GET  / HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    ("request-line-lower-version", b"GET / http/1.1\r\nHost: x\r\n\r\n", 400),
    ("request-line-bare-lf", b"GET / HTTP/1.1\nHost: x\r\n\r\n", 400),
    ("http-2", b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", 505),
    ("head-over-limit", post(b"X-A: " + b"a" * MAX_HEAD_BYTES), 431),
    ("trailers-over-limit", chunked(b"0\r\nX-T: " + b"t" * MAX_HEAD_BYTES + b"\r\n\r\n"), 431),
]


def outcome(request: bytes, piece_sizes: list[int] = ()) -> tuple[list[bytes], int | str]:
    """The bodies of the requests in `request` fed in pieces of `piece_sizes` bytes (then the rest at
    once), and how it ends: the refusal's status, "more" (a request begun, not whole) or "end"."""
    parser = RequestParser(MAX_HEAD_BYTES, MAX_BODY_BYTES)
    pieces, bodies = _pieces(request, piece_sizes), []

    def until(step):
        while (value := step()) is None:
            piece = next(pieces, None)
            if piece is None:
                return None
            parser.feed(piece)
        return value
    try:
        while (head := until(parser.read_head)) is not None:
            body = until(parser.read_body)
            if body is None:
                return bodies, "more"
            assert head.chunked or len(body) == head.content_length
            bodies.append(body)
        return bodies, "more" if parser.num_buffered_bytes else "end"
    except HTTPRefusal as refusal:
        assert refusal.status in REFUSALS and str(refusal)
        return bodies, refusal.status


def _pieces(data: bytes, sizes):
    at = 0
    for size in sizes:
        if at >= len(data):
            return
        yield data[at:at + size]
        at += size
    if at < len(data):
        yield data[at:]


@pytest.mark.parametrize("request_bytes, expected", [case[1:] for case in CORPUS],
                         ids=[case[0] for case in CORPUS])
def test_the_corpus_is_parsed_or_refused_whole_and_byte_by_byte(request_bytes, expected):
    want = ([expected], "end") if isinstance(expected, bytes) else ([], expected)
    assert outcome(request_bytes) == want
    assert outcome(request_bytes, [1] * len(request_bytes)) == want


def test_pipelined_requests_come_out_in_order_and_a_smuggled_one_never_does():
    two = post(b"Content-Length: 3", body=b"one") + chunked(b"3\r\ntwo\r\n0\r\n\r\n")
    assert outcome(two) == ([b"one", b"two"], "end")
    smuggled = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
    both = post(b"Content-Length: 5", b"Transfer-Encoding: chunked", body=b"0\r\n\r\n")
    assert outcome(both + smuggled) == ([], 400)
    assert outcome(post(b"Content-Length: 1", b"Content-Length: 0", body=b"X") + smuggled) == ([], 400)


def test_100_continue_is_asked_only_by_http_1_1_and_checked_sizes_come_first():
    parser = RequestParser(MAX_HEAD_BYTES, MAX_BODY_BYTES)
    parser.feed(post(b"Expect: 100-continue", b"Content-Length: 3"))
    assert parser.read_head().expect_continue and parser.read_body() is None
    parser = RequestParser(MAX_HEAD_BYTES, MAX_BODY_BYTES)
    parser.feed(post(b"Expect: 100-continue", b"Content-Length: 3", version=b"HTTP/1.0"))
    assert not parser.read_head().expect_continue
    parser = RequestParser(MAX_HEAD_BYTES, MAX_BODY_BYTES)
    parser.feed(post(b"Expect: 100-continue", b"Content-Length: 101"))   # no head comes out to answer 100 to
    with pytest.raises(HTTPRefusal, match="over 100 bytes") as refused:
        parser.read_head()
    assert refused.value.status == 413


# ---------------------------------------------------------------- fuzz
TRICKY = b"\r\n :;,0xX-+_\t\x00aF9"
splits = st.lists(st.integers(1, 64), max_size=24)


@st.composite
def mutated(draw) -> bytes:
    """A corpus request with a few bytes inserted, dropped or replaced (mostly framing bytes)."""
    data = bytearray(draw(st.sampled_from([case[1] for case in CORPUS])))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        byte = draw(st.sampled_from(TRICKY) | st.integers(0, 255))
        kind = draw(st.sampled_from(["insert", "drop", "replace"]))
        if kind == "insert" or at == len(data):
            data.insert(at, byte)
        elif kind == "drop":
            del data[at]
        else:
            data[at] = byte
    return bytes(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=st.one_of(mutated(), st.binary(max_size=400)), split=splits)
def test_any_bytes_are_parsed_or_refused_alike_in_any_split(request, split):
    """Never another exception; whole or in pieces, the same bodies and the same end."""
    assert outcome(request, split) == outcome(request)


token = st.text("abcdefghijklmnopqrstuvwxyz-0123456789", min_size=1, max_size=12)
field_value = st.text("".join(map(chr, range(0x21, 0x7f))) + " \t", max_size=30).map(str.strip)


@st.composite
def encoded(draw) -> tuple[bytes, bytes]:
    """(request, its body): a well-framed request a plain client would write, by Content-Length or
    in random chunks with extensions and trailers."""
    body = draw(st.binary(max_size=MAX_BODY_BYTES))
    names = draw(st.lists(token.filter(lambda n: n not in ("host", "content-length", "transfer-encoding",
                                                              "connection", "expect")), max_size=5))
    fields = [f"{name}: {draw(field_value)}".encode() for name in names]
    if not draw(st.booleans()):
        return post(b"Content-Length: %d" % len(body), *fields, body=body), body
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=4)))
    pieces = [body[a:b] for a, b in zip([0] + cuts, cuts + [len(body)]) if b > a]
    extension = draw(st.sampled_from([b"", b";x", b" ;name=value", b";a=\"q\""]))
    framed = b"".join(b"%x%s\r\n%s\r\n" % (len(p), extension, p) for p in pieces)
    trailers = b"".join(b"%s: 1\r\n" % name.encode() for name in draw(st.lists(token, max_size=2)))
    return chunked(framed + b"0\r\n" + trailers + b"\r\n", *fields), body


@settings(max_examples=200, deadline=None)
@given(request=encoded(), split=splits)
def test_every_well_framed_request_parses_back_to_its_body(request, split):
    data, body = request
    assert outcome(data + data, split) == ([body, body], "end")
