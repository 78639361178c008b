"""Actors: one OS process, one event loop, one inbox, one handler per message kind.

    from postrain.core import Actor, handler

    class Counter(Actor):
        Options = CounterOptions          # its validated options (core/options.py): self.options

        async def setup(self):            # runs before READY
            self.total = 0

        @handler("add")                   # request/reply: the return value is the reply
        async def add(self, body):
            self.total += body["n"]
            return self.total

        @handler("count", stream=True)    # a stream of replies
        async def count(self, body):
            for i in range(body["n"]):
                yield i

Handlers run one at a time in arrival order unless declared
`concurrent=True`. A handler that also wants the envelope (sender,
policy_version) declares a second parameter: `async def h(self, body, msg)`.
An actor runs on trio by default; set `backend = "asyncio"` on the class to
run on asyncio with uvloop (for libraries that need asyncio); the message
layer is the same under both.

The process lifecycle: the supervisor spawns `run_actor_process(spec)`; the
process makes itself a process group (so that the head's terminal Ctrl-C goes
to the head alone, and a kill of the group takes the actor's own children,
nsjail workers included), pins itself to its CPU cores, binds its inbox, runs
`setup()`, then tells the head READY. It sends a heartbeat every
`heartbeat_interval_s` with its `load()` (a `Load`, core/load.py). A STOP
message runs `teardown()` and exits 0; an exception in setup or in the
runtime is reported to the head with its traceback, then the process exits 1.

Liveness, not progress. While `setup()` runs, heartbeats come from a thread
(`KeepAlive`), so a setup that blocks the event loop for minutes (loading a
large checkpoint) still reports that the process lives, and the head's
`start_timeout_s` limits silence, not the length of the setup; a stopped
(SIGSTOP) or dead process goes silent and is restarted. After READY the
event loop sends the heartbeats, so a loop stuck in a C call counts as hung;
a handler that blocks the loop on purpose wraps that work in
`with self.keep_alive("loading checkpoint"):`. `report_progress(note)` puts
a short note on the heartbeats (`postrain status` shows it).

Cores that move (elastic cores, core/elastic.py). The head may re-pin a running actor with
the kernel message `_cores` {"cpu_ids", "num_threads"}: every thread of the process is
pinned to the new cores before the reply, and `num_threads` becomes the torch thread count
of the compute that `in_compute_thread` starts from then on (torch keeps one count per
thread, so the count is set in the thread that computes, at the start of each call; a long
computation may take up a new count midway by calling `apply_num_threads` at safe points).

An actor never outlives its head: on Linux the process asks the kernel for
SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG, set as the process
starts), and on every system the heartbeat loop exits the process once its
parent pid is no longer the head's (a head killed with SIGKILL cannot stop
its actors; `postrain up --resume` starts a fresh set).
"""
from __future__ import annotations

import ctypes
import importlib
import inspect
import logging
import os
import signal
import sys
import threading
import traceback
from contextlib import contextmanager, nullcontext
from typing import Callable, ClassVar

import anyio
import zmq

from . import wire
from .config import Rendezvous
from .inbox import Handler, Inbox
from .load import Load
from .node import Node
from .options import NoOptions, Options, validate_options
from .transport import CurveKeys, configure_client

log = logging.getLogger("postrain.core")


