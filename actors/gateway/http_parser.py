"""Strict HTTP/1.1 request parsing, sans I/O: bytes in, request heads and bodies out (RFC 9112).

    parser = RequestParser(max_head_bytes=64 * 1024, max_body_bytes=8 * 1024 * 1024)
    parser.feed(data)
    head = parser.read_head()   # None: more bytes needed; else a RequestHead
    body = parser.read_body()   # after a head: None until the whole body is in; then bytes

Either call raises `HTTPRefusal(status, message)` for a request the server must answer itself
and then close the connection on: 400 (malformed), 413 (body over max_body_bytes), 431 (head or
trailers over max_head_bytes), 501 (a transfer coding other than chunked), 505 (not HTTP/1.x).

Design note. Request smuggling lives where two parsers disagree about where a request ends, so
this one accepts only framing that every conforming parser reads alike and refuses the rest
(RFC 9112 section 6): Content-Length is ASCII digits only (no sign, `_`, inner space or `0x`;
repeated values must be equal); a chunk size is 1-16 hex digits, then optional `;` extensions;
a request with both Content-Length and Transfer-Encoding, an HTTP/1.0 request with
Transfer-Encoding, and any Transfer-Encoding but exactly `chunked` are refused; every line ends
in CRLF, and a bare CR or LF, a NUL or another control byte in a line is refused; an HTTP/1.1
request carries exactly one Host (RFC 9112 3.2). After a refusal the parser's state is
undefined: the caller closes the connection.

Invariant: the parser holds at most max_head_bytes (the head, or the trailers) plus
max_body_bytes (the body) plus the bytes fed past what the current step needed; a caller that
feeds only when a step returned None, one receive at a time, bounds a connection's memory.
Sizes are checked before bytes are kept: a Content-Length over the limit is refused with the
head, before any body byte is read (and before `100 Continue`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

MAX_CHUNK_LINE_BYTES = 1024         # a chunk-size line with its extensions
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")    # RFC 9110 5.6.2: a method, a field name
_TARGET = re.compile(rb"[\x21-\x7e\x80-\xff]+")            # no space, no control byte
_FIELD_VALUE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")      # RFC 9110 5.5: HTAB, visible, obs-text
_DIGITS = re.compile(rb"[0-9]{1,18}")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_VERSION = re.compile(rb"HTTP/([0-9])\.([0-9])")


class HTTPRefusal(Exception):
    """A request the server answers itself with `status` (the message says why), then closes."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RequestHead:
    """A checked request line and header section. `headers` are (lower-cased name, value) in order;
    the body is `content_length` bytes, or chunked when `chunked` (then content_length == 0)."""

    method: str
    target: bytes
    version: str                 # "1.0" or "1.1"
    headers: list[tuple[bytes, bytes]]
    keep_alive: bool
    chunked: bool
    content_length: int
    expect_continue: bool


class RequestParser:
    """One connection's request stream. Not thread-safe; one request at a time: `read_head`, then
    `read_body` until it returns the body, then `read_head` for the next (pipelined) request."""

    def __init__(self, max_head_bytes: int, max_body_bytes: int):
        self.max_head_bytes, self.max_body_bytes = max_head_bytes, max_body_bytes
        self._buffer = bytearray()
        self._scanned = 0            # bytes of the buffer known to hold no head end (CRLFCRLF)
        self._head: RequestHead | None = None      # the request whose body is being read
        self._chunks: _ChunkedBody | None = None   # its chunked decoder, when chunked

    @property
    def num_buffered_bytes(self) -> int:
        return len(self._buffer)

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def read_head(self) -> RequestHead | None:
        """The next request's head once it is all in, else None; HTTPRefusal when it is bad."""
        assert self._head is None, "read_body must return the body before the next read_head"
        end = self._buffer.find(b"\r\n\r\n", max(0, self._scanned - 3))
        if end < 0 or end + 4 > self.max_head_bytes:
            self._scanned = len(self._buffer)
            if end >= 0 or len(self._buffer) > self.max_head_bytes:
                raise HTTPRefusal(431, f"the request head is over {self.max_head_bytes} bytes")
            return None
        head = parse_head(bytes(self._buffer[:end]), self.max_body_bytes)
        del self._buffer[:end + 4]
        self._scanned = 0
        self._head = head
        if head.chunked:
            self._chunks = _ChunkedBody(self.max_head_bytes, self.max_body_bytes)
        return head

    def read_body(self) -> bytes | None:
        """The body of the request `read_head` returned, once it is all in, else None."""
        assert self._head is not None, "read_head must return a head first"
        if self._chunks is not None:
            body = self._chunks.read(self._buffer)
        elif len(self._buffer) >= self._head.content_length:
            body = bytes(self._buffer[:self._head.content_length])
            del self._buffer[:self._head.content_length]
        else:
            body = None
        if body is not None:
            self._head = self._chunks = None
        return body


