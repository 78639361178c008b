"""The root of every typed error postrain raises on purpose, and the microkernel's own errors.

Every error that postrain raises on purpose derives from `PostrainError`, so a caller can catch
"postrain said no" apart from a bug, whichever layer said it. Each message names the rule, the
value and the fix. An error keeps its other bases (ValueError, TimeoutError, ...) so that
`except ValueError` clauses written against it still work.

This module imports nothing (not even the rest of postrain.core), so that the leaf libraries
`postrain.ext` and `postrain.sandbox`, which depend on nothing of ours, may import it: it is
their one allowed import of postrain. Keep it so.
"""


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
    """An actor process failed before its READY handshake; the message holds why.

    actor: its name; cls: its class's import path; reason: one line (how the process
    ended, or the last line of its traceback); traceback: the actor's own traceback ("" when it
    sent none); log_path: the file its output went to (None when it inherited the head's)."""

    def __init__(self, message: str, *, actor: str = "", cls: str = "", reason: str = "",
                 traceback: str = "", log_path: str | None = None):
        super().__init__(message)
        self.actor = actor
        self.cls = cls
        self.reason = reason or message
        self.traceback = traceback
        self.log_path = log_path


class DiskFullError(PostrainError, OSError):
    """A write failed for want of space (ENOSPC, EDQUOT); the message names the file, the free
    space and what to do. Whoever raises it has left its files whole (core/jsonl.py)."""


class WireError(PostrainError, ValueError):
    """A message that cannot be encoded or decoded (core/wire.py), or a shared-memory array that
    cannot be mapped (core/shm.py); the message says which part and why."""


class LoadError(PostrainError, ValueError):
    """An actor's load record (core/load.py) or a RESIZE body broke its schema."""
