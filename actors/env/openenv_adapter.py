"""OpenEnv environments (`pip install openenv-core`) as postrain tasks, with their own rewards.

    [shared]
    task = "postrain.actors.env.openenv_adapter:OpenEnvEnvironment"
    task_options = { app = "my_env.server.app:app", action_field = "message", max_turns = 4 }

An OpenEnv environment is an HTTP/WebSocket server (`openenv.core.env_server.create_app`).
With `app` (an import path of that ASGI app), the first episode in a process starts it as a
local process (`python -m uvicorn MODULE:APP` on a free loopback port; stopped when the
process exits); with `base_url`, the episodes use a server that runs already (one in a
sandbox, for an environment that runs untrusted code, or a remote one). Each episode is its
own OpenEnv session (a WebSocket at `/ws`, spoken as OpenEnv's `EnvClient` speaks it, without
importing the package here: `openenv.core` imports gradio, seconds per process): `reset(seed=...)` gives the first
observation, each assistant turn is sent as the action `{action_field: text}`, and the
server's `reward` of each step is the Reward component `openenv` (summed per episode by the
driver) until the server says `done`.

An observation is shown to the model as its `observation_field` when given, else as the
observation's JSON without `metadata`. Tasks: `train_tasks` is an endless stream of seeds,
`eval_tasks` the first `num_eval` seeds of a held-out range; the server draws the episode.
"""
from __future__ import annotations

import atexit
import itertools
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import anyio.to_thread
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .api import Environment, EnvironmentFailure, Reward, StepResult

EVAL_SEED_BASE = 1_000_000   # eval seeds: EVAL_SEED_BASE + i, never a training seed


class OpenEnvOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    app: str | None = Field(None, description="import path 'module:app' of the OpenEnv server's ASGI app, "
                            "started as a local process")
    base_url: str | None = Field(None, description="the URL of an OpenEnv server that runs already")
    action_field: str = Field("message", description="the action's field that carries the assistant's text")
    observation_field: str | None = Field(None, description="the observation's field shown to the model; "
                                          "none: the observation as JSON")
    max_turns: int = Field(4, ge=1, description="actions per episode at most")
    num_eval: int = Field(8, ge=1, description="held-out episodes (seeds)")
    startup_timeout_s: float = Field(60.0, gt=0, description="how long a started server may take to answer")

    @model_validator(mode="after")
    def _one_server(self):
        if (self.app is None) == (self.base_url is None):
            raise ValueError("give exactly one of app ('module:app', started here) and base_url (a running "
                             "server)")
        return self


class LocalServer:
    """One OpenEnv server process per app per process, started on first use, ended at exit."""

    _servers: dict[str, "LocalServer"] = {}
    _lock = threading.Lock()

    def __init__(self, app: str, timeout_s: float):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen([sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1",
                                         "--port", str(port), "--log-level", "warning"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        atexit.register(self.stop)
        self._wait(app, timeout_s)

    def _wait(self, app: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                assert self.process.stderr is not None, "started with stderr=PIPE"
                error = self.process.stderr.read().decode(errors="replace").strip().splitlines()
                raise EnvironmentFailure(f"the OpenEnv server {app!r} exited with {self.process.returncode}: "
                                         f"{error[-1] if error else 'no output'}; fix: check the app's import "
                                         f"path (module:app)")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise EnvironmentFailure(f"the OpenEnv server {app!r} did not answer within {timeout_s} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()

    @classmethod
    def url_of(cls, app: str, timeout_s: float) -> str:
        """The server of `app`, started if it is not running (blocking: call from a worker thread)."""
        with cls._lock:
            server = cls._servers.get(app)
            if server is None or server.process.poll() is not None:
                server = cls._servers[app] = cls(app, timeout_s)
            return server.url


class Session:
    """One OpenEnv WebSocket session: `{"type": "reset" | "step" | "close", "data": ...}` out, `{"type",
    "data": {"observation", "reward", "done"}}` back (an `"error"` type raises). Blocking calls:
    run them in a worker thread."""

    def __init__(self, base_url: str, timeout_s: float = 60.0):
        from websockets.sync.client import connect
        url = "ws" + base_url[len("http"):] if base_url.startswith("http") else base_url
        self.timeout_s = timeout_s
        self.ws = connect(url.rstrip("/") + "/ws", open_timeout=timeout_s, max_size=100 << 20)

    def exchange(self, kind: str, data: dict) -> dict:
        self.ws.send(json.dumps({"type": kind, "data": data}))
        reply = json.loads(self.ws.recv(timeout=self.timeout_s))
        if reply.get("type") == "error":
            error = reply.get("data") or {}
            raise EnvironmentFailure(f"the OpenEnv server refused {kind}: {error.get('message', error)}")
        return reply.get("data") or {}

    def close(self) -> None:
        try:
            self.ws.send(json.dumps({"type": "close"}))
        except Exception:  # noqa: BLE001 - best effort: the socket closes below either way
            pass
        self.ws.close()


class OpenEnvEnvironment(Environment):
    """An OpenEnv environment server played turn by turn (the module docstring)."""

    options_model = OpenEnvOptions
    options: OpenEnvOptions

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.client = None

    @classmethod
    def train_tasks(cls, seed: int, options: OpenEnvOptions):
        return ({"id": f"openenv-{seed}-{i}", "seed": seed * 100_000 + i} for i in itertools.count())

    @classmethod
    def eval_tasks(cls, options: OpenEnvOptions) -> list[dict]:
        return [{"id": f"openenv-eval-{i}", "seed": EVAL_SEED_BASE + i} for i in range(options.num_eval)]

    def _show(self, observation: dict) -> str:
        field = self.options.observation_field
        if field is not None:
            if field not in observation:
                raise EnvironmentFailure(f"the OpenEnv observation has no field {field!r}; its fields are "
                                         f"{sorted(observation)}; fix: set observation_field to one of them")
            return str(observation[field])
        return json.dumps({k: v for k, v in observation.items() if k != "metadata"}, sort_keys=True)

    def _connect_and_reset(self, seed) -> dict:
        options = self.options
        if options.base_url:
            url = options.base_url
        else:
            assert options.app is not None, "OpenEnvOptions holds exactly one of app and base_url"
            url = LocalServer.url_of(options.app, options.startup_timeout_s)
        self.client = Session(url)
        return self.client.exchange("reset", {"seed": seed} if seed is not None else {})

    async def reset(self, task: dict) -> str:
        """A new OpenEnv session, reset with the task's seed. Cancellation: the session is closed by
        `close`, as the contract says."""
        result = await anyio.to_thread.run_sync(self._connect_and_reset, task.get("seed"))
        return self._show(result.get("observation") or {})

    async def step(self, action: str) -> StepResult:
        """The text as the action; the server's reward as the `openenv` component."""
        result = await anyio.to_thread.run_sync(self.client.exchange, "step", {self.options.action_field: action})
        reward = Reward({"openenv": float(result.get("reward") or 0.0)})
        if result.get("done"):
            return StepResult(None, True, reward)
        return StepResult(self._show(result.get("observation") or {}), False, reward)

    async def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(client.close)
