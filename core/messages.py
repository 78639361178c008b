"""Message kinds, each declared once: the name that travels, its request record, its reply record.

    GENERATE = MessageKind("generate", GenerateRequest, GenerateReply)   # beside the records
    @handler(GENERATE, concurrent=True)                                  # the receiving end
    async def generate(self, request: GenerateRequest) -> GenerateReply: ...
    reply = await ref.call(GENERATE, request, timeout_s=30)             # the calling end: a GenerateReply
    await ref.send(LOAD_WEIGHTS, sync)                                   # one-way
    async for item in ref.call_stream(EXEC_STREAM, request): ...        # each item a reply record

A declaration is the one place a message's name is spelled: the handler registers under it
and every caller names the declaration, so the two ends cannot drift apart, and both ends
are typed (the kernel decodes the request into its record before the handler runs, and the
caller gets the reply's record back; core/typed.py). `request` / `reply` is a class with
`from_wire(data)` / `to_wire()` (a Record, core/record.py), None for a bodiless message or a
handler that returns nothing, or UNTYPED (raw bodies: the kernel's own test actors only;
tests/actors/records/test_handlers.py refuses it for every role).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic

from typing_extensions import TypeVar


class _Untyped:
    def __repr__(self) -> str:
        return "UNTYPED"


UNTYPED: Any = _Untyped()   # a handler's request or reply that was not declared


def check_codec(kind: str, what: str, cls: Any) -> None:
    """TypeError unless `cls` is UNTYPED, None or a class with the codec method a `what` needs."""
    method = "from_wire" if what == "request" else "to_wire"
    if cls is not UNTYPED and cls is not None and not (isinstance(cls, type) and hasattr(cls, method)):
        raise TypeError(f"handler {kind!r}: {what}= must be a class with {method}() or None, got {cls!r}")


def decode(kind: str, request: Any, body: Any) -> Any:
    """The body a typed handler receives: the request record (None for a bodiless message)."""
    if request is UNTYPED:
        return body
    if request is None:
        if body not in (None, {}):
            raise TypeError(f"{kind} takes no body (request=None), got {type(body).__name__} {body!r:.80}")
        return None
    return request.from_wire(body)


RequestT = TypeVar("RequestT", default=None)    # a kind declared with request=None takes no body
ReplyT = TypeVar("ReplyT", default=None)


@dataclass(frozen=True, slots=True)
class MessageKind(Generic[RequestT, ReplyT]):
    """One message: `name` on the wire, the `request` record a handler receives, the `reply`
    record it returns (each item's, for a `stream`)."""

    name: str
    request: type[RequestT] | None = UNTYPED    # UNTYPED: raw bodies (the kernel's test actors)
    reply: type[ReplyT] | None = UNTYPED
    stream: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a message kind needs a name")
        check_codec(self.name, "request", self.request)
        check_codec(self.name, "reply", self.reply)

    def encode_request(self, request: RequestT | None) -> Any:
        """The wire body of `request` (a record of `self.request`, or None); TypeError otherwise."""
        if self.request is UNTYPED:
            return request
        if self.request is None:
            if request is not None:
                raise TypeError(f"{self.name} takes no body, got {type(request).__name__}")
            return None
        if not isinstance(request, self.request):
            raise TypeError(f"{self.name} takes a {self.request.__name__}, got {type(request).__name__}; "
                            "fix: build the record, not its wire dict")
        return request.to_wire()  # type: ignore[attr-defined]   # a Record (check_codec)

    def decode_reply(self, body: Any) -> ReplyT:
        """The reply record of a received body (None for reply=None)."""
        if self.reply is UNTYPED or self.reply is None:
            return body  # type: ignore[no-any-return]   # raw (UNTYPED) or None
        return self.reply.from_wire(body)  # type: ignore[attr-defined, no-any-return]   # a Record (check_codec)
