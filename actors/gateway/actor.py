"""The gateway actor: the OpenAI API over HTTP in front of the run's generators.

    [[actors]]
    name = "gateway"
    cls = "postrain.actors.gateway:GatewayActor"
    options = { generators = ["generator"], port = 8000 }   # model: [shared]

Options: `GatewayOptions` below. A host that is not loopback needs an API key (`api_key_file` or
`api_key`; auth.py), and `http_limits` caps what HTTP clients can hold (docs/agents.md, "Exposing
the gateway").

Messages (records of postrain.actors.records.gateway):
- `address` (no body) -> GatewayAddress {"url", "base_url", "model"}: where clients connect.
- `open_episode` OpenEpisode {"key"} -> None: calls made with API key `key` are recorded from now
  on (token-in/token-out, episodes.py).
- `close_episode` CloseEpisode {"key"} -> EpisodeSegments {"segments", "num_calls"}: the episode's
  segments, each a trainable sample; the key is served unrecorded afterwards.

Design note. The HTTP server is the gateway's own lean HTTP/1.1 server (http_server.py) serving
a Starlette app on this actor's own trio loop (Starlette is written against anyio, so it runs on
trio as it is): requests and the ZeroMQ asks to generators share one event loop and one
cancellation model, with no thread or second loop between them. `http_server = "hypercorn"`
serves the same app with hypercorn (its native trio worker) instead, at ~0.4 ms more CPU a
request (docs/performance.md). The listening socket is bound in `setup`, before READY, so the
address a caller gets already accepts connections.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Literal

import anyio
from pydantic import Field, SecretStr, model_validator

from postrain.core import Actor, Options, handler

from ..models.chat_template import OPTION_HELP as CHAT_TEMPLATE_HELP
from ..models.tokenizer import Tokenizer
from .auth import check_api_key, is_loopback, read_api_key_file
from .episodes import EpisodeStore
from .http_server import ServerLimits, listening_socket
from .pool import GeneratorPool
from ..records import (CLOSE_EPISODE, GATEWAY_ADDRESS, OPEN_EPISODE, CloseEpisode, EpisodeSegments,
                       GatewayAddress, OpenEpisode)
from .service import GatewayService
from .templates import render
from .tool_calls import tool_call_format

log = logging.getLogger("postrain.gateway")
DEFAULT_CONTEXT_TOKENS = 4096


class GatewayOptions(Options):
    model: str | dict = Field("tiny", description="the policy (the generators' model spec): its tokenizer "
                              "and chat template render the conversations, its config's image layout "
                              "(a vision-language policy) lays out image content parts")
    chat_template: str | None = Field(None, description=CHAT_TEMPLATE_HELP)
    generators: list[str] = Field(["generator"], min_length=1, description="the generator actors' names; "
                                  "each request goes to the one with the fewest in flight")
    host: str = Field("127.0.0.1", description="the address the HTTP server listens on")
    port: int = Field(0, ge=0, le=65535, description="its TCP port; 0: a free one (ask `address`)")
    served_model_name: str | None = Field(None, description="the model id clients send; none: the model "
                                          "spec as given ('policy' for a dict spec)")
    max_pending_requests: int = Field(256, ge=1, description="requests in flight at most; past it, 429 "
                                      "with Retry-After")
    max_n: int = Field(16, ge=1, description="choices per request (n) at most")
    max_context_tokens: int | None = Field(None, ge=2, description="prompt + completion tokens at most; "
                                           "none: the model config's max_position_embeddings")
    tool_call_format: Literal["auto", "hermes", "llama3"] = Field(
        "auto", description="how tool calls are written by the model; auto: from its chat template")
    max_open_episodes: int = Field(4096, ge=1, description="episodes recorded at once at most (oldest "
                                   "dropped past it)")
    request_timeout_s: float = Field(600.0, gt=0, description="a generate call's time limit, seconds")
    http_server: Literal["builtin", "hypercorn"] = Field(
        "builtin", description="the HTTP/1.1 server: 'builtin' (lean, http_server.py) or 'hypercorn' "
        "(the `gateway` extra; ~0.4 ms more CPU a request)")
    api_key: SecretStr | None = Field(None, description="the key a client sends as `Authorization: Bearer "
                                      "KEY` (an open episode's key admits too; auth.py); none: no key is "
                                      "checked. A key is required when host is not loopback")
    api_key_file: str | None = Field(None, description="a file whose first line is the key, instead of "
                                     "api_key (which the config would hold in clear)")
    http_limits: ServerLimits = Field(default_factory=ServerLimits, description="the HTTP server's caps: "
                                      "connections, head and body bytes, timeouts (http_server.py; "
                                      "hypercorn takes keep_alive_s and max_head_bytes)")

    @model_validator(mode="after")
    def _key_where_exposed(self):
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("set api_key or api_key_file, not both")
        if self.api_key is not None:
            check_api_key(self.api_key.get_secret_value(), "api_key")
        if self.api_key is None and self.api_key_file is None and not is_loopback(self.host):
            raise ValueError(f"host {self.host!r} is not loopback, so the gateway needs an API key; fix: set "
                             f"api_key_file (a file holding the key) or api_key, or host = '127.0.0.1'")
        return self

    def read_api_key(self) -> str | None:
        """The key clients must send (api_key, or api_key_file's first line); None when neither is set."""
        if self.api_key_file is not None:
            return read_api_key_file(self.api_key_file)
        return self.api_key.get_secret_value() if self.api_key is not None else None


def gateway_tokenizer(model: str | dict, chat_template: str | None = None) -> Tokenizer:
    """The tokenizer of a model spec, without its weights (a .gguf file: its metadata only; else the
    environment actor's loader), rendering with `chat_template` where set (checked here)."""
    from ..env.actor import load_tokenizer
    from ..models.gguf import GGUFFile, gguf_tokenizer
    from ..models.loading import resolve_model
    if isinstance(model, str) and resolve_model(model).endswith(".gguf") and Path(resolve_model(model)).is_file():
        path = Path(resolve_model(model))
        tokenizer = gguf_tokenizer(GGUFFile(path), path).with_template(chat_template)
        tokenizer.template_source()
        return tokenizer
    return load_tokenizer(model, chat_template)


def image_layout(model: str | dict):
    """The model's image layout (models/vision.py) from its config, without its weights; None for a
    text-only model, or one whose config is not found here (the generator reports that)."""
    from ..models.loading import CheckpointError, spec_image_layout
    try:
        return spec_image_layout(model)
    except CheckpointError:
        return None


def context_tokens(model: str | dict) -> int:
    """The model's context length (max_position_embeddings) from its config, without its weights."""
    from ..models.config import BUILTIN_CONFIGS, ModelConfig
    from ..models.loading import resolve_model
    if isinstance(model, dict):
        return ModelConfig(**model).max_position_embeddings
    if model in BUILTIN_CONFIGS and not Path(model).exists():
        return BUILTIN_CONFIGS[model].max_position_embeddings
    path = Path(resolve_model(model))
    if path.is_dir() and (path / "config.json").is_file():
        return int(json.loads((path / "config.json").read_text()).get("max_position_embeddings",
                                                                     DEFAULT_CONTEXT_TOKENS))
    return DEFAULT_CONTEXT_TOKENS


class GatewayActor(Actor):
    Options = GatewayOptions

    async def setup(self):
        """Load the tokenizer, look up the generators, bind the socket, start serving.
        Cancelled: the process ends with it (Actor.setup), socket included."""
        from .app import build_app
        options = self.options
        tokenizer = gateway_tokenizer(options.model, options.chat_template)
        refs = [await self.lookup(name) for name in options.generators]
        self.model_name = options.served_model_name or (options.model if isinstance(options.model, str)
                                                        else "policy")
        api_key = options.read_api_key()
        fmt = options.tool_call_format
        self.service = GatewayService(
            tokenizer, GeneratorPool(refs, options.max_pending_requests, options.request_timeout_s),
            (self.model_name,), options.max_context_tokens or context_tokens(options.model),
            tool_call_format(tokenizer.chat_template) if fmt == "auto" else fmt,
            EpisodeStore(tokenizer, options.max_open_episodes), max_n=options.max_n,
            image_layout=image_layout(options.model))
        render(tokenizer, [{"role": "user", "content": "hi"}], [])   # imports and compiles the template now,
        # not in the first request (~0.8 s of jinja2 on this VM)
        self._socket, self.url = listening_socket(options.host, options.port, "the gateway")
        self._stopped = anyio.Event()
        self.node.spawn(self._serve, build_app(self.service, api_key))
        log.info("gateway %s serves %s at %s/v1", self.name, self.model_name, self.url)

    async def _serve(self, app) -> None:
        """The HTTP server on this loop until teardown. Cancelled: the server stops (connections cut)."""
        if self.options.http_server == "builtin":
            from .http_server import serve
            async with anyio.create_task_group() as group:
                group.start_soon(serve, app, self._socket, self.options.http_limits)
                await self._stopped.wait()
                group.cancel_scope.cancel()
            return
        from hypercorn.config import Config
        from hypercorn.trio import serve as hypercorn_serve
        config = Config()
        config.bind = [f"fd://{self._socket.fileno()}"]
        config.accesslog = None
        config.keep_alive_timeout = self.options.http_limits.keep_alive_s
        config.h11_max_incomplete_size = self.options.http_limits.max_head_bytes
        config.graceful_timeout = 1.0   # at stop: connections in flight get 1 s, then the process ends
        await hypercorn_serve(app, config, shutdown_trigger=self._stopped.wait)

    async def teardown(self):
        """Stop accepting; requests in flight end with the process. Does not wait."""
        self._stopped.set()

    @handler(GATEWAY_ADDRESS)
    async def server_address(self, body: None) -> GatewayAddress:
        """Where the server listens. Does not wait (cancel-safe)."""
        return GatewayAddress(url=self.url, base_url=self.url + "/v1", model=self.model_name)

    @handler(OPEN_EPISODE)
    async def open_episode(self, request: OpenEpisode) -> None:
        """Record calls with this key from now on. Does not wait (cancel-safe)."""
        self.service.episodes.open(request.key)

    @handler(CLOSE_EPISODE)
    async def close_episode(self, request: CloseEpisode) -> EpisodeSegments:
        """The episode's segments; it is no longer recorded. Does not wait (cancel-safe)."""
        episode = self.service.episodes.get(request.key)
        num_calls = episode.num_calls if episode is not None else 0
        segments = self.service.close_episode(request.key)
        return EpisodeSegments(segments=[s.record() for s in segments], num_calls=num_calls)
