"""Helpers for tests and benchmarks: small actors (echo, streams, crashes, hangs), and
`async_test`, which runs an async test function on trio."""
from __future__ import annotations

import functools
import os

import anyio
from pydantic import Field

from .actor import Actor, handler
from .options import Options


def async_test(fn):
    """Decorate an `async def` test so pytest runs it on trio (the actors' default loop)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return anyio.run(functools.partial(fn, *args, **kwargs), backend="trio")
    return wrapper


class EchoOptions(Options):
    fail_setup: bool = Field(False, description="raise in setup (a start that fails)")


class EchoActor(Actor):
    """Replies with what it gets; the building block of tests and the messaging bench."""

    Options = EchoOptions

    async def setup(self):
        if self.options.fail_setup:
            raise RuntimeError("setup failed on purpose (options.fail_setup)")
        self.num_told = 0

    @handler("echo")
    async def echo(self, body):
        return body

    @handler("sum_array")
    async def sum_array(self, body):
        return float(body.sum())

    @handler("nbytes")
    async def nbytes(self, body):
        """Size of a received array or tensor (the bulk-transfer bench's handler)."""
        return int(body.nbytes) if hasattr(body, "nbytes") else int(body.numel() * body.element_size())

    @handler("told")
    async def told(self, body):
        self.num_told += 1

    @handler("num_told")
    async def get_num_told(self, body):
        return self.num_told

    @handler("count", stream=True)
    async def count(self, body):
        for i in range(body["n"]):
            yield {"i": i}

    @handler("sleep", concurrent=True)
    async def sleep(self, body):
        await anyio.sleep(body["s"])
        return "slept"

    @handler("fail")
    async def fail(self, body):
        raise ValueError(f"failed on purpose: {body}")

    @handler("pid")
    async def pid(self, body):
        return os.getpid()

    @handler("hang")
    async def hang(self, body):
        """Blocks the whole event loop (no await), as a stuck C call would."""
        import time
        time.sleep(body["s"])
        return "woke"


class AsyncioEchoActor(EchoActor):
    """The same actor on asyncio + uvloop."""
    backend = "asyncio"

    @handler("loop")
    async def loop(self, body):
        import asyncio
        return type(asyncio.get_running_loop()).__module__


class CountingDriverOptions(Options):
    peer: str = Field(description="the actor it asks to echo")
    steps: int = Field(3, ge=0, description="how many echoes (steps) the run has")
    step_s: float = Field(0.0, ge=0, description="pause after each step, seconds")


class CountingDriver(Actor):
    """A run driver for tests of `postrain up`: asks `options.peer` to echo `options.steps` times,
    streaming a progress line and figures ({"step", "num_steps"}) per step, then a summary; `stop`
    ends it early."""

    Options = CountingDriverOptions

    async def setup(self):
        self.stopping = False

    @handler("run", stream=True)
    async def run(self, body):
        peer = await self.lookup(self.options.peer)
        steps = 0
        for step in range(self.options.steps):
            if self.stopping:
                break
            assert await peer.ask("echo", step) == step
            steps += 1
            yield {"line": f"step {step}"}
            yield {"figures": {"step": steps, "num_steps": self.options.steps}}
            await anyio.sleep(self.options.step_s)
        yield {"summary": {"steps": steps, "run_folder": body["run_folder"]}}

    @handler("stop")
    async def stop(self, body):
        self.stopping = True


def counting_run_config(run_dir, *, name: str = "t", steps: int = 3, step_s: float = 0,
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
