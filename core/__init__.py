"""postrain.core: the microkernel.

Actors (one process, one event loop, handlers per message kind), the
ZeroMQ transport and msgpack wire codec, the supervisor and the scheduler,
the run config and each actor's validated options, and the generic load
record. It knows no role and nothing of RL: the roles live in
postrain.actors, the `postrain` command in postrain.cli.
"""
from typing import Any

# The public names and the module of each. They load on first use (PEP 562), so that importing
# `postrain.core.errors` (the one import the leaf libraries ext/ and sandbox/ may make) does not
# load the kernel (ZeroMQ, pydantic, anyio) with it.
_EXPORTS = {
    "actor": ("Actor", "handler", "import_actor_class", "import_object"),
    "actor_ref": ("ActorRef",),
    "config": ("ActorSpec", "RunConfig", "load_config", "parse_config"),
    "errors": ("ActorDiedError", "ActorError", "ActorStartError", "ActorTimeoutError", "AuthenticationError",
               "ConfigError", "DiskFullError", "LoadError", "PlacementError", "PostrainError", "RemoteError",
               "WireError"),
    "inbox": ("Reply",),
    "lifecycle": ("ActorEvent",),
    "load": ("RESIZE", "Load", "ResizeReply", "ResizeRequest"),
    "messages": ("MessageKind",),
    "control": ("LOOKUP", "ActorLocation", "Lookup"),
    "lending": ("WORK", "WorkReply", "WorkRequest"),
    "record": ("Record", "RecordError"),
    "node": ("Node",),
    "options": ("NoOptions", "Options", "validate_options"),
    "run_options": ("resolve_options",),
    "scheduler": ("Inventory", "Placement", "Scheduler"),
    "supervisor": ("Supervisor",),
    "transport": ("CurveKeys",),
    "wire": ("Message",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:   # Any: mypy types `from postrain.core import X` by it
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'postrain.core' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
