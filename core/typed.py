"""Typed handlers: the kernel decodes a handler's body into its declared record and encodes the
record it returns, so a handler never sees or returns a bare dict.

    @handler(EXEC)                                         # EXEC = MessageKind("exec", ExecRequest, ExecReply)
    async def exec(self, request: ExecRequest) -> ExecReply: ...
    table[LOOKUP.name] = typed_handler(LOOKUP, self._on_lookup)   # a function outside an Actor

`request` / `reply` is any class with `from_wire(data)` / `to_wire()` (the kernel names no role:
the roles' records live above it, in postrain.actors.records), or None: a bodiless message
(a body other than None or {} is refused) / a handler that returns nothing. Left out, the
handler is untyped (UNTYPED: body and reply pass as they are); tests/actors/records/test_handlers.py
refuses that for every role's handler. A stream's reply class types each item.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, AsyncIterator, Awaitable, Callable

from .inbox import Handler, Reply
from .messages import UNTYPED, MessageKind, decode


def encode(kind: str, reply: type[Any] | None, value: Any) -> Any:
    """The wire form of what a typed handler returned (or yielded); TypeError when it is not the
    declared record. A `Reply` (core/inbox.py) keeps its policy_version."""
    if reply is UNTYPED:
        return value
    if isinstance(value, Reply):
        return Reply(encode(kind, reply, value.body), value.policy_version)
    if reply is None:
        if value is not None:
            raise TypeError(f"handler {kind!r} declares reply=None but returned {type(value).__name__}")
        return None
    if not isinstance(value, reply):
        raise TypeError(f"handler {kind!r} must return a {reply.__name__} (its reply=), got "
                        f"{type(value).__name__}; fix: build the record, not its wire dict")
    return value.to_wire()


def typed(fn: Callable[..., Any], kind: str, request: type[Any] | None, reply: type[Any] | None,
          stream: bool) -> Callable[..., Any]:
    """`fn` wrapped to decode its body and encode its reply(s); `fn` itself when both are UNTYPED."""
    if request is UNTYPED and reply is UNTYPED:
        return fn
    if stream:
        @functools.wraps(fn)
        async def typed_stream(self: Any, body: Any, *rest: Any) -> AsyncIterator[Any]:
            async with contextlib.aclosing(fn(self, decode(kind, request, body), *rest)) as items:
                async for item in items:
                    yield encode(kind, reply, item)
        return typed_stream

    @functools.wraps(fn)
    async def typed_call(self: Any, body: Any, *rest: Any) -> Any:
        return encode(kind, reply, await fn(self, decode(kind, request, body), *rest))
    return typed_call


def typed_handler(kind: MessageKind[Any, Any], fn: Callable[..., Awaitable[Any]], **options: Any) -> Handler:
    """The inbox's Handler of a declared message whose function is not an actor's `@handler`
    method (the head's table, the kernel's control messages to an actor): `fn` receives the
    request record (and the Message, with wants_message=True) and returns the reply record."""
    @functools.wraps(fn)
    async def call(body: Any, *rest: Any) -> Any:
        return encode(kind.name, kind.reply, await fn(decode(kind.name, kind.request, body), *rest))
    return Handler(call, **options)
