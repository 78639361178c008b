"""A server on loopback, run from a thread with its own trio loop (tests): the gateway's built-in
HTTP server with an ASGI app (`served`), or any server started the same way (`served_by`)."""
from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any, Callable, Iterator

import trio

from postrain.actors.gateway.http_server import ServerLimits, serve


@contextlib.contextmanager
def served_by(start: Callable[..., Any], *args: Any, timeout_s: float = 60) -> Iterator[tuple[int, Any]]:
    """(port, what `start` reported) while the block runs: `await nursery.start(start, *args, sock)`
    on a bound loopback socket; the server stops at the block's end."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
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
    assert started.wait(timeout_s), "the server did not start"
    try:
        yield sock.getsockname()[1], box["value"]
    finally:
        trio.from_thread.run_sync(box["stop"].set, trio_token=box["token"])
        thread.join(30)


@contextlib.contextmanager
def served(app, limits: ServerLimits | None = None) -> Iterator[int]:
    """The port `app` is served on while the block runs; the server stops at its end."""
    async def start(app, sock, task_status=trio.TASK_STATUS_IGNORED):
        await serve(app, sock, *(() if limits is None else (limits,)), task_status=task_status)
    with served_by(start, app) as (port, _):
        yield port
