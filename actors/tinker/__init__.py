"""The Tinker API served by postrain: the researcher's own training loop (the `tinker` SDK,
tinker-cookbook) against LoRA tenants on base models this server holds ([tinker](../../docs/tinker.md)).

    postrain serve --tinker --model tiny --port 8000 --api-key tml-local
    # then: TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local python my_loop.py

    from postrain.actors.tinker import BaseModels, TinkerOptions, serve_tinker
    await serve_tinker(BaseModels.load(["tiny"]), TinkerOptions(), sock, api_key=None)

The parts: `server.py` (`serve_tinker`), `actor.py` (the `tinker` role of a run), `app.py` (HTTP
routes, the API key), `options.py` (`TinkerOptions`), `service.py` (what each endpoint does), `batching.py` (tenants' ops batched into one forward),
`sessions.py`, `tenants.py` (a LoRA adapter, its AdamW and gradients on a shared frozen base),
`ordering.py` (seq_id order and deduplication), `losses.py`, `sampling.py` (saved sampler
weights and the generator's engine), `futures.py` (retrieve_future), `wire.py` (the SDK's
protobuf bodies), `base_models.py`, `errors.py`; postrain's sandbox extension: `sandbox_runs.py`
(the server's side) and `sandbox_client.py` (`SandboxClient`, what a loop imports beside the SDK).
"""
from __future__ import annotations

from .actor import TinkerActor
from .app import build_app
from .base_models import BaseModels, HeldModel, parse_model_arg
from .errors import SUPPORTED_SDK_VERSION, TinkerAPIError
from .sandbox_client import SandboxClient, SandboxRunRequest, SandboxRunResult
from .server import serve_tinker
from .options import TinkerOptions
from .service import TinkerService

__all__ = ["SUPPORTED_SDK_VERSION", "BaseModels", "HeldModel", "SandboxClient", "SandboxRunRequest", "SandboxRunResult",
           "TinkerAPIError", "TinkerActor", "TinkerOptions", "TinkerService", "build_app", "parse_model_arg", "serve_tinker"]
