"""Helpers for tests and benchmarks: small actors (echo, streams, crashes, hangs, a pool, a slow
setup), `async_test`, which runs an async test function on trio, and `leftovers` /
`assert_nothing_left`, which say what a run left behind (processes, shared memory)."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, ParamSpec, TypeVar

import anyio
from pydantic import Field

from . import shm
from .actor import Actor, handler
from .actor_ref import ActorRef
from .errors import ActorDiedError
from .load import RESIZE, Load, ResizeReply, ResizeRequest
from .messages import MessageKind
from .options import Options
from .wire import Message

_P = ParamSpec("_P")
_T = TypeVar("_T")


def async_test(fn: Callable[_P, Awaitable[_T]]) -> Callable[_P, _T]:
    """Decorate an `async def` test so pytest runs it on trio (the actors' default loop)."""
    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        return anyio.run(functools.partial(fn, *args, **kwargs), backend="trio")
    return wrapper


@dataclass
class Leftovers:
    """What a run left behind. processes: "PID COMMAND" of each live process started under the run
    (its actors and their children: nsjail workers, ...); segments: its shared-memory files."""

    processes: list[str] = field(default_factory=list)
    segments: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.processes or self.segments)


def leftovers(run_tag: str) -> Leftovers:
    """The live processes whose environment carries run `run_tag` (every actor the supervisor
    started, and what they started, inherit it: core/lifecycle.py) and the run's shared-memory
    files in /dev/shm (core/shm.py). For a `postrain up` run: `run_tag_for(str(run_folder))`
    (postrain.core.supervisor), with the folder's resolved path."""
    marker = f"{shm.RUN_TAG_ENV}={run_tag}".encode()
    found = Leftovers(segments=sorted(path for path, _ in shm.shm_segments(run_tag)))
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone, or not ours to read
            continue
        if marker in environ and shm.process_lives(int(entry)):
            found.processes.append(f"{entry} {command[:120]}")
    return found