def handler(kind: str | None = None, *, stream: bool = False, concurrent: bool = False):
    """Declare an actor method as the handler of message `kind` (default: the method's name)."""
    def mark(fn):
        if not inspect.iscoroutinefunction(fn) and not inspect.isasyncgenfunction(fn):
            raise TypeError(f"handler {fn.__name__} must be `async def`")
        if stream != inspect.isasyncgenfunction(fn):
            raise TypeError(f"handler {fn.__name__}: stream=True needs an async generator "
                            "(`yield` items), and an async generator needs stream=True")
        name = kind or fn.__name__
        if name.startswith("_"):
            raise ValueError(f"handler kind {name!r} may not start with '_' (reserved)")
        fn._postrain_handler = (name, stream, concurrent)
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
    keeps_freed_memory: ClassVar[bool] = False   # a CPU learner: see `keep_freed_memory`
    _handler_specs: ClassVar[dict[str, tuple[str, bool, bool]]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        specs = dict(cls._handler_specs)
        for attr, value in vars(cls).items():
            marked = getattr(value, "_postrain_handler", None)
            if marked is not None:
                specs[marked[0]] = (attr, marked[1], marked[2])
        cls._handler_specs = specs
        if cls.backend not in ("trio", "asyncio"):
            raise ValueError(f"{cls.__name__}.backend must be 'trio' or 'asyncio', got {cls.backend!r}")

    def __init__(self, name: str, options: Options, node: Node, head, address: str):
        self.name = name
        self.options = options
        self.node = node
        self.head = head
        self.address = address
        self.inbox: Inbox | None = None
        self._stop_requested = anyio.Event()
        self.progress_note = ""            # what the heartbeats say the actor is doing ("" once READY)
        self._keep_alive: Callable[[], "KeepAlive"] | None = None  # set by the process's runtime
        self.num_threads: int | None = None  # torch threads for in_compute_thread; None: as started
        self._incarnation = 0                  # set by the process's runtime
        # The collective group this process is a rank of (an entry with ranks > 1), else None.
        self.rendezvous: Rendezvous | None = None

    async def crash(self, reason: str) -> None:
        """End this process now as a crash: `reason` is logged and handed to the head (the exit
        event shows it, as a traceback would), then the process exits 1 and its supervisor
        restarts it under `max_restarts`. For a fault the actor cannot mend in place (a broken
        collective group). Does not return; requests in flight fail with ActorDiedError."""
        await _report_crash(self.head, {"name": self.name, "incarnation": self._incarnation}, reason)
        logging.shutdown()
        os._exit(1)

    def report_progress(self, note: str) -> None:
        """Say what the actor is doing now ("loading shard 3/8"); the next heartbeat carries it
        to the head (`postrain status`). Not needed to stay alive: heartbeats do that."""
        self.progress_note = note

    @contextmanager
    def keep_alive(self, note: str = ""):
        """Heartbeat from a thread for the body of the `with`, which blocks the event loop on
        purpose (a synchronous checkpoint load in a handler), so that the head does not count
        the actor as hung. The body still runs in the loop's thread; only liveness moves."""
        if note:
            self.report_progress(note)
        with (self._keep_alive() if self._keep_alive is not None else nullcontext()):
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

    async def lookup(self, name: str, timeout_s: float = 10.0):
        """An ActorRef to the actor called `name`, by asking the head's registry. Cancelled:
        nothing is left behind (no reference is made until the head answers)."""
        if self.head is None:
            raise LookupError(f"cannot look up {name!r}: this actor runs without a head")
        found = await self.head.ask("lookup", {"name": name}, timeout_s=timeout_s)
        return self.node.ref(found["address"], name, same_node=found["same_node"])

    def handlers(self) -> dict[str, Handler]:
        table = {}
        for kind, (attr, stream, concurrent) in self._handler_specs.items():
            fn = getattr(self, attr)
            num_params = len(inspect.signature(fn).parameters)
            table[kind] = Handler(fn, stream=stream, concurrent=concurrent,
                                  wants_message=num_params >= 2)
        table[wire.STOP] = Handler(self._handle_stop)
        table[wire.PEERS_MOVED] = Handler(self._handle_peers_moved)
        table[wire.PEERS_GONE] = Handler(self._handle_peers_gone)
        table[CORES] = Handler(self._handle_cores)
        return table

    async def _handle_peers_moved(self, body) -> None:
        """{name: {"address", "same_node"}} of actors started again elsewhere (a cluster node was
        lost; `same_node`: on this actor's node): this process's references to them point there
        from now on (Node.rebind). Does not wait (cancel-safe)."""
        for name, moved in body.items():
            if self.node.rebind(name, moved["address"], same_node=moved["same_node"]):
                log.info("actor %s moved to %s; talking to it there", name, moved["address"])

    async def _handle_peers_gone(self, body) -> None:
        """{name: reason} of actors gone for good (a cluster node was lost with them and they fit
        on no node left): `on_peers_gone` first, so the actor stops choosing them, then this
        process's references to them are closed (their requests fail with ActorDiedError, and
        the callers' retry rules apply). Does not wait (cancel-safe)."""
        self.on_peers_gone(dict(body))
        for name, reason in body.items():
            if self.node.close_refs(name):
                log.info("actor %s is gone for good (%s); its references are closed", name, reason)

    def on_peers_gone(self, gone: dict[str, str]) -> None:
        """Override to stop using actors gone for good ({name: reason}); it must not block.
        The default does nothing: a reference to one of them fails with ActorDiedError."""

    async def _handle_stop(self, body) -> str:
        """Ask the process to stop (teardown, then exit 0). Does not wait, so a cancellation
        finds it done."""
        self._stop_requested.set()
        return "stopping"

    async def _handle_cores(self, body) -> dict:
        """Re-pin every thread to body["cpu_ids"]; later compute uses body["num_threads"]
        threads (module doc). Atomic (it never awaits): the reply means the pin is in place."""
        cpu_ids, num_threads = [int(c) for c in body["cpu_ids"]], int(body["num_threads"])
        if not cpu_ids or num_threads < 1:
            raise ValueError(f"_cores needs cpu_ids and num_threads >= 1, got {body!r}")
        pin_threads(cpu_ids)
        self.num_threads = num_threads
        return {"cpu_ids": sorted(os.sched_getaffinity(0)), "num_threads": num_threads}

    async def in_compute_thread(self, fn: Callable, *args):
        """`fn(*args)` in a worker thread whose torch thread count is this actor's now (elastic
        cores change it between calls). Cancelled: `fn` still runs to its end in its thread;
        its result is dropped."""
        def call():
            self.apply_num_threads()
            return fn(*args)
        return await anyio.to_thread.run_sync(call)

    def apply_num_threads(self) -> None:
        """Set torch's thread count in the calling thread to this actor's current one (module
        doc): in_compute_thread calls it first; a long step may call it between its parts."""
        num_threads = self.num_threads
        if num_threads and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(num_threads)


def import_object(path: str):
    """'package.module:Name' -> the object: the one loader of import paths in configs (actor
    classes, and whatever else a config names by path). Raises ImportError naming the path."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ImportError(f"import path {path!r} must look like 'package.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"cannot import {module_name} (from {path!r}): {exc}") from exc
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


def run_actor_process(spec: dict) -> None:
    """Entry point of an actor process (the supervisor spawns it).

    spec keys: name, cls (import path), options, address, head_address (or None),
    head_pid (or None: the parent's death is not watched), incarnation, cpu_ids (or None),
    num_threads, heartbeat_interval_s, keys (or None), log_path (or None: inherit the head's
    stdout and stderr), rendezvous (or None: a Rendezvous as a dict, for a rank of a group)."""
    if spec.get("log_path"):
        log_fd = os.open(spec["log_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {spec['name']} %(levelname)s %(message)s")
    if spec.get("head_pid") is not None:
        _own_process_group()
    _die_with_parent(spec.get("head_pid"))
    _pin_cpus(spec.get("cpu_ids"), spec.get("num_threads"))
    backend = "trio"
    try:
        cls = import_actor_class(spec["cls"])
        backend = cls.backend
    except Exception:
        cls = None
        startup_error = traceback.format_exc()
    else:
        startup_error = None
    if cls is not None and cls.keeps_freed_memory:
        keep_freed_memory()
    options = {"backend": backend}
    if spec.get("run_tag"):  # names this run's shared memory; inherited by the actor's children
        os.environ[wire.RUN_TAG_ENV] = spec["run_tag"]
    if backend == "asyncio":
        options["backend_options"] = {"use_uvloop": True}
    try:
        anyio.run(_actor_main, cls, spec, startup_error, **options)
    except BaseException:
        traceback.print_exc()
        sys.exit(1)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # <malloc.h>


def keep_freed_memory() -> None:
    """Keep freed memory in the process for reuse (glibc; elsewhere a no-op), for an actor whose
    steps allocate and free the same large tensors over and over (a CPU learner: each
    (vocab x hidden) gradient is 113 MiB on SmolLM2). glibc maps each block over 32 MiB
    fresh and unmaps it when freed, so every step faults in every page of it again (60 ms per
    such block here); with one arena, no mmap and no trimming, a freed block is reused as it is.
    The process then holds its peak memory until it exits. Called before the event loop starts
    any thread: a thread that already has an arena of its own keeps it (and maps large blocks)."""
    try:
        libc = ctypes.CDLL(None)
        ok = all(libc.mallopt(param, value) == 1 for param, value in (
            (M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1)))
    except (AttributeError, OSError):
        ok = False
    if not ok:
        log.info("this C library does not take glibc's mallopt; freed memory goes back as it likes")


def _own_process_group() -> None:
    """Lead a new process group: the terminal's SIGINT (sent to the head's foreground group)
    no longer reaches the actor, whose stop the head orders; and the supervisor's kill of the
    group (core/supervisor.py) also ends what the actor started (nsjail workers)."""
    try:
        os.setpgid(0, 0)
    except OSError as exc:
        log.warning("could not start a process group (%s); a kill reaches this process alone", exc)


def _die_with_parent(head_pid: int | None) -> None:
    """Ask the kernel to SIGKILL this process when its parent (the head) dies, then check that
    the head did not die before we asked. The signal follows the parent *thread* that spawned
    us: the supervisor spawns from its event loop's thread, which lives as long as the head."""
    if head_pid is None:
        return
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
                log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d); the heartbeat loop watches "
                            "the head instead", ctypes.get_errno())
        except (OSError, AttributeError) as exc:
            log.warning("prctl unavailable (%s); the heartbeat loop watches the head instead", exc)
    _exit_if_orphaned(head_pid)


