"""A Tinker server (postrain.actors.tinker) on loopback, run from a thread, for the SDK's client."""
from __future__ import annotations

import contextlib
import socket
import threading
from typing import Iterator

import trio

from postrain.actors.tinker import BaseModels, TinkerOptions, serve_tinker

API_KEY = "tml-postrain-test"


@contextlib.contextmanager
def tinker_served(bases: BaseModels, options: TinkerOptions | None = None,
                  api_key: str | None = API_KEY) -> Iterator[tuple[str, object]]:
    """(base URL, the TinkerService) while the block runs; the server stops at its end."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    started, box = threading.Event(), {}

    async def main():
        box["token"], box["stop"] = trio.lowlevel.current_trio_token(), trio.Event()
        async with trio.open_nursery() as nursery:
            box["service"] = await nursery.start(serve_tinker, bases, options or TinkerOptions(), sock, api_key)
            started.set()
            await box["stop"].wait()
            nursery.cancel_scope.cancel()
    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    assert started.wait(60), "the Tinker server did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", box["service"]
    finally:
        trio.from_thread.run_sync(box["stop"].set, trio_token=box["token"])
        thread.join(30)