class _ChunkedBody:
    """The chunked decoder of one body (RFC 9112 7.1), taking what it can from the buffer each
    `read`; the chunk data moves to `body` as it arrives, so the buffer never holds a whole chunk."""

    def __init__(self, max_trailer_bytes: int, max_body_bytes: int):
        self.max_trailer_bytes, self.max_body_bytes = max_trailer_bytes, max_body_bytes
        self.body = bytearray()
        self.data_left = 0          # bytes of the current chunk's data still to come
        self.stage = "size"         # "size" | "data" | "data-end" | "trailers"
        self.num_trailer_bytes = 0

    def read(self, buffer: bytearray) -> bytes | None:
        """The whole body once its last chunk and trailers are in `buffer` (consumed), else None."""
        while True:
            if self.stage == "size":
                line = _take_line(buffer, MAX_CHUNK_LINE_BYTES, "a chunk-size line")
                if line is None:
                    return None
                size = chunk_size(line)
                if len(self.body) + size > self.max_body_bytes:
                    raise HTTPRefusal(413, f"the request body is over {self.max_body_bytes} bytes")
                self.stage, self.data_left = ("data", size) if size else ("trailers", 0)
            elif self.stage == "data":
                piece = buffer[:self.data_left]
                del buffer[:len(piece)]
                self.body += piece
                self.data_left -= len(piece)
                if self.data_left:
                    return None
                self.stage = "data-end"
            elif self.stage == "data-end":
                if len(buffer) < 2:
                    return None
                if buffer[:2] != b"\r\n":
                    raise HTTPRefusal(400, "a chunk's data does not end with CRLF")
                del buffer[:2]
                self.stage = "size"
            else:
                line = _take_line(buffer, max(0, self.max_trailer_bytes - self.num_trailer_bytes),
                                  "the trailer section", status=431)
                if line is None:
                    return None
                if not line:
                    return bytes(self.body)
                self.num_trailer_bytes += len(line) + 2
                field_line(line)


def _take_line(buffer: bytearray, max_bytes: int, what: str, status: int = 400) -> bytes | None:
    """The next line of `buffer` without its CRLF (consumed), None until one is in; HTTPRefusal
    when none ends within `max_bytes`."""
    end = buffer.find(b"\r\n", 0, max_bytes + 2)
    if end < 0:
        if len(buffer) >= max_bytes + 2:
            raise HTTPRefusal(status, f"{what} is over {max_bytes} bytes")
        return None
    line = bytes(buffer[:end])
    del buffer[:end + 2]
    return line


def parse_head(head: bytes, max_body_bytes: int) -> RequestHead:
    """A request head (its lines, without the final empty line) checked into a RequestHead."""
    lines = head.split(b"\r\n")
    method, target, version = request_line(lines[0])
    headers = [field_line(line) for line in lines[1:]]
    num_hosts = sum(name == b"host" for name, _ in headers)
    if num_hosts > 1 or (num_hosts == 0 and version == "1.1"):
        raise HTTPRefusal(400, f"a request carries one Host header (RFC 9112 3.2; HTTP/1.0: at most one), "
                               f"this one has {num_hosts}")
    chunked, content_length = body_framing(headers, version, max_body_bytes)
    connection = {token.strip().lower() for name, value in headers if name == b"connection"
                  for token in value.split(b",")}
    keep_alive = b"close" not in connection if version == "1.1" else b"keep-alive" in connection
    expect = [value.lower() for name, value in headers if name == b"expect"]
    return RequestHead(method, target, version, headers, keep_alive, chunked, content_length,
                       expect_continue=version == "1.1" and b"100-continue" in expect)


