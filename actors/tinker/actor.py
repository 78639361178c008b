"""The `tinker` role: the Tinker API served by an actor of a run, as `postrain serve --tinker` serves
it alone ([tinker](../../docs/tinker.md)).

    [[actors]]
    name = "tinker"
    cls = "postrain.actors.tinker:TinkerActor"
    options = { models = ["tiny"], port = 8000, api_key_file = "tinker.key", service = { evict_after_s = 300 } }

Under `postrain up` the head places, supervises and restarts it like any actor; a run whose only
driver is the user's loop has no `run.driver` and lasts until `postrain down`. The actor's
`tinker_address` message answers where it listens (port 0: a free one). A restart loses the
tenants' state in memory (as the standalone server's stop does); evicted tenants live in
`service.state_dir`.
"""
from __future__ import annotations

import logging

import anyio
import anyio.to_thread
from pydantic import Field, SecretStr, model_validator

from postrain.core import Actor, Options, handler

from ..gateway.auth import is_loopback, read_api_key_file
from ..gateway.http_server import listening_socket
from ..records import TINKER_ADDRESS, GatewayAddress
from .app import check_tinker_key
from .base_models import BaseModels
from .server import serve_tinker
from .options import TinkerOptions

log = logging.getLogger(__name__)


class TinkerActorOptions(Options):
    models: list[str] = Field(["tiny"], min_length=1, description="the base models served: a model spec, or "
                              "NAME=SPEC to serve it under NAME (the SDK's base_model)")
    seed: int = Field(0, description="init of a from-scratch base model (a built-in name)")
    host: str = Field("127.0.0.1", description="the address the HTTP server listens on")
    port: int = Field(0, ge=0, le=65535, description="its TCP port; 0: a free one (ask `tinker_address`)")
    api_key: SecretStr | None = Field(None, description="the key the SDK sends (TINKER_API_KEY; it must start "
                                      "with 'tml-'); none: no key is checked. Required when host is not loopback")
    api_key_file: str | None = Field(None, description="a file whose first line is the key, instead of api_key")
    service: TinkerOptions = Field(default_factory=TinkerOptions, description="the server's limits, eviction "
                                   "and sandbox extension (`postrain serve --tinker`'s flags; docs/tinker.md)")

    @model_validator(mode="after")
    def _key_where_exposed(self):
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("set api_key or api_key_file, not both")
        if self.api_key is not None:
            check_tinker_key(self.api_key.get_secret_value())
        if self.api_key is None and self.api_key_file is None and not is_loopback(self.host):
            raise ValueError(f"host {self.host!r} is not loopback, so the Tinker server needs an API key; fix: "
                             "set api_key_file (a file holding the key) or api_key, or host = '127.0.0.1'")
        return self

    def read_api_key(self) -> str | None:
        if self.api_key_file is not None:
            return check_tinker_key(read_api_key_file(self.api_key_file))
        return self.api_key.get_secret_value() if self.api_key is not None else None


class TinkerActor(Actor):
    Options = TinkerActorOptions

    async def setup(self):
        """Load the base models, bind the socket, start serving. Cancelled: the process ends with it."""
        options = self.options
        bases = await anyio.to_thread.run_sync(lambda: BaseModels.load(options.models, seed=options.seed))
        self._socket, self.url = listening_socket(options.host, options.port, "the Tinker server")
        self._names = ",".join(bases.names)
        self._stopped = anyio.Event()
        self.node.spawn(self._serve, bases, options.read_api_key())
        log.info("tinker %s serves %s at %s", self.name, self._names, self.url)

    async def _serve(self, bases: BaseModels, api_key: str | None) -> None:
        """The API on this loop until teardown. Cancelled: the server stops (connections cut)."""
        async with anyio.create_task_group() as group:
            group.start_soon(serve_tinker, bases, self.options.service, self._socket, api_key)
            await self._stopped.wait()
            group.cancel_scope.cancel()

    async def teardown(self):
        """Stop serving. Does not wait."""
        self._stopped.set()

    @handler(TINKER_ADDRESS)
    async def server_address(self, body: None) -> GatewayAddress:
        """Where the server listens (the SDK's base_url is `url`). Does not wait (cancel-safe)."""
        return GatewayAddress(url=self.url, base_url=self.url, model=self._names)