def _exit_if_orphaned(head_pid: int | None) -> None:
    if head_pid is not None and os.getppid() != head_pid:
        log.error("the head (pid %d) is gone; exiting rather than running as an orphan", head_pid)
        os._exit(1)


CORES = "_cores"  # the head re-pins an actor (elastic cores): {"cpu_ids", "num_threads"}


def pin_threads(cpu_ids) -> None:
    """Pin every thread of this process to `cpu_ids` (sched_setaffinity(0) pins only the
    calling thread). A thread started meanwhile inherits its creator's cores, so the pass is
    repeated until no new thread appears."""
    done: set[int] = set()
    while True:
        tids = {int(tid) for tid in os.listdir("/proc/self/task")} - done
        if not tids:
            return
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpu_ids)
            except ProcessLookupError:  # the thread ended meanwhile
                pass
        done |= tids


def _pin_cpus(cpu_ids, num_threads) -> None:
    if cpu_ids:
        try:
            os.sched_setaffinity(0, cpu_ids)
        except (AttributeError, OSError) as exc:
            log.warning("could not pin to cores %s: %s", cpu_ids, exc)
    if num_threads:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ[var] = str(num_threads)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(num_threads)


async def _actor_main(cls, spec: dict, startup_error: str | None) -> None:
    """The actor process's life: setup, READY, serve until STOP, teardown; a failure is
    reported to the head, then raised. Cancelled: only when the process is ending; the node's
    sockets close and teardown does not run."""
    keys = CurveKeys.from_dict(spec["keys"]) if spec.get("keys") else None
    async with Node(spec["name"], keys) as node:
        head = node.ref(spec["head_address"], "head") if spec.get("head_address") else None
        if startup_error is not None:
            await _report_crash(head, spec, startup_error)
            raise RuntimeError(startup_error)
        actor = None
        try:
            inbox_address = spec["address"]
            options = validate_options(cls, spec.get("options") or {})
            actor = cls(spec["name"], options, node, head, inbox_address)
            actor._incarnation = spec.get("incarnation", 0)
            if spec.get("rendezvous"):
                actor.rendezvous = Rendezvous.model_validate(spec["rendezvous"])
            if "torch" in sys.modules and spec.get("num_threads"):
                sys.modules["torch"].set_num_threads(spec["num_threads"])
            inbox = Inbox(node, inbox_address, actor.handlers())
            actor.inbox = inbox
            actor.address = inbox.bound_address
            if head is not None:
                actor._keep_alive = lambda: KeepAlive(actor, spec, keys)
            with actor.keep_alive("setup"):  # setup may block the loop (a model load): see the module doc
                await actor.setup()
            actor.progress_note = ""
        except Exception:
            await _report_crash(head, spec, traceback.format_exc())
            raise
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(inbox.serve)
                if head is not None:
                    await head.ask("_ready", {"name": spec["name"], "pid": os.getpid(),
                                               "address": inbox.bound_address,
                                               "incarnation": spec.get("incarnation", 0)})
                    tg.start_soon(_heartbeat, actor, head, spec)
                await actor._stop_requested.wait()
                tg.cancel_scope.cancel()
            await actor.teardown()
        except Exception:
            await _report_crash(head, spec, traceback.format_exc())
            raise


