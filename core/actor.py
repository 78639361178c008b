"""Actors: one OS process, one event loop, one inbox, one handler per message kind.

    from postrain.core import Actor, MessageKind, handler

    ADD = MessageKind("add", AddRequest, Total)            # declared once (core/messages.py)
    COUNT = MessageKind("count", CountRequest, Item, stream=True)

    class Counter(Actor):
        Options = CounterOptions          # its validated options (core/options.py): self.options

        async def setup(self):            # runs before READY
            self.total = 0

        @handler(ADD)                     # request/reply: the returned record is the reply
        async def add(self, request: AddRequest) -> Total:
            self.total += request.n
            return Total(self.total)

        @handler(COUNT)                   # a stream of replies
        async def count(self, request: CountRequest):
            for i in range(request.n):
                yield Item(i)

Handlers run one at a time in arrival order unless declared
`concurrent=True`. A handler that also wants the envelope (sender,
policy_version) declares a second parameter: `async def h(self, body, msg)`.
An actor runs on trio by default; set `backend = "asyncio"` on the class to
run on asyncio with uvloop (for libraries that need asyncio); the message
layer is the same under both.

The process that runs an actor (its entry, READY handshake, heartbeats, the thread that keeps
it alive through a blocking setup, its death with the head) is core/runtime.py's; an actor
sees it through `setup`, `teardown`, `load`, `keep_alive`, `report_progress` and `crash`.

Cores that move (elastic cores, core/elastic.py). The head may re-pin a running actor with
the kernel message `_cores` {"cpu_ids", "num_threads"}: every thread of the process is
pinned to the new cores before the reply, and `num_threads` becomes the torch thread count
of the compute that `in_compute_thread` starts from then on (torch keeps one count per
thread, so the count is set in the thread that computes, at the start of each call; a long
computation may take up a new count midway by calling `apply_num_threads` at safe points).
"""
from __future__ import annotations

import importlib
import inspect
import logging
import os
import sys
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Callable, ClassVar, Iterator, TypeAlias, TypeVar

import anyio

from .actor_ref import ActorRef
from .affinity import pin_threads
from .config import Rendezvous
from .control import (CORES, CRASHED, LOOKUP, PEERS_GONE, PEERS_MOVED, STOP, Cores, Crashed, Lookup,
                      PeersGone, PeersMoved)
from .extras import missing_extra_message
from .inbox import Handler, Inbox
from .load import Load
from .messages import MessageKind
from .node import Node
from .options import NoOptions, Options
from .typed import typed, typed_handler

log = logging.getLogger("postrain.core")

_OptionsModel: TypeAlias = Options   # the model class, where Actor.Options (a class attribute) hides its name
_T = TypeVar("_T")


