"""Client sessions: what `ServiceClient` opens, keeps alive and finishes.

    sessions = SessionStore()
    session_id = sessions.create(sdk_version="0.38.0", tags=[], user_metadata={})
    sessions.heartbeat(session_id)         # 404 unknown, 410 finished (the SDK stops its heartbeat)
    sessions.finish(session_id, "success") # first finish wins; the service frees its tenants

A session owns the training clients (model ids) and sampling sessions made in it; finishing it
frees them. The SDK heartbeats every 10 s; the service finishes a session silent for
`session_timeout_s` (a client that died without closing), with the reason "timeout". Invariant: a session id is in `_finished` or `_open`, never both.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from .errors import TinkerAPIError, check_sdk_version


@dataclass
class Session:
    session_id: str
    tags: list[str]
    user_metadata: dict
    last_heartbeat_s: float
    model_ids: list[str] = field(default_factory=list)


class SessionStore:
    """Open and finished sessions by id (module docstring)."""

    def __init__(self) -> None:
        self._open: dict[str, Session] = {}
        self._finished: dict[str, str] = {}     # session id -> the reason it finished with

    def create(self, sdk_version: str, tags: list[str], user_metadata: dict | None) -> str:
        check_sdk_version(sdk_version, "create_session")
        session_id = f"session-{uuid.uuid4().hex[:16]}"
        self._open[session_id] = Session(session_id, list(tags), dict(user_metadata or {}), time.monotonic())
        return session_id

    def get(self, session_id: str) -> Session:
        session = self._open.get(session_id)
        if session is None:
            if session_id in self._finished:
                raise TinkerAPIError(410, f"session {session_id!r} has finished ({self._finished[session_id]}); "
                                          "open a new ServiceClient")
            raise TinkerAPIError(404, f"unknown session_id {session_id!r}; open one with ServiceClient()")
        return session

    def is_open(self, session_id: str) -> bool:
        return session_id in self._open

    def heartbeat(self, session_id: str) -> None:
        self.get(session_id).last_heartbeat_s = time.monotonic()

    def finish(self, session_id: str, reason: str) -> Session | None:
        """Mark the session finished; the Session when it was open (its resources to free), else None."""
        session = self._open.pop(session_id, None)
        if session is None and session_id not in self._finished:
            raise TinkerAPIError(404, f"unknown session_id {session_id!r}")
        if session is not None:
            self._finished[session_id] = reason
        return session

    def silent_since(self, before_s: float) -> list[str]:
        """The open sessions whose last heartbeat (or creation) is older than `before_s` (monotonic)."""
        return [sid for sid, session in self._open.items() if session.last_heartbeat_s < before_s]

    @property
    def num_open(self) -> int:
        return len(self._open)
