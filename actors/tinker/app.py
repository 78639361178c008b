"""The Tinker API's HTTP face: a Starlette (ASGI) app over a `TinkerService`, under `/api/v1`.

    app = build_app(service, api_key="tml-...")        # served by the gateway's HTTP server (http_server.py)

    POST /api/v1/client/config  /client/dynamic_config  /create_session  /session_heartbeat
         /sessions/{id}/finish  /telemetry  /create_model  /get_info  /forward_backward (protobuf)
         /optim_step  /save_weights  /load_weights  /save_weights_for_sampler  /create_sampling_session  /join_sampling_session
         /asample  /retrieve_future  /cancel_future
         /postrain/sandbox/run     (postrain's extension: code run in nsjail, sandbox_runs.py)
    GET  /api/v1/get_server_capabilities  /healthz  /samplers/{id}

Every `/api/v1/` request carries the key as `X-API-Key` (what the SDK sends from $TINKER_API_KEY
or `ServiceClient(api_key=...)`); with the server's key set, another key or none is answered 401,
compared in constant time. Errors are `{"detail": MESSAGE}` with their status (errors.py); a
handler's failure is that request's alone.
"""
from __future__ import annotations

import hmac
import json
import logging

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .errors import TinkerAPIError
from .service import TinkerService


def check_tinker_key(key: str | None) -> str | None:
    """The key, when the tinker SDK can send it (it sends only keys that start with `tml-`)."""
    from ..gateway.auth import ApiKeyError
    if key is not None and not key.startswith("tml-"):
        raise ApiKeyError("the tinker SDK only sends an API key that starts with 'tml-'; fix: choose one such "
                          "as tml-$(openssl rand -hex 16)")
    return key

log = logging.getLogger("postrain.tinker")


def build_app(service: TinkerService, api_key: str | None = None) -> Starlette:
    """The app over `service`; `api_key`: the X-API-Key every `/api/v1/` call must carry (None: any)."""
    def post(handler, is_async: bool = False):
        async def endpoint(request: Request) -> Response:
            body = await _json(request)
            out = await handler(body) if is_async else handler(body)
            return JSONResponse(out if out is not None else {})
        return endpoint

    async def forward_backward(request: Request) -> Response:
        body = await request.body()
        if request.headers.get("content-encoding", "").lower() == "zstd":
            import zstandard
            try:
                body = zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 30)
            except zstandard.ZstdError as exc:
                raise TinkerAPIError(400, f"the zstd body does not decompress ({exc})") from None
        return JSONResponse(service.forward_backward(body))

    async def retrieve_future(request: Request) -> Response:
        content_type, payload = await service.retrieve_future(await _json(request))
        return Response(payload, media_type=content_type)

    async def finish(request: Request) -> Response:
        await service.finish_session(request.path_params["session_id"], await _json(request))
        return JSONResponse({})

    async def telemetry(request: Request) -> Response:
        await request.body()
        return JSONResponse({"status": "accepted"})

    async def dynamic_config(request: Request) -> Response:
        service.client_config(await _json(request))
        return JSONResponse({"sample_cancel_enabled": True})

    async def capabilities(request: Request) -> Response:
        return JSONResponse(service.capabilities())

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def sampler(request: Request) -> Response:
        return JSONResponse(service.sampler_info(request.path_params["sampler_id"]))

    async def api_error(request: Request, exc: TinkerAPIError) -> Response:
        headers = {"Retry-After": str(int(exc.retry_after_s))} if exc.retry_after_s is not None else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("tinker: %s %s failed", request.method, request.url.path)
        return JSONResponse({"detail": f"internal error: {type(exc).__name__}: {exc}"}, status_code=500)

    v1 = "/api/v1"
    routes = [
        Route(f"{v1}/client/config", post(service.client_config), methods=["POST"]),
        Route(f"{v1}/client/dynamic_config", dynamic_config, methods=["POST"]),
        Route(f"{v1}/create_session", post(service.create_session), methods=["POST"]),
        Route(f"{v1}/session_heartbeat", post(service.heartbeat), methods=["POST"]),
        Route(f"{v1}/sessions/{{session_id}}/finish", finish, methods=["POST"]),
        Route(f"{v1}/telemetry", telemetry, methods=["POST"]),
        Route(f"{v1}/get_server_capabilities", capabilities, methods=["GET"]),
        Route(f"{v1}/healthz", healthz, methods=["GET"]),
        Route(f"{v1}/create_model", post(service.create_model, is_async=True), methods=["POST"]),
        Route(f"{v1}/get_info", post(service.get_info), methods=["POST"]),
        Route(f"{v1}/forward_backward", forward_backward, methods=["POST"]),
        Route(f"{v1}/optim_step", post(service.optim_step), methods=["POST"]),
        Route(f"{v1}/save_weights_for_sampler", post(service.save_weights_for_sampler), methods=["POST"]),
        Route(f"{v1}/save_weights", post(service.save_weights), methods=["POST"]),
        Route(f"{v1}/load_weights", post(service.load_weights, is_async=True), methods=["POST"]),
        Route(f"{v1}/create_sampling_session", post(service.create_sampling_session), methods=["POST"]),
        Route(f"{v1}/join_sampling_session", post(service.join_sampling_session), methods=["POST"]),
        Route(f"{v1}/samplers/{{sampler_id}}", sampler, methods=["GET"]),
        Route(f"{v1}/asample", post(service.asample), methods=["POST"]),
        Route(f"{v1}/retrieve_future", retrieve_future, methods=["POST"]),
        Route(f"{v1}/cancel_future", post(service.cancel_future), methods=["POST"]),
        Route(f"{v1}/postrain/sandbox/run", post(service.sandbox.run, is_async=True), methods=["POST"]),
    ]
    # type ignore: starlette types every handler as taking Exception; it calls each with its own class
    handlers = {TinkerAPIError: api_error, Exception: server_error}
    app = Starlette(routes=routes, exception_handlers=handlers)  # type: ignore[arg-type]
    return RequireApiKey(app, api_key) if api_key is not None else app   # type: ignore[return-value]


async def _json(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TinkerAPIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise TinkerAPIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


class RequireApiKey:
    """ASGI middleware: an `/api/v1/` request without the server's X-API-Key is answered 401."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/api/v1/"):
            return await self.app(scope, receive, send)
        token = next((v for k, v in scope["headers"] if k == b"x-api-key"), None)
        if token is not None and hmac.compare_digest(token, self.key):
            return await self.app(scope, receive, send)
        message = ("the API key is not this server's; set TINKER_API_KEY to the key given to `postrain serve "
                   "--tinker --api-key`" if token is not None else
                   "no API key was sent; set TINKER_API_KEY (the SDK sends it as X-API-Key)")
        await JSONResponse({"detail": message}, status_code=401)(scope, receive, send)
