"""The gateway's HTTP face: a Starlette (ASGI) app over a `GatewayService`.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models   GET /health

Errors are the OpenAI API's JSON bodies (`{"error": {"message", "type", "param", "code"}}`)
with its status codes; 429 and 503 carry `Retry-After`. An error is that request's alone: a
handler fails only its own response. `stream: true` answers with server-sent events in the
API's chunk format, ending in `data: [DONE]`; the generator answers a request whole, so the
chunks (one per sampled token) are sent once the sample is done.

A chat message's content may hold image content parts (`image_url` with a base64 data URL)
when the policy reads images; bad ones are 400s naming the part (protocol.py).

The API key (`Authorization: Bearer KEY`) names the episode whose tokens are recorded
(episodes.py); a key that is not an open episode is served and not recorded. With the gateway's
own `api_key` set, a `/v1/` call must carry it or an open episode's key, else 401 (auth.py).
"""
from __future__ import annotations

import json
import logging
import time

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .auth import ApiKeys, RequireApiKey, bearer_token
from .protocol import APIError, parse_chat, parse_completion
from .service import Answer, GatewayService, usage

log = logging.getLogger("postrain.gateway")


def build_app(service: GatewayService, api_key: str | None = None) -> Starlette:
    """The app over `service`; `api_key`: the key a `/v1/` call must carry (None: no key required)."""
    async def chat_completions(request: Request) -> Response:
        call = parse_chat(await _json(request), service.model_names, service.max_n,
                          reads_images=service.image_layout is not None)
        answer = await service.chat(call, _api_key(request))
        if call.stream:
            return _sse(_chat_chunks(service, call, answer))
        return JSONResponse(service.chat_body(call, answer))

    async def completions(request: Request) -> Response:
        call = parse_completion(await _json(request), service.model_names, service.max_n)
        answer = await service.complete(call)
        if call.stream:
            return _sse(_completion_chunks(call, answer))
        return JSONResponse(service.completion_body(call, answer))

    async def models(request: Request) -> Response:
        created = int(time.time())
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "postrain"}
            for name in service.model_names]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "num_in_flight": service.pool.num_in_flight})

    async def api_error(request: Request, exc: APIError) -> Response:
        headers = {"Retry-After": str(int(exc.retry_after_s))} if exc.retry_after_s is not None else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("gateway: %s %s failed", request.method, request.url.path)
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error").body(),
                            status_code=500)

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"])]
    guard = [] if api_key is None else [Middleware(RequireApiKey, keys=ApiKeys(api_key, service.episodes))]
    # type ignore: starlette types every handler as taking Exception; it calls each with its own class
    handlers = {APIError: api_error, Exception: server_error}
    return Starlette(routes=routes, exception_handlers=handlers, middleware=guard)  # type: ignore[arg-type]


async def _json(request: Request):
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None


def _api_key(request: Request) -> str | None:
    token = bearer_token(request.scope["headers"])
    return token.decode("latin-1") if token is not None else None


def _sse(events) -> StreamingResponse:
    async def body():
        for event in events:
            yield f"data: {json.dumps(event)}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _pieces(service: GatewayService, token_ids: list[int], text: str) -> list[str]:
    """`text` cut where each sampled token's text ends (joined, they are exactly `text`)."""
    pieces, shown = [], ""
    for k in range(1, len(token_ids) + 1):
        upto = service.tokenizer.decode(token_ids[:k], skip_special_tokens=True)[:len(text)]
        if len(upto) > len(shown) and text.startswith(upto):
            pieces.append(upto[len(shown):])
            shown = upto
    if shown != text:
        pieces.append(text[len(shown):])
    return pieces


def _chat_chunks(service: GatewayService, call, answer: Answer):
    base = {"id": answer.id, "object": "chat.completion.chunk", "created": answer.created, "model": call.model}

    def chunk(index, delta, finish=None, logprobs=None):
        return {**base, "choices": [{"index": index, "delta": delta, "finish_reason": finish,
                                     "logprobs": logprobs}]}
    for i, (sample, message, reason) in enumerate(zip(answer.reply.samples, answer.messages, answer.finish_reasons)):
        yield chunk(i, {"role": "assistant", "content": ""})
        if message.get("tool_calls"):
            if message.get("content"):
                yield chunk(i, {"content": message["content"]})
            yield chunk(i, {"tool_calls": [{"index": j, **call_} for j, call_ in enumerate(message["tool_calls"])]})
        else:
            for piece in _pieces(service, sample.token_ids, message["content"] or ""):
                yield chunk(i, {"content": piece})
        logprobs = {"content": service.token_logprobs(sample, call.top_logprobs)} if call.logprobs else None
        yield chunk(i, {}, reason, logprobs)
    if call.include_usage:
        yield {**base, "choices": [], "usage": usage(answer)}


def _completion_chunks(call, answer: Answer):
    base = {"id": answer.id, "object": "text_completion", "created": answer.created, "model": call.model}
    for i, (sample, reason) in enumerate(zip(answer.reply.samples, answer.finish_reasons)):
        yield {**base, "choices": [{"index": i, "text": sample.text, "finish_reason": None, "logprobs": None}]}
        yield {**base, "choices": [{"index": i, "text": "", "finish_reason": reason, "logprobs": None}]}
    if call.include_usage:
        yield {**base, "choices": [], "usage": usage(answer)}