def request_line(line: bytes) -> tuple[str, bytes, str]:
    """(method, target, version) of `METHOD SP TARGET SP HTTP/1.x`; HTTPRefusal otherwise."""
    parts = line.split(b" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not _TARGET.fullmatch(parts[1]):
        raise HTTPRefusal(400, f"malformed request line {line[:80]!r}")
    version = _VERSION.fullmatch(parts[2])
    if version is None:
        raise HTTPRefusal(400, f"malformed request line {line[:80]!r}")
    if version[1] != b"1":
        shown = parts[2].decode("ascii")
        raise HTTPRefusal(505, f"{shown} is not served; use HTTP/1.1")
    return parts[0].decode("ascii"), parts[1], "1.0" if version[2] == b"0" else "1.1"   # 1.x: as 1.1


def field_line(line: bytes) -> tuple[bytes, bytes]:
    """(lower-cased name, value without surrounding whitespace) of `name: value`; HTTPRefusal for
    a name that is not a token (no whitespace before the colon, no folded line) or a control
    byte (bare CR or LF, NUL) in the value."""
    name, colon, value = line.partition(b":")
    value = value.strip(b" \t")
    if not colon or not _TOKEN.fullmatch(name) or not _FIELD_VALUE.fullmatch(value):
        raise HTTPRefusal(400, f"malformed header line {line[:80]!r}")
    return name.lower(), value


def body_framing(headers: list[tuple[bytes, bytes]], version: str, max_body_bytes: int) -> tuple[bool, int]:
    """(chunked, content_length) of a request (RFC 9112 6.3); HTTPRefusal where the framing is
    ambiguous (both headers, an HTTP/1.0 Transfer-Encoding), unsupported or over the limit."""
    codings = [value for name, value in headers if name == b"transfer-encoding"]
    lengths = [value for name, value in headers if name == b"content-length"]
    if codings and lengths:
        raise HTTPRefusal(400, "a request with both Content-Length and Transfer-Encoding is refused "
                               "(RFC 9112 6.1); send one")
    if codings and version == "1.0":
        raise HTTPRefusal(400, "an HTTP/1.0 request cannot use Transfer-Encoding; send Content-Length")
    if codings:
        if len(codings) != 1 or codings[0].lower() != b"chunked":
            shown = b", ".join(codings).decode("latin-1")[:80]
            raise HTTPRefusal(501, f"transfer-encoding {shown!r} is not supported; send the body with "
                                   f"Content-Length or `Transfer-Encoding: chunked` alone")
        return True, 0
    if not lengths:
        return False, 0
    length = content_length(lengths)
    if length > max_body_bytes:
        raise HTTPRefusal(413, f"the request body is over {max_body_bytes} bytes")
    return False, length


def content_length(values: list[bytes]) -> int:
    """The one length that every Content-Length value (a field may list several) names; each is
    1-18 ASCII digits, and they must be equal."""
    parts = [part.strip(b" \t") for value in values for part in value.split(b",")]
    if not all(_DIGITS.fullmatch(part) for part in parts):
        raise HTTPRefusal(400, f"Content-Length must be decimal digits only, got {b', '.join(values)[:80]!r}")
    if len({int(part) for part in parts}) != 1:
        raise HTTPRefusal(400, f"Content-Length values differ: {b', '.join(values)[:80]!r}")
    return int(parts[0])


def chunk_size(line: bytes) -> int:
    """The size of a chunk-size line: 1-16 hex digits, then optional whitespace and `;` extensions."""
    size, semicolon, extensions = line.partition(b";")
    if semicolon:
        size = size.rstrip(b" \t")
    if not _HEX.fullmatch(size) or not _FIELD_VALUE.fullmatch(extensions):
        raise HTTPRefusal(400, f"malformed chunk-size line {line[:40]!r}: the size must be hex digits only")
    return int(size, 16)
