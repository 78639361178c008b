"""A verifiers `vf.Env` whose `run(task, agents)` writes the other side of the conversation (the
environment's next turn) in Python, played as a postrain episode: the task option `env` names
the `vf.Env` subclass, `policy_agent` (default "assistant") the agent postrain's model plays.

Design: the env's `run` is asyncio code that calls the model (`await chat.turn(message)`);
postrain's episode is trio code that calls the environment (`reset`, `step`). `Relay` turns one
into the other: `run` goes on in its own thread with its own asyncio loop, and each
`turn(message)` it makes becomes the episode's next observation (`message`), waiting until
`step` hands back the model's reply. The env's agents are postrain's model alone: `run` reaching
for another agent (a simulated user is a model behind verifiers' harness) fails the episode with
the agent's name. Only `Env.run` is used: the env object is made without `Env.__init__` (which
loads verifiers' harnesses and taskset by id), with its config class's defaults.

Protocol, one event at a time on `events` (a thread-safe queue): ("turn", message) when `run`
asks the model, then `run` waits for `reply`; ("end", None) when `run` returned; ("error", text)
when it raised. Invariant: at most one turn is pending (`pending` is its future) and the episode
side reads `events` only while none is.
"""
from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from typing import Any

import trio

from postrain.core import import_object

from ..env.api import EnvironmentContractError, TaskOptionsError


def load_env_class(path: str) -> type:
    """The `vf.Env` subclass at `path`; TaskOptionsError names a bad one."""
    import verifiers.v1 as vf
    try:
        obj = import_object(path)
    except ImportError as exc:
        raise TaskOptionsError(f"cannot load the verifiers env {path!r}: {exc}; fix: check the import "
                               f"path") from None
    if not (isinstance(obj, type) and issubclass(obj, vf.Env)):
        raise TaskOptionsError(f"{path!r} is a {type(obj).__name__}, not a verifiers.v1.Env subclass; fix: "
                               f"point at the class whose run(task, agents) plays an episode")
    return obj


def make_env(env_class: type):
    """An instance of `env_class` for its `run` alone, configured with its config class's defaults."""
    import verifiers.v1 as vf
    from verifiers.v1.utils.generic import concrete_type
    env: Any = object.__new__(env_class)   # an Env (verifiers is untyped here)
    env.config = (concrete_type(env_class, vf.EnvConfig, origin=vf.Env) or vf.EnvConfig)()
    return env


class Relay:
    """One episode's bridge to a running `Env.run` (see the module docstring)."""

    def __init__(self, env_class: type, task, policy_agent: str) -> None:
        self.env = make_env(env_class)
        self.task = task               # the task `run` opened the policy's interaction with
        self.policy_agent = policy_agent
        self.events: queue.Queue = queue.Queue()
        self.pending: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None
        self.closed = False            # the episode is over: every later turn of `run` is terminated

    def start(self, task) -> None:
        """Run `env.run(task, agents)` in its own daemon thread (it ends when `run` does)."""
        def main():
            try:
                asyncio.run(self.env.run(task, _Agents(self)))
                self.events.put(("end", None))
            except Exception as exc:  # noqa: BLE001 - the env's run may raise anything: it fails the episode
                reason = f"the verifiers env's run raised {type(exc).__name__}: {exc}"
                self.events.put(("error", reason[:300]))
        threading.Thread(target=main, name="verifiers-env-run", daemon=True).start()

    async def next_event(self, timeout_s: float) -> tuple[str, str | None]:
        """The next ("turn", message) or ("end", None); raises what `run` raised, or on a hang.
        Cancellation: no event; the run goes on waiting (`close` releases it)."""
        try:
            with trio.fail_after(timeout_s):
                kind, value = await trio.to_thread.run_sync(self.events.get, abandon_on_cancel=True)
        except trio.TooSlowError:
            raise RuntimeError(f"the verifiers env's run did not reach its next turn within {timeout_s} "
                               f"s") from None
        if kind == "error":
            raise RuntimeError(value)
        return kind, value

    def close(self) -> None:
        """The episode is over: the pending turn and every later one come back terminated."""
        self.closed = True
        self.reply(None)

    def reply(self, text: str | None) -> None:
        """Answer the pending turn (None: the model has no more turns; `run` sees a terminated segment)."""
        if self.pending is not None:
            loop, future = self.pending
            self.pending = None
            def settle() -> None:
                if not future.done():
                    future.set_result(text)
            loop.call_soon_threadsafe(settle)

    async def ask(self, message) -> str | None:
        """(In `run`'s loop) send `message` to the model; its reply, or None when it has no more turns."""
        from verifiers.v1.types import content_text
        if message is not None and not isinstance(message, str):
            message = "\n\n".join(content_text(m.content) for m in message)
        if self.closed:
            return None
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.pending = (loop, future)
        self.events.put(("turn", message))
        return await future


class _Interaction:
    def __init__(self, relay: Relay) -> None:
        self.relay = relay

    async def turn(self, message=None):
        from verifiers.v1 import AssistantMessage
        from verifiers.v1.agent import Segment
        reply = await self.relay.ask(message)
        if reply is None:
            return Segment(messages=[], terminated=True)
        return Segment(messages=[AssistantMessage(content=reply)])


class _Agent:
    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.trainable = True

    @contextlib.asynccontextmanager
    async def interaction(self, task):
        self.relay.task = task
        yield _Interaction(self.relay)


class _Agents:
    def __init__(self, relay: Relay) -> None:
        self._relay = relay
        self._policy = _Agent(relay)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if name != self._relay.policy_agent:
            raise EnvironmentContractError(
                f"the verifiers env's run asked for agent {name!r}, but postrain plays only its model as "
                f"{self._relay.policy_agent!r} (another agent, such as a simulated user, is a model behind "
                f"verifiers' harness); fix: write that side's turns in run(), or set policy_agent")
        return self._policy
