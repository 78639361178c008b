"""The Tinker API served by postrain: the researcher's own training loop (the `tinker` SDK,
tinker-cookbook) against LoRA tenants on base models this server holds ([tinker](../../docs/tinker.md)).

    postrain serve --tinker --model tiny --port 8000 --api-key tml-local
    # then: TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local python my_loop.py

    from postrain.actors.tinker import BaseModels, TinkerOptions, serve_tinker
    await serve_tinker(BaseModels.load(["tiny"]), TinkerOptions(), sock, api_key=None)

The parts: `app.py` (HTTP routes, the API key), `service.py` (what each endpoint does),
`sessions.py`, `tenants.py` (a LoRA adapter, its AdamW and gradients on a shared frozen base),
`ordering.py` (seq_id order and deduplication), `losses.py`, `sampling.py` (saved sampler
weights and the generator's engine), `futures.py` (retrieve_future), `wire.py` (the SDK's
protobuf bodies), `base_models.py`, `errors.py`; postrain's sandbox extension: `sandbox_runs.py`
(the server's side) and `sandbox_client.py` (`SandboxClient`, what a loop imports beside the SDK).
"""
from __future__ import annotations

import socket as stdlib_socket

import trio

from .app import build_app
from .base_models import BaseModels, HeldModel, parse_model_arg
from .errors import SUPPORTED_SDK_VERSION, TinkerAPIError
from .sandbox_client import SandboxClient, SandboxRunRequest, SandboxRunResult
from .service import TinkerOptions, TinkerService


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


__all__ = ["SUPPORTED_SDK_VERSION", "BaseModels", "HeldModel", "SandboxClient", "SandboxRunRequest", "SandboxRunResult",
           "TinkerAPIError", "TinkerOptions", "TinkerService", "build_app", "parse_model_arg", "serve_tinker"]