async def _heartbeat(actor: Actor, head, spec: dict) -> None:
    """Tell the head this actor lives, with its load, every interval. Cancelled (the actor
    stops): a heartbeat is queued whole or not at all (ZeroMQ sends are atomic); they stop."""
    interval_s = spec.get("heartbeat_interval_s", 1.0)
    while True:
        _exit_if_orphaned(spec.get("head_pid"))
        load = actor.load()
        if not isinstance(load, Load):  # a bug in the actor: fail it loudly, not the head's view
            raise TypeError(f"{type(actor).__name__}.load() must return a postrain.core.Load, got "
                            f"{type(load).__name__}; fix: return super().load().replace(...)")
        try:
            await head.tell("_heartbeat", {"name": actor.name, "pid": os.getpid(),
                                           "incarnation": spec.get("incarnation", 0),
                                           "load": load.to_wire(), "note": actor.progress_note},
                            timeout_s=interval_s)
        except Exception as exc:  # the head may be restarting; keep serving
            log.debug("heartbeat to head failed: %s", exc)
        await anyio.sleep(interval_s)


class KeepAlive:
    """A thread that sends the head heartbeats (without a load: the loop may be blocked, so the
    actor's state is not read) every heartbeat interval, from its own socket, while the
    event loop is busy on purpose. Use as a context manager (Actor.keep_alive does).
    Invariant: the thread runs only between __enter__ and __exit__."""

    def __init__(self, actor: Actor, spec: dict, keys: CurveKeys | None):
        self.actor = actor
        self.address = spec["head_address"]
        self.head_pid = spec.get("head_pid")
        self.incarnation = spec.get("incarnation", 0)
        self.interval_s = spec.get("heartbeat_interval_s", 1.0)
        self.keys = keys
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="postrain-keepalive", daemon=True)

    def __enter__(self) -> "KeepAlive":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def _beat(self) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        sock.sndhwm = 4  # a head that does not read gets a few, not a backlog
        try:
            configure_client(sock, self.address, self.keys)
            sock.connect(self.address)
            while True:
                _exit_if_orphaned(self.head_pid)
                body = {"name": self.actor.name, "pid": os.getpid(), "incarnation": self.incarnation,
                        "load": None, "note": self.actor.progress_note}
                try:
                    sock.send_multipart(wire.encode(wire.Message("_heartbeat", 0, 0, self.actor.name,
                                                                 None, body)), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass  # not connected yet, or the head is behind: the next beat tries again
                if self._done.wait(self.interval_s):
                    return
        except zmq.ZMQError as exc:  # a closed context (the process ends): nothing to report to
            log.debug("keep-alive heartbeats stopped: %s", exc)
        finally:
            sock.close(linger=0)


async def _report_crash(head, spec: dict, tb: str) -> None:
    """Log the traceback and hand it to the head (at most 2 s). Cancelled: the log line is
    written; the head may not get the traceback and reports the exit code alone."""
    log.error("actor %s crashed:\n%s", spec["name"], tb)
    if head is None:
        return
    with anyio.move_on_after(2.0):
        try:
            await head.ask("_crashed", {"name": spec["name"], "pid": os.getpid(),
                                        "incarnation": spec.get("incarnation", 0), "traceback": tb},
                           timeout_s=2.0)
        except Exception:
            pass
