"""postrain.core: the microkernel.

Actors (one process, one event loop, handlers per message kind), the
ZeroMQ transport and msgpack wire codec, the supervisor and the scheduler,
the run config and each actor's validated options, and the generic load
record. It knows no role and nothing of RL: the roles live in
postrain.actors, the `postrain` command in postrain.cli.
"""
from .actor import Actor, handler, import_actor_class, import_object
from .config import ActorSpec, RunConfig, load_config, parse_config
from .errors import (ActorDiedError, ActorError, ActorStartError, ActorTimeoutError, AuthenticationError,
                     ConfigError, PlacementError, PostrainError, RemoteError)
from .inbox import Reply
from .node import ActorRef, Node
from .options import NoOptions, Options, resolve_options, validate_options
from .scheduler import Inventory, Placement, Scheduler
from .supervisor import ActorEvent, Supervisor
from .transport import CurveKeys
from .wire import Message, WireError

__all__ = [
    "Actor", "ActorDiedError", "ActorError", "ActorEvent", "ActorRef", "ActorSpec", "ActorStartError",
    "ActorTimeoutError", "AuthenticationError", "ConfigError", "CurveKeys", "Inventory", "Message", "Node",
    "NoOptions", "Options", "Placement", "PlacementError", "PostrainError", "RemoteError", "Reply", "RunConfig", "Scheduler",
    "Supervisor", "WireError", "handler", "import_actor_class", "import_object",
    "load_config", "parse_config", "resolve_options", "validate_options",
]
