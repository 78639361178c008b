"""The typed errors of the microkernel. Each message names the rule, the value and the fix."""
from __future__ import annotations


class PostrainError(Exception):
    """Base of every error postrain raises on purpose."""


class ConfigError(PostrainError, ValueError):
    """A config file or spec broke a rule; the message lists every bad field."""


class PlacementError(PostrainError):
    """The scheduler cannot give an actor what it asked for."""


class ActorError(PostrainError):
    """A request to an actor failed."""


class RemoteError(ActorError):
    """The actor's handler raised, or the actor rejected the message.

    error_type: the remote exception's class name (or a wire error type such as
    "MalformedMessage", "UnknownKind"); remote_traceback: its formatted traceback.
    """

    def __init__(self, error_type: str, message: str, remote_traceback: str = ""):
        super().__init__(f"{error_type}: {message}")
        self.error_type = error_type
        self.remote_message = message
        self.remote_traceback = remote_traceback


class ActorDiedError(ActorError):
    """The actor's connection dropped (it died or was stopped) with this request in flight."""


class ActorTimeoutError(ActorError, TimeoutError):
    """No reply within the timeout (the actor may be hung, overloaded or not started)."""


class AuthenticationError(ActorError):
    """The peer refused our CurveZMQ key (or we refused its)."""


class ActorStartError(PostrainError):
    """An actor process failed before its READY handshake; the message holds why."""
