"""`serve_tinker`: the Tinker API's HTTP server on a listening socket (the command's and the
`tinker` role's)."""
from __future__ import annotations

import socket as stdlib_socket

import trio

from .app import build_app
from .base_models import BaseModels
from .options import TinkerOptions
from .service import TinkerService


async def serve_tinker(bases: BaseModels, options: TinkerOptions, sock: stdlib_socket.socket,
                       api_key: str | None = None, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the Tinker API on the listening `sock` until cancelled (the gateway's HTTP server).
    Cancelled: every connection is cut; work running in a thread finishes there; what the server
    wrote to its state_dir is deleted."""
    from ..gateway.http_server import ServerLimits, serve

    service: TinkerService | None = None
    try:
        async with trio.open_nursery() as nursery:
            service = TinkerService(bases, options, nursery)
            limits = ServerLimits(max_body_bytes=256 * 1024 * 1024, keep_alive_s=600.0)
            await nursery.start(serve, build_app(service, api_key), sock, limits)
            task_status.started(service)
    finally:       # every thread has returned: evicted tenants' files mean nothing once state in memory is gone
        if service is not None:
            service.close()
