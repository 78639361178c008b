"""A Tinker server (postrain.actors.tinker) on loopback, run from a thread, for the SDK's client."""
from __future__ import annotations

import contextlib
from typing import Iterator

import trio

from postrain.actors.tinker import BaseModels, TinkerOptions, serve_tinker

from threaded_server import served_by   # tests/actors/

API_KEY = "tml-postrain-test"


@contextlib.contextmanager
def tinker_served(bases: BaseModels, options: TinkerOptions | None = None,
                  api_key: str | None = API_KEY) -> Iterator[tuple[str, object]]:
    """(base URL, the TinkerService) while the block runs; the server stops at its end."""
    async def start(sock, task_status=trio.TASK_STATUS_IGNORED):
        await serve_tinker(bases, options or TinkerOptions(), sock, api_key, task_status=task_status)
    with served_by(start) as (port, service):
        yield f"http://127.0.0.1:{port}", service