def assert_nothing_left(run_tag: str, timeout_s: float = 10.0) -> None:
    """Wait (at most timeout_s: killed processes take a moment to go) until run `run_tag` left
    no process and no shared-memory file; AssertionError listing them otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = leftovers(run_tag)
        if not left:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"run {run_tag} left {len(left.processes)} processes and "
                                 f"{len(left.segments)} shared-memory files: {left}")
        time.sleep(0.1)


# The test actors' messages: raw bodies (UNTYPED), the kernel's own tests of its wire and lifecycle.
ASK_PEER = MessageKind("ask_peer")
BLOCK_ALIVE = MessageKind("block_alive")
COMPUTE_THREADS = MessageKind("compute_threads")
COUNT = MessageKind("count", stream=True)
ECHO = MessageKind("echo")
ENVIRON = MessageKind("environ")
FAIL = MessageKind("fail")
HANG = MessageKind("hang")
LEAVE_SHM = MessageKind("leave_shm")
LOOP = MessageKind("loop")
NBYTES = MessageKind("nbytes")
NUM_TOLD = MessageKind("num_told")
PID = MessageKind("pid")
PINNED = MessageKind("pinned")
RUN = MessageKind("run", stream=True)
SLEEP = MessageKind("sleep")
SPAWN_CHILD = MessageKind("spawn_child")
STOP_RUN = MessageKind("stop")
SUM_ARRAY = MessageKind("sum_array")
TOLD = MessageKind("told")
WHOAMI = MessageKind("whoami")


class EchoOptions(Options):
    fail_setup: bool = Field(False, description="raise in setup (a start that fails)")
    setup_s: float = Field(0.0, ge=0, description="block the event loop this long in setup, seconds "
                           "(a slow model load)")


class EchoActor(Actor):
    """Replies with what it gets; the building block of tests and the messaging bench."""

    Options = EchoOptions
    options: EchoOptions

    async def setup(self) -> None:
        """Fails on purpose with `fail_setup`. Does not wait (cancel-safe)."""
        if self.options.fail_setup:
            raise RuntimeError("setup failed on purpose (options.fail_setup)")
        if self.options.setup_s:
            import time
            self.report_progress(f"loading for {self.options.setup_s} s")
            time.sleep(self.options.setup_s)  # blocks the loop, as a synchronous model load does
        self.num_told = 0
        self.children: list[subprocess.Popen[bytes]] = []

    @handler(ECHO)
    async def echo(self, body: Any) -> Any:
        """The body back. Does not wait (cancel-safe)."""
        return body

    @handler(WHOAMI)
    async def whoami(self, body: Any, msg: Message) -> dict[str, Any]:
        """What this actor holds and who called: {"identity", "client_public", "server_public" (its
        inbox's), "bulk_key" (held?), "seed" (held?), "caller" (the message's sender, checked
        against its key on Curve)}."""
        keys = self.node.keys
        return {"identity": keys.identity if keys else None,
                "client_public": keys.client_public.decode() if keys else None,
                "server_public": keys.server_public.decode() if keys else None,
                "bulk_key": bool(keys and keys.bulk_key), "seed": bool(keys and keys.identity_seed),
                "caller": msg.sender}

    @handler(ASK_PEER)
    async def ask_peer(self, body: Any) -> Any:
        """Look actor body["name"] up and ask it `whoami`; its answer. Cancelled: as `lookup`."""
        peer = await self.lookup(body["name"])
        return await peer.call(WHOAMI, timeout_s=10)

    @handler(ENVIRON)
    async def environ(self, body: Any) -> dict[str, str | None]:
        """{name: value or None} of this process's environment for the names in the body. Does
        not wait (cancel-safe)."""
        return {name: os.environ.get(name) for name in body}

    @handler(PINNED)
    async def pinned(self, body: Any) -> dict[str, Any]:
        """{"cores": the cores of every thread of this process, "num_threads": for compute} after
        starting one thread the first time (so re-pinning must reach threads beyond the loop's).
        Does not wait (cancel-safe)."""
        if not hasattr(self, "idle_thread"):
            import threading
            self.idle_thread = threading.Thread(target=threading.Event().wait, daemon=True)
            self.idle_thread.start()
        cores = {tuple(sorted(os.sched_getaffinity(int(tid)))) for tid in os.listdir("/proc/self/task")}
        return {"cores": sorted(cores), "num_threads": self.num_threads}

    @handler(COMPUTE_THREADS)
    async def compute_threads(self, body: Any) -> int:
        """torch's thread count inside `in_compute_thread` (what a learner step would use).
        Cancelled: the thread finishes; its answer is dropped."""
        import torch
        return await self.in_compute_thread(torch.get_num_threads)

    @handler(SUM_ARRAY)
    async def sum_array(self, body: Any) -> float:
        """The sum of a received array. Does not wait (cancel-safe)."""
        return float(body.sum())

    @handler(NBYTES)
    async def nbytes(self, body: Any) -> int:
        """Size of a received array or tensor (the bulk-transfer bench's handler). Does not
        wait (cancel-safe)."""
        return int(body.nbytes) if hasattr(body, "nbytes") else int(body.numel() * body.element_size())

    @handler(TOLD)
    async def told(self, body: Any) -> None:
        """Count a tell. Does not wait (cancel-safe)."""
        self.num_told += 1

    @handler(NUM_TOLD)
    async def get_num_told(self, body: Any) -> int:
        """How many tells arrived. Does not wait (cancel-safe)."""
        return self.num_told

    @handler(COUNT)
    async def count(self, body: Any) -> AsyncIterator[dict[str, int]]:
        """Stream {"i": 0..n-1}. Cancelled: the stream ends where it was; nothing else changes."""
        for i in range(body["n"]):
            yield {"i": i}

    @handler(SLEEP, concurrent=True)
    async def sleep(self, body: Any) -> str:
        """Sleep `s` seconds, concurrently with other messages. Cancelled: it ends early, unanswered."""
        await anyio.sleep(body["s"])
        return "slept"

    @handler(FAIL)
    async def fail(self, body: Any) -> None:
        """Raise on purpose (the caller gets a RemoteError). Does not wait (cancel-safe)."""
        raise ValueError(f"failed on purpose: {body}")

    @handler(PID)
    async def pid(self, body: Any) -> int:
        """This process's id. Does not wait (cancel-safe)."""
        return os.getpid()

    @handler(SPAWN_CHILD)
    async def spawn_child(self, body: Any) -> int:
        """Start a long `sleep` child (an nsjail worker stands for it) and return its pid. Does not
        wait (cancel-safe)."""
        child = subprocess.Popen(["sleep", "600"])
        self.children.append(child)
        return child.pid

    @handler(LEAVE_SHM)
    async def leave_shm(self, body: Any) -> str:
        """Write `n` bytes to a shared-memory file no one will take, as a tensor sent to a peer
        that died would stay; return its path. Does not wait (cancel-safe)."""
        return shm.write_segment(bytes(body["n"]))

    @handler(BLOCK_ALIVE)
    async def block_alive(self, body: Any) -> str:
        """Block the event loop `s` seconds on purpose inside `keep_alive` (a synchronous
        checkpoint load): the head must not count it as hung. Cannot be cancelled."""
        import time
        with self.keep_alive(f"blocking for {body['s']} s"):
            time.sleep(body["s"])
        return "done"

    @handler(HANG)
    async def hang(self, body: Any) -> str:
        """Blocks the whole event loop (no await), as a stuck C call would. Cannot be
        cancelled: only killing the process ends it early."""
        import time
        time.sleep(body["s"])
        return "woke"


class AsyncioEchoActor(EchoActor):
    """The same actor on asyncio + uvloop."""
    backend = "asyncio"

    @handler(LOOP)
    async def loop(self, body: Any) -> str:
        """The module of the running event loop's class (uvloop's here). Does not wait (cancel-safe)."""
        import asyncio
        return type(asyncio.get_running_loop()).__module__


class WorkDriverEchoActor(EchoActor):
    """An echo actor whose role hands out work (`Actor.drives_work`): the head takes its `work`."""
    drives_work = True


class PoolEchoActor(EchoActor):
    """An echo actor that is a pool as the kernel sees one: its load reports workers, and it
    answers RESIZE (core/load.py) by taking the new count."""

    async def setup(self) -> None:
        """One worker to start with. Does not wait (cancel-safe)."""
        await super().setup()
        self.num_workers = 1

    def load(self) -> Load:
        return super().load().replace(queued=0, running=0, workers=self.num_workers, figures={"note": "mine"})

    @handler(RESIZE)
    async def resize(self, request: ResizeRequest) -> ResizeReply:
        """Take the new worker count. Does not wait (cancel-safe: atomic)."""
        previous, self.num_workers = self.num_workers, request.num_workers
        return ResizeReply(self.num_workers, previous)


class BadLoadActor(EchoActor):
    """An actor whose load() breaks the contract (returns a dict): its heartbeat fails it."""

    def load(self) -> Any:   # Any: it breaks Actor.load's contract on purpose
        return {"in_flight": 0}


PEER_RETRIES = 20   # CountingDriver: asks again of a peer that died with a request in flight


class CountingDriverOptions(Options):
    peer: str = Field(description="the actor it asks to echo")
    steps: int = Field(3, ge=0, description="how many echoes (steps) the run has")
    step_s: float = Field(0.0, ge=0, description="pause after each step, seconds")


class CountingDriver(Actor):
    """A run driver for tests of `postrain up`: asks `options.peer` to echo `options.steps` times,
    streaming a progress line and figures ({"step", "num_steps"}) per step, then a summary; `stop`
    ends it early."""

    Options = CountingDriverOptions
    options: CountingDriverOptions

    async def setup(self) -> None:
        """Not stopping yet. Does not wait (cancel-safe)."""
        self.stopping = False

    @handler(RUN, concurrent=True)  # concurrent: a `stop` must not wait behind the run
    async def run(self, body: Any) -> AsyncIterator[dict[str, Any]]:
        """The echo steps, streamed. Cancelled: the run ends between or during a step; no
        summary is sent, nothing else is left."""
        peer = await self.lookup(self.options.peer)
        steps = 0
        for step in range(self.options.steps):
            if self.stopping:
                break
            assert await self._echo(peer, step) == step
            steps += 1
            yield {"line": f"step {step}"}
            yield {"figures": {"step": steps, "num_steps": self.options.steps}}
            await anyio.sleep(self.options.step_s)
        yield {"summary": {"steps": steps, "num_steps": self.options.steps, "complete": steps == self.options.steps,
                           "run_folder": body["run_folder"]}}

    async def _echo(self, peer: ActorRef, step: int) -> Any:
        """The peer's echo of `step`. As a real driver does, a peer that died with the request in
        flight is asked again once its supervisor has restarted it (a lookup waits for that), up
        to PEER_RETRIES times; the head ends the run meanwhile if the peer cannot come back (a
        lost node). Cancelled: no echo."""
        for _ in range(PEER_RETRIES):
            try:
                return await peer.call(ECHO, step)
            except ActorDiedError:
                await anyio.sleep(0.5)
                peer = await self.lookup(self.options.peer)
        return await peer.call(ECHO, step)

    @handler(STOP_RUN)
    async def stop(self, body: Any) -> None:
        """End the run after the current step. Does not wait (cancel-safe)."""
        self.stopping = True


def counting_run_config(run_dir: str | os.PathLike[str], *, name: str = "t", steps: int = 3, step_s: float = 0,
                        heartbeat_interval_s: float = 0.5) -> str:
    """A run config (TOML text) of an echo actor and a CountingDriver driving it, for `postrain up` tests."""
    return f"""
[run]
name = "{name}"
run_dir = "{run_dir}"
driver = "driver"
[head]
heartbeat_interval_s = {heartbeat_interval_s}
[[actors]]
name = "echo"
cls = "postrain.core.testing:EchoActor"
cpus = 0.25
memory_mb = 0
[[actors]]
name = "driver"
cls = "postrain.core.testing:CountingDriver"
cpus = 0.25
memory_mb = 0
options = {{ peer = "echo", steps = {steps}, step_s = {step_s} }}
"""


def to_toml(doc: dict[str, Any]) -> str:
    """A run config dict as TOML text (tests write configs for `postrain up` with it): top-level
    tables, lists of tables as `[[name]]`, inline tables and arrays below them."""
    def value(v: Any) -> str:
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v)
    out: list[str] = []
    for table, body in doc.items():
        for entry in (body if isinstance(body, list) else [body]):
            out.append(f"[[{table}]]" if isinstance(body, list) else f"[{table}]")
            out += [f"{k} = {value(v)}" for k, v in entry.items()]
            out.append("")
    return "\n".join(out)
