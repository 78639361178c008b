"""An ASGI app served by the gateway's built-in HTTP server on loopback, from a thread (tests)."""
from __future__ import annotations

import contextlib
import socket
import threading
from typing import Iterator

import trio

from postrain.actors.gateway.http_server import ServerLimits, serve


@contextlib.contextmanager
def served(app, limits: ServerLimits | None = None) -> Iterator[int]:
    """The port `app` is served on while the block runs; the server stops at its end."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    started, box = threading.Event(), {}

    async def main():
        box["token"], box["stop"] = trio.lowlevel.current_trio_token(), trio.Event()
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, app, sock, *(() if limits is None else (limits,)))
            started.set()
            await box["stop"].wait()
            nursery.cancel_scope.cancel()
    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    assert started.wait(30), "the server did not start"
    try:
        yield sock.getsockname()[1]
    finally:
        trio.from_thread.run_sync(box["stop"].set, trio_token=box["token"])
        thread.join(30)
