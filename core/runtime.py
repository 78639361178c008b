"""The actor process's runtime: from the process's first instruction to its exit.

The supervisor spawns `run_actor_process(spec)` (core/lifecycle.py); the process makes itself a
process group (so that the head's terminal Ctrl-C goes to the head alone, and a kill of the
group takes the actor's own children, nsjail workers included), pins itself to its CPU cores
(core/affinity.py), binds its inbox (core/inbox.py: one task decodes frames into the handlers,
one sends), runs the actor's `setup()`, then tells the head READY. It sends a heartbeat every
`heartbeat_interval_s` with its `load()` (a `Load`, core/load.py). A STOP message runs
`teardown()` and exits 0; an exception in setup or in the runtime is reported to the head with
its traceback, then the process exits 1. The actor API it runs is core/actor.py's.

Liveness, not progress. While `setup()` runs, heartbeats come from a thread
(`KeepAlive`), so a setup that blocks the event loop for minutes (loading a
large checkpoint) still reports that the process lives, and the head's
`start_timeout_s` limits silence, not the length of the setup; a stopped
(SIGSTOP) or dead process goes silent and is restarted. After READY the
event loop sends the heartbeats, so a loop stuck in a C call counts as hung;
a handler that blocks the loop on purpose wraps that work in
`with self.keep_alive("loading checkpoint"):` (Actor.keep_alive).

An actor never outlives its head: on Linux the process asks the kernel for
SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG, set as the process
starts), and on every system the heartbeat loop exits the process once its
parent pid is no longer the head's (a head killed with SIGKILL cannot stop
its actors; `postrain up --resume` starts a fresh set).

Spawned ahead (`turn`, a multiprocessing Event): the process imports its class, then waits for
its turn before `setup()`. `postrain up` spawns a run's actors at once this way, so their imports
(torch: seconds each) overlap, while each setup still starts after the actors before it in the
config are READY (core/lifecycle.py `spawn_ahead`).

Memory: an actor class with `keeps_freed_memory = True` (a CPU learner) keeps what it frees
for reuse (`keep_freed_memory`), set before the event loop starts any thread.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any, NoReturn

import anyio
import zmq

from . import wire
from .actor_ref import ActorRef
from .actor import Actor, import_actor_class, report_crash
from .affinity import pin_cpus
from .config import Rendezvous
from .control import HEARTBEAT, READY, WHOIS, Heartbeat, Ready, Whois
from .identity import Identities
from .inbox import Inbox
from .load import Load
from .node import Node
from .options import validate_options
from .shm import RUN_TAG_ENV
from .transport import CurveKeys, configure_client

log = logging.getLogger("postrain.core")


def run_actor_process(spec: dict[str, Any], turn: Any = None) -> None:
    """Entry point of an actor process (the supervisor spawns it). `turn`: None, or an Event
    (multiprocessing's) the head sets when this actor's setup may begin; it is awaited after the
    import (a failed import waits too: its crash report then comes when the head awaits it).

    spec keys: name, cls (import path), options, address, head_address (or None),
    head_pid (or None: the parent's death is not watched), incarnation, cpu_ids (or None),
    num_threads, heartbeat_interval_s, keys (or None: this actor's own, core/identity.py), log_path
    (or None: inherit the head's stdout and stderr), rendezvous (or None: a Rendezvous as a dict, for
    a rank of a group) and then group_secret (bytes its ranks prove to each other)."""
    if spec.get("log_path"):
        log_fd = os.open(spec["log_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(log_fd, 0o600)  # the run's user only, also for a log an earlier run made
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {spec['name']} %(levelname)s %(message)s")
    if spec.get("head_pid") is not None:
        _own_process_group()
    _die_with_parent(spec.get("head_pid"))
    backend = "trio"
    # The import (torch, a model library) may take long on a loaded machine: beat meanwhile, so
    # that start_timeout_s limits silence from the spawn on, not the import's length.
    with _beating_while_importing(spec):
        pin_cpus(spec.get("cpu_ids"), spec.get("num_threads"))
        try:
            cls = import_actor_class(spec["cls"])
            backend = cls.backend
        except Exception:
            cls = None
            startup_error: str | None = traceback.format_exc()
        else:
            startup_error = None
        if turn is not None:
            turn.wait()
    if cls is not None and cls.keeps_freed_memory:
        keep_freed_memory()
    options: dict[str, Any] = {"backend": backend}
    if spec.get("run_tag"):  # names this run's shared memory; inherited by the actor's children
        os.environ[RUN_TAG_ENV] = spec["run_tag"]
    if backend == "asyncio":
        options["backend_options"] = {"use_uvloop": True}
    try:
        anyio.run(_actor_main, cls, spec, startup_error, **options)
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    exit_without_teardown_of_modules(0)


def exit_without_teardown_of_modules(status: int) -> NoReturn:
    """Exit with `status` as the interpreter would, less its teardown of modules: torch's costs
    about 0.5 s of CPU in each process (a run's actors all stop at once; every `postrain`
    command ends so). What an exit must still do is done: the threads left running that are not
    daemons are waited for (as at any exit), the atexit handlers run (logging's flush,
    multiprocessing's finalizers, temporary folders, trackers), stdout and stderr are flushed."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


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
    group (core/lifecycle.py) also ends what the actor started (nsjail workers)."""
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


async def _actor_main(cls: type[Actor] | None, spec: dict[str, Any], startup_error: str | None) -> None:
    """The actor process's life: setup, READY, serve until STOP, teardown; a failure is
    reported to the head, then raised. Cancelled: only when the process is ending; the node's
    sockets close and teardown does not run."""
    keys = CurveKeys.from_dict(spec["keys"]) if spec.get("keys") else None
    async with Node(spec["name"], keys) as node:
        head = node.ref(spec["head_address"], "head") if spec.get("head_address") else None
        if keys is not None:   # callers are known by their keys: the head names them (core/identity.py)
            node.identities = Identities(keys.allowed_client_keys, _whois_through(head) if head else None)
        if startup_error is not None:
            await report_crash(head, spec, startup_error)
            raise RuntimeError(startup_error)
        assert cls is not None   # imported: no startup_error
        actor = None
        try:
            inbox_address = spec["address"]
            options = validate_options(cls, spec.get("options") or {})
            actor = cls(spec["name"], options, node, head, inbox_address)
            actor.incarnation = spec.get("incarnation", 0)
            if spec.get("rendezvous"):
                actor.rendezvous = Rendezvous.model_validate(spec["rendezvous"])
                actor.group_secret = spec.get("group_secret")
            if "torch" in sys.modules and spec.get("num_threads"):
                sys.modules["torch"].set_num_threads(spec["num_threads"])
            inbox = Inbox(node, inbox_address, actor.handlers())
            actor.inbox = inbox
            actor.address = inbox.bound_address
            if head is not None:
                actor.keep_alive_factory = lambda: KeepAlive(spec, keys, lambda: actor.progress_note)
            with actor.keep_alive("setup"):  # setup may block the loop (a model load): see the module doc
                await actor.setup()
            actor.progress_note = ""
        except Exception:
            await report_crash(head, spec, traceback.format_exc())
            raise
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(inbox.serve)
                if head is not None:
                    await head.call(READY, Ready(spec["name"], os.getpid(), inbox.bound_address,
                                                 incarnation=spec.get("incarnation", 0)))
                    tg.start_soon(_heartbeat, actor, head, spec)
                await actor.wait_for_stop()
                tg.cancel_scope.cancel()
            await actor.teardown()
        except Exception:
            await report_crash(head, spec, traceback.format_exc())
            raise


def _whois_through(head: ActorRef) -> Callable[[bytes], Awaitable[str | None]]:
    """whois(key) for Identities: ask the head (this node's supervisor) whose key it is."""
    async def whois(public: bytes) -> str | None:
        return (await head.call(WHOIS, Whois(public.decode()), timeout_s=10.0)).name
    return whois


async def _heartbeat(actor: Actor, head: ActorRef, spec: dict[str, Any]) -> None:
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
            await head.send(HEARTBEAT, Heartbeat(actor.name, os.getpid(), spec.get("incarnation", 0), load,
                                                 actor.progress_note), timeout_s=interval_s)
        except Exception as exc:  # the head may be restarting; keep serving
            log.debug("heartbeat to head failed: %s", exc)
        await anyio.sleep(interval_s)


def _beating_while_importing(spec: dict[str, Any]) -> AbstractContextManager[Any]:
    """KeepAlive for the process's start before its event loop (no head: no beats)."""
    if not spec.get("head_address"):
        return contextlib.nullcontext()
    keys = CurveKeys.from_dict(spec["keys"]) if spec.get("keys") else None
    return KeepAlive(spec, keys, lambda: "importing " + spec["cls"].partition(":")[0])


class KeepAlive:
    """A thread that sends the head heartbeats (without a load: the loop may be blocked, or not
    started yet, so the actor's state is not read) every heartbeat interval, from its own
    socket, while the event loop is busy on purpose or before it runs. Use as a context manager
    (Actor.keep_alive does). `note()` says what the process is doing, read at each beat.
    Invariant: the thread runs only between __enter__ and __exit__."""

    def __init__(self, spec: dict[str, Any], keys: CurveKeys | None, note: Callable[[], str]):
        self.name = spec["name"]
        self.note = note
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

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def _beat(self) -> None:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()   # pyzmq types it Context[Never]
        sock = context.socket(zmq.DEALER)
        sock.linger = 0
        sock.sndhwm = 4  # a head that does not read gets a few, not a backlog
        try:
            configure_client(sock, self.address, self.keys)
            sock.connect(self.address)
            while True:
                _exit_if_orphaned(self.head_pid)
                beat = Heartbeat(self.name, os.getpid(), self.incarnation, note=self.note())
                try:
                    sock.send_multipart(wire.encode(wire.Message(HEARTBEAT.name, 0, 0, self.name, None,
                                                                 HEARTBEAT.encode_request(beat))), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass  # not connected yet, or the head is behind: the next beat tries again
                if self._done.wait(self.interval_s):
                    return
        except zmq.ZMQError as exc:  # a closed context (the process ends): nothing to report to
            log.debug("keep-alive heartbeats stopped: %s", exc)
        finally:
            sock.close(linger=0)
