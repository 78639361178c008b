"""Who may call the gateway's API: its API key, and the key of each episode a run has open.

    keys = ApiKeys(key, service.episodes)
    app = Starlette(..., middleware=[Middleware(RequireApiKey, keys=keys)])   # app.py

With no key set (the default, on loopback) every caller is served. With one, a
`/v1/...` request must carry `Authorization: Bearer KEY` with that key (compared in constant
time, hmac.compare_digest) or with the key of an open episode (episodes.py: a run hands each
agent its episode's key, a fresh uuid4, so agents work unchanged); any other gets 401 in the
OpenAI API's error shape. `/health` stays open, for probes. A key is required where the gateway
listens beyond the machine (`is_loopback`): the gateway's options and `postrain serve` refuse to
start without one.
"""
from __future__ import annotations

import hmac
import ipaddress
import re
from pathlib import Path

from starlette.responses import JSONResponse

from postrain.core.errors import PostrainError

from .episodes import EpisodeStore
from .protocol import APIError

_KEY = re.compile(r"[\x21-\x7e]+")   # visible ASCII: what an Authorization header carries as it is


class ApiKeyError(PostrainError, ValueError):
    """A key that cannot be used (empty, or not visible ASCII), or a key file that cannot be read.
    A ValueError too, so that an options validator that raises it names the field."""


def is_loopback(host: str) -> bool:
    """Whether `host` (what a server binds) reaches this machine only: localhost, 127.0.0.0/8, ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_api_key(key: str, where: str = "the API key") -> str:
    """`key` when it is 1+ visible ASCII characters (no spaces); ApiKeyError naming `where` otherwise."""
    if not _KEY.fullmatch(key):   # the key itself is not shown
        raise ApiKeyError(f"{where} must be 1 or more visible ASCII characters (no spaces); fix: make one "
                          f"with `openssl rand -hex 32`")
    return key


def read_api_key_file(path: str | Path) -> str:
    """The key in the file at `path` (its first line, without surrounding whitespace)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ApiKeyError(f"cannot read the API key file {str(path)!r} ({reason}); fix: write the key on its "
                          f"first line") from None
    lines = text.strip().splitlines()
    return check_api_key(lines[0].strip() if lines else "", where=f"the first line of {str(path)!r}")


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of an `Authorization: Bearer TOKEN` header among ASGI `headers`, else None."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() or None if scheme.lower() == b"bearer" else None
    return None


class ApiKeys:
    """The gateway's key and its open episodes, whose keys also admit. (An episode's key is looked
    up in a dict: its timing tells at most a hash match, and the key is a fresh uuid4.)"""

    def __init__(self, key: str, episodes: EpisodeStore):
        self.key = check_api_key(key).encode("ascii")
        self.episodes = episodes

    def admits(self, token: bytes | None) -> bool:
        if token is None:
            return False
        return hmac.compare_digest(token, self.key) or self.episodes.get(token.decode("latin-1")) is not None


class RequireApiKey:
    """ASGI middleware: a `/v1/` request that `keys` does not admit is answered 401 (the module's note)."""

    def __init__(self, app, keys: ApiKeys):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        token = bearer_token(scope["headers"])
        if self.keys.admits(token):
            return await self.app(scope, receive, send)
        error = APIError(401, "Incorrect API key provided." if token is not None else
                         "You didn't provide an API key; send it as `Authorization: Bearer KEY`.",
                         code="invalid_api_key")
        response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
