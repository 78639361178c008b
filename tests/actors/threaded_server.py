"""A server on loopback, run from a thread with its own trio loop (tests): the gateway's built-in
HTTP server with an ASGI app (`served`), or any server started the same way (`served_by`)."""
from __future__ import annotations

import contextlib
from typing import Iterator

import trio

from postrain.actors.gateway.http_server import ServerLimits, serve, served_in_thread


served_by = served_in_thread     # (port, what `start` reported) while the block runs


@contextlib.contextmanager
def served(app, limits: ServerLimits | None = None) -> Iterator[int]:
    """The port `app` is served on while the block runs; the server stops at its end."""
    async def start(app, sock, task_status=trio.TASK_STATUS_IGNORED):
        await serve(app, sock, *(() if limits is None else (limits,)), task_status=task_status)
    with served_by(start, app) as (port, _):
        yield port