def handler(kind: MessageKind[Any, Any], *,
            concurrent: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare an actor method as the handler of message `kind`, a MessageKind (core/messages.py,
    which names the message, its request and reply records and whether it streams).
    `concurrent`: each message runs in its own task, while others run."""
    if not isinstance(kind, MessageKind):
        raise TypeError(f"handler() takes a MessageKind (core/messages.py), got {kind!r}; fix: declare "
                        f"the message once, e.g. ECHO = MessageKind({kind!r}, Request, Reply), and use it")
    name, request, reply, stream = kind.name, kind.request, kind.reply, kind.stream

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        if not inspect.iscoroutinefunction(fn) and not inspect.isasyncgenfunction(fn):
            raise TypeError(f"handler {fn.__name__} must be `async def`")
        if stream != inspect.isasyncgenfunction(fn):
            raise TypeError(f"handler {fn.__name__}: stream=True needs an async generator "
                            "(`yield` items), and an async generator needs stream=True")
        if name.startswith("_"):
            raise ValueError(f"handler kind {name!r} may not start with '_' (reserved for the kernel's "
                             "messages, core/control.py)")
        fn = typed(fn, name, request, reply, stream)
        setattr(fn, "_postrain_handler", (name, stream, concurrent))   # setattr: a Callable's type has no
        setattr(fn, "_postrain_types", (request, reply))                # room for attributes of its own
        return fn
    return mark


class Actor:
    """Base class of every actor. Subclasses add handlers and may override setup,
    teardown and load. Attributes available in handlers:

    name: this actor's name; options: the spec's options, validated by the class's `Options`
    model (core/options.py; NoOptions where it declares none); node: the Node
    for talking to other actors; head: an ActorRef to the head (None when run
    without one); address: this actor's inbox address."""

    backend: ClassVar[str] = "trio"
    Options: ClassVar[type[Options]] = NoOptions
    keeps_freed_memory: ClassVar[bool] = False   # a CPU learner: see core/runtime.py, keep_freed_memory
    # Given the run's bulk key (core/identity.py): only a class that seals or opens bulk bytes between
    # nodes (weights) says True; every other actor is started without it. ActorSpec.bulk_key overrides.
    needs_bulk_key: ClassVar[bool] = False
    # Hands out work (a driver): may tell the head which actors start and stop working (its `work`
    # message moves elastic cores, core/lending.py); no other actor may.
    drives_work: ClassVar[bool] = False
    _handler_specs: ClassVar[dict[str, tuple[str, bool, bool]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        specs = dict(cls._handler_specs)
        for attr, value in vars(cls).items():
            marked = getattr(value, "_postrain_handler", None)
            if marked is not None:
                specs[marked[0]] = (attr, marked[1], marked[2])
        cls._handler_specs = specs
        if cls.backend not in ("trio", "asyncio"):
            raise ValueError(f"{cls.__name__}.backend must be 'trio' or 'asyncio', got {cls.backend!r}")

    def __init__(self, name: str, options: _OptionsModel, node: Node, head: ActorRef | None, address: str):
        self.name = name
        self.options = options
        self.node = node
        self.head = head
        self.address = address
        self.inbox: Inbox | None = None
        self._stop_requested = anyio.Event()
        self.progress_note = ""            # what the heartbeats say the actor is doing ("" once READY)
        # Makes the runtime's KeepAlive heartbeat thread (core/runtime.py); set by the runtime.
        self.keep_alive_factory: Callable[[], AbstractContextManager[Any]] | None = None
        self.num_threads: int | None = None  # torch threads for in_compute_thread; None: as started
        self.incarnation = 0                   # how many times the head has started it; set by the runtime
        # The collective group this process is a rank of (an entry with ranks > 1), else None.
        self.rendezvous: Rendezvous | None = None
        # The secret the ranks of that group prove to each other when they meet (core/identity.py).
        self.group_secret: bytes | None = None

    async def crash(self, reason: str) -> None:
        """End this process now as a crash: `reason` is logged and handed to the head (the exit
        event shows it, as a traceback would), then the process exits 1 and its supervisor
        restarts it under `max_restarts`. For a fault the actor cannot mend in place (a broken
        collective group). Does not return; requests in flight fail with ActorDiedError."""
        await report_crash(self.head, {"name": self.name, "incarnation": self.incarnation}, reason)
        logging.shutdown()
        os._exit(1)

    def report_progress(self, note: str) -> None:
        """Say what the actor is doing now ("loading shard 3/8"); the next heartbeat carries it
        to the head (`postrain status`). Not needed to stay alive: heartbeats do that."""
        self.progress_note = note

    @contextmanager
    def keep_alive(self, note: str = "") -> Iterator[None]:
        """Heartbeat from a thread for the body of the `with`, which blocks the event loop on
        purpose (a synchronous checkpoint load in a handler), so that the head does not count
        the actor as hung. The body still runs in the loop's thread; only liveness moves."""
        if note:
            self.report_progress(note)
        with (self.keep_alive_factory() if self.keep_alive_factory is not None else nullcontext()):
            yield

    async def setup(self) -> None:
        """Runs before READY. Raise to fail the start (the head reports the traceback).
        Cancelled (the head kills a start that ran past start_timeout_s): the process dies
        with it, so whatever setup acquired goes with the process."""

    async def teardown(self) -> None:
        """Runs after a STOP message, before the process exits. Cancelled: only by the head's
        kill after stop_timeout_s, which ends the process wherever teardown was."""

    def load(self) -> Load:
        """What each heartbeat reports (core/load.py): the inbox's counters. Override to add
        the pool figures (queued, running, workers) and your own numbers:
        `return super().load().replace(queued=..., figures={...})`. An actor that reports
        `workers` is a pool and must handle RESIZE."""
        inbox = self.inbox
        if inbox is None:
            return Load()
        return Load(in_flight=inbox.num_in_flight, served=inbox.num_served, rejected=inbox.num_rejected)

    async def lookup(self, name: str, timeout_s: float = 10.0) -> ActorRef:
        """An ActorRef to the actor called `name`, by asking the head's registry. Cancelled:
        nothing is left behind (no reference is made until the head answers)."""
        if self.head is None:
            raise LookupError(f"cannot look up {name!r}: this actor runs without a head")
        found = await self.head.call(LOOKUP, Lookup(name), timeout_s=timeout_s)
        return self.node.ref(found.address, name, same_node=found.same_node, server_key=found.server_key)

    def handlers(self) -> dict[str, Handler]:
        table: dict[str, Handler] = {}
        for kind, (attr, stream, concurrent) in self._handler_specs.items():
            fn = getattr(self, attr)
            num_params = len(inspect.signature(fn).parameters)
            table[kind] = Handler(fn, stream=stream, concurrent=concurrent,
                                  wants_message=num_params >= 2)
        # The kernel's own messages come from the supervisors alone (on tcp, their control key):
        # an actor that could send PEERS_MOVED could point another at an address of its choosing.
        table[STOP.name] = typed_handler(STOP, self._handle_stop, control_only=True)
        table[PEERS_MOVED.name] = typed_handler(PEERS_MOVED, self._handle_peers_moved, control_only=True)
        table[PEERS_GONE.name] = typed_handler(PEERS_GONE, self._handle_peers_gone, control_only=True)
        table[CORES.name] = typed_handler(CORES, self._handle_cores, control_only=True)
        return table

    async def _handle_peers_moved(self, peers: PeersMoved) -> None:
        """Actors started again elsewhere (a cluster node was lost; `same_node`: on this actor's
        node): this process's references to them point there from now on (Node.rebind). Does
        not wait (cancel-safe)."""
        for name, moved in peers.moved.items():
            if self.node.rebind(name, moved.address, same_node=moved.same_node):
                log.info("actor %s moved to %s; talking to it there", name, moved.address)

    async def _handle_peers_gone(self, peers: PeersGone) -> None:
        """Actors gone for good ({name: reason}) (a cluster node was lost with them and they fit
        on no node left): `on_peers_gone` first, so the actor stops choosing them, then this
        process's references to them are closed (their requests fail with ActorDiedError, and
        the callers' retry rules apply). Does not wait (cancel-safe)."""
        self.on_peers_gone(dict(peers.gone))
        for name, reason in peers.gone.items():
            if self.node.close_refs(name):
                log.info("actor %s is gone for good (%s); its references are closed", name, reason)

    def on_peers_gone(self, gone: dict[str, str]) -> None:
        """Override to stop using actors gone for good ({name: reason}); it must not block.
        The default does nothing: a reference to one of them fails with ActorDiedError."""

    async def wait_for_stop(self) -> None:
        """Return once a `stop` message has come (the runtime then tears the actor down).
        Cancelled: nothing changes."""
        await self._stop_requested.wait()

    async def _handle_stop(self, body: None) -> None:
        """Ask the process to stop (teardown, then exit 0). Does not wait, so a cancellation
        finds it done."""
        self._stop_requested.set()

    async def _handle_cores(self, cores: Cores) -> Cores:
        """Re-pin every thread to `cpu_ids`; later compute uses `num_threads` threads (module
        doc). Atomic (it never awaits): the reply (the affinity now) means the pin is in place."""
        pin_threads(cores.cpu_ids)
        self.num_threads = cores.num_threads
        return Cores(sorted(os.sched_getaffinity(0)), cores.num_threads)

    async def in_compute_thread(self, fn: Callable[..., _T], *args: Any) -> _T:
        """`fn(*args)` in a worker thread whose torch thread count is this actor's now (elastic
        cores change it between calls). Cancelled: `fn` still runs to its end in its thread;
        its result is dropped."""
        def call() -> _T:
            self.apply_num_threads()
            return fn(*args)
        return await anyio.to_thread.run_sync(call)

    def apply_num_threads(self) -> None:
        """Set torch's thread count in the calling thread to this actor's current one (module
        doc): in_compute_thread calls it first; a long step may call it between its parts."""
        num_threads = self.num_threads
        if num_threads and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(num_threads)


def import_object(path: str) -> Any:
    """'package.module:Name' -> the object: the one loader of import paths in configs (actor
    classes, and whatever else a config names by path). Raises ImportError naming the path."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ImportError(f"import path {path!r} must look like 'package.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        fix = ""
        if missing_extra_message(exc):
            raise ImportError(f"cannot import {module_name} (from {path!r}): it {missing_extra_message(exc)}") from None
        if isinstance(exc, ModuleNotFoundError) and exc.name and module_name.startswith(exc.name):
            fix = (f"; fix: put {exc.name} beside the run config (its folder is on the import path of "
                   f"the head and every actor) or install it (`pip install -e` its project)")
        raise ImportError(f"cannot import {module_name} (from {path!r}): {exc}{fix}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportError(f"module {module_name} has no attribute {attr!r} (from {path!r})") from None


def import_actor_class(path: str) -> type[Actor]:
    """The Actor subclass at import path `path`; ImportError or TypeError naming it otherwise."""
    cls = import_object(path)
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise TypeError(f"{path} is not an Actor subclass")
    return cls


async def report_crash(head: ActorRef | None, spec: dict[str, Any], tb: str) -> None:
    """Log the traceback and hand it to the head (at most 2 s): `spec` names the actor and its
    incarnation (the runtime's spawn spec, or the same two keys). Cancelled: the log line is
    written; the head may not get the traceback and reports the exit code alone."""
    log.error("actor %s crashed:\n%s", spec["name"], tb)
    if head is None:
        return
    with anyio.move_on_after(2.0):
        try:
            await head.call(CRASHED, Crashed(spec["name"], os.getpid(), spec.get("incarnation", 0), tb),
                            timeout_s=2.0)
        except Exception:
            pass
