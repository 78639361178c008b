"""The public Environment API: what a task is, turn by turn, and what it is worth.

A user writes an environment by subclassing `Environment`:

    class Echo(Environment):
        async def reset(self, task):            # -> the first observation
            return task["prompt"]               #    (a user message, or a list of chat messages)
        async def step(self, action):           # -> StepResult(observation, done, reward)
            return StepResult(None, True, Reward({"correct": float(action.strip() == "hi")}))

Design in a paragraph: an environment is a small state machine that sees text, never tokens.
One driver, `run_episode`, plays every episode, in training (the environment actor) and in
`postrain eval` alike, so an environment scores the same in both. It owns the conversation:
it takes `reset`'s observation, asks a policy for an action (the assistant turn's text),
passes it to `step`, and appends a returned observation as the next user turn, until `done`
or `max_turns` actions (an episode longer than the model's context goes on under a context
policy, in segments: actors/env/context.py). What plays the assistant turns is an `EpisodePolicy`: a script or a
local engine over text (`TextPolicy`, eval and tests), or the environment actor's token-level
policy, which renders the same conversation into the exact token ids it samples. Rewards are
named float components (`Reward`), weighted and summed by the learner
(`postrain.ext.rl_ops.compute_advantages`), so one run can mix tasks and log each component.
Environments never talk to sockets: what they may call outside themselves comes as handles
(`sandbox`, and `scorers`: the run's judges, teachers and reward models, actors/env/scorers.py)
that the caller passes in.

The contract (`run_episode` enforces it):

- `reset` returns a str (one user message) or a non-empty list of `{"role", "content"}` maps
  (a content is a str, or a list of OpenAI-style content parts, text and inline images, for a
  task that shows images: `validate_content_parts`); `step` returns a `StepResult`. Anything
  else is garbage: `validate_observation` and `validate_step_result` raise
  `EnvironmentContractError` naming the field, the value and the fix.
- `done=False` requires an observation (the next user turn); `done=True` requires a reward.
- The reward rule: an episode's reward is the per-component sum of every reward its steps
  returned (intermediate rewards of non-final steps, which are optional, plus the final step's
  reward), plus `truncated()`'s reward when the episode ended without `done` (after
  `max_turns` actions, or when the policy's token budget ran out). Weights: the last given
  for each component win.
- An environment that raises, or does not answer within the caller's `step_timeout_s`, fails
  only its sample: the caller drops that sample with the reason (`drop_reason(exc)`) in the
  ledger and goes on; it never retries the same environment object. A hang that blocks the
  event loop itself (a busy loop with no await) cannot be cut by a timeout: the supervisor
  sees the actor's missed heartbeats and restarts it, and its samples are dropped.
- `truncated()` gives the final reward of an episode that ran out of turns (default: an empty
  `Reward`, worth 0).
- Options: `self.options` is the config's task options, validated: an instance of the class's
  `options_model` (a pydantic model with `extra="forbid"`, usually a `postrain.core.Options`),
  read as attributes (`self.options.max_tool_calls`); each default lives in its field, and a
  misspelt or out-of-range option is a `TaskOptionsError` naming it, raised when the
  environment is made. A class without `options_model` gets `AnyOptions`: unchecked, each given
  option an attribute, and readable as a mapping (`self.options.get("target", 3)`) as before.
  A `max_turns` option (a field, or a key given to `AnyOptions`) that is not None sets
  `self.max_turns`; else the class attribute does.
- Sandbox: a class that runs code declares `uses_sandbox = True`; the environment actor then
  looks a sandbox actor up at setup (and refuses to start without one). An environment that
  declares nothing runs without a sandbox actor. An episode that works in one jail across its
  turns (a shell) opens a session (`sandbox.session(files=...)`, an async context manager) in
  `reset` and closes it in `close`, which every caller awaits whatever ended the episode.
- Tools: `tools` names the tools its turns may call (`postrain.actors.env.tools`: "python", "bash");
  the environment parses turns with `parse_action(text, self.tools)`.
- One environment object serves one episode at a time; the caller makes a new object (or calls
  `reset` again) per sample. Cancellation of `reset`/`step`: the episode is abandoned; a handle
  call in flight ends within its own limits.
"""
from __future__ import annotations

import base64
import dataclasses
import math
import mimetypes
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar, overload, runtime_checkable

from pydantic import BaseModel, ConfigDict, ValidationError

from postrain.core.errors import ConfigError

from ..records.reward import EnvironmentContractError, EnvironmentFailure, Reward
from .scorers import ScorerHandle, Scorers

ROLES = ("system", "user", "assistant", "tool")


class TaskOptionsError(ConfigError):
    """Task options that break the task's options model (a misspelt or out-of-range knob)."""


# --------------------------------------------------------------------------- values
MAX_CAUSE_CHARS = 64   # StepResult.info["cause"]: a label counted per task, not a message


@dataclasses.dataclass
class StepResult:
    """What `step` returns.

    observation: the next user turn's text (None once done); done: the episode is over;
    reward: required when done (intermediate rewards are allowed and are summed per component
    by `run_episode`); info: free-form plain data for logs (not used for training). One key
    is read: `info["cause"]`, a short label of why the episode ends as it does (the CAD grader's
    "ok", "script_error", "wrong_shape", "no_export"): the last one an episode's steps name is its
    `Episode.cause`, which `postrain eval`, the run's evaluations and samples.jsonl count and
    show per task.
    """

    observation: str | None
    done: bool
    reward: Reward | None = None
    info: dict = dataclasses.field(default_factory=dict)


def validate_observation(obs: Any, *, where: str = "reset") -> str | list[dict]:
    """Check a first observation: a str, or a non-empty list of {"role", "content"} maps whose
    content is a str or, for a message that shows images, a list of content parts
    (`validate_content_parts`)."""
    if isinstance(obs, str):
        return obs
    if not isinstance(obs, list) or not obs:
        raise EnvironmentContractError(
            f"{where} must return a str or a non-empty list of chat messages, got {show_value(obs)}; "
            f"fix: return the user's text, or [{{'role': 'user', 'content': '...'}}]")
    for i, message in enumerate(obs):
        if not isinstance(message, dict) or message.get("role") not in ROLES \
                or not isinstance(message.get("content"), (str, list)):
            raise EnvironmentContractError(
                f"{where}: message {i} must be a dict with role in {ROLES} and a str content (or a list of "
                f"content parts), got "
                f"{show_value(message)}; fix: {{'role': 'user', 'content': '...'}}")
        if isinstance(message["content"], list):
            validate_content_parts(message["content"], where=f"{where}: message {i}")
    return obs


IMAGE_URL_PREFIX = "data:image/"
FILE_URL_PREFIX = "file:///"          # an absolute path the environment owns
MAX_IMAGE_FILE_BYTES = 64 << 20


def validate_content_parts(parts: list, *, where: str) -> None:
    """Check a message content that is a list of OpenAI-style content parts, the form a message
    takes when it shows images (only a first observation may: `step` observations are text):
    a non-empty list of `{"type": "text", "text": str}` and `{"type": "image_url", "image_url":
    {"url": "data:image/png;base64,..."}}`, or `{"url": "file:///abs/path.png"}` for a file the
    environment owns, which `inline_image_files` reads where the environment runs. Beyond the
    environment images are inline data URLs: the model side never fetches one."""
    if not parts:
        raise EnvironmentContractError(f"{where} has an empty list as its content; fix: a str, or content parts")
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        ok = (kind == "text" and isinstance(part.get("text"), str)) or (
            kind == "image_url" and isinstance(part.get("image_url"), dict)
            and isinstance(part["image_url"].get("url"), str)
            and part["image_url"]["url"].startswith((IMAGE_URL_PREFIX, FILE_URL_PREFIX)))
        if not ok:
            raise EnvironmentContractError(
                f"{where}: content part {j} must be {{'type': 'text', 'text': str}} or {{'type': 'image_url', "
                f"'image_url': {{'url': '{IMAGE_URL_PREFIX}...;base64,...'}}}} (or '{FILE_URL_PREFIX}...' for a "
                f"file of the environment's), got {show_value(part)}; fix: write the text as a text part and the "
                f"image inline as a data URL or as an absolute file:// path")


def inline_image_files(messages: list[dict], *, where: str) -> list[dict]:
    """`messages` with every image named by a file:// URL replaced by its bytes as a data URL (new
    message dicts; the others as they are). Run where the environment runs, on messages it wrote:
    the path is read there, so nothing past the environment reads a path.
    EnvironmentContractError naming a file that is missing, unreadable or over
    MAX_IMAGE_FILE_BYTES (what the bytes are is checked where the image is decoded)."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list) or not any(_file_url(part) for part in content):
            out.append(message)
            continue
        parts = [{"type": "image_url", "image_url": {"url": _file_data_url(_file_url(part), f"{where}: message {i}")}}
                 if _file_url(part) else part for part in content]
        out.append({**message, "content": parts})
    return out


def _file_url(part) -> str | None:
    url = part.get("image_url", {}).get("url") if isinstance(part, dict) and part.get("type") == "image_url" else None
    return url if isinstance(url, str) and url.startswith(FILE_URL_PREFIX) else None


def _file_data_url(url: str | None, where: str) -> str:
    path = Path(urllib.parse.unquote(str(url)[len("file://"):]))
    try:
        size = path.stat().st_size
        if size > MAX_IMAGE_FILE_BYTES:
            raise EnvironmentContractError(f"{where}: image file {path} is {size:,} bytes, over "
                                           f"{MAX_IMAGE_FILE_BYTES:,}; fix: downscale it")
        data = path.read_bytes()
    except OSError as exc:
        raise EnvironmentContractError(f"{where}: image file {path} cannot be read ({exc.strerror}); fix: name a "
                                       "file the environment wrote, by its absolute path") from None
    subtype = (mimetypes.guess_type(path.name)[0] or "image/png").split("/")[-1]
    return f"{IMAGE_URL_PREFIX}{subtype};base64,{base64.b64encode(data).decode()}"


def require_text_messages(messages: list[dict], who: str) -> None:
    """For a policy that renders text only: EnvironmentFailure if a message's content is not a str
    (content parts with an image: a task such as `charts` needs a vision-language policy)."""
    for i, message in enumerate(messages):
        if not isinstance(message.get("content"), str):
            raise EnvironmentFailure(
                f"message {i} holds content parts (an image), but {who} renders text only; fix: play this "
                f"task with a vision-language policy")


def validate_step_result(result: Any) -> StepResult:
    """Check what `step` returned; raise EnvironmentContractError naming what is wrong."""
    if not isinstance(result, StepResult):
        raise EnvironmentContractError(
            f"step must return a StepResult, got {show_value(result)}; "
            f"fix: return StepResult(observation, done, reward)")
    if not isinstance(result.done, bool):
        raise EnvironmentContractError(
            f"StepResult.done must be a bool, got {show_value(result.done)}; fix: pass True or False")
    if result.observation is not None and not isinstance(result.observation, str):
        raise EnvironmentContractError(
            f"StepResult.observation must be a str or None, got {show_value(result.observation)}; "
            f"fix: format the observation as text")
    if not result.done and result.observation is None:
        raise EnvironmentContractError(
            "StepResult.observation is None but done is False: the next turn needs an observation; "
            "fix: return the text the model should see next, or done=True")
    if result.reward is not None and not isinstance(result.reward, Reward):
        raise EnvironmentContractError(
            f"StepResult.reward must be a Reward or None, got {show_value(result.reward)}; "
            f"fix: Reward({{'correct': 1.0}})")
    if result.done and result.reward is None:
        raise EnvironmentContractError(
            "StepResult.reward is None but done is True: a finished episode needs a reward; "
            "fix: return Reward({...}) (Reward() is worth 0)")
    if not isinstance(result.info, dict):
        raise EnvironmentContractError(
            f"StepResult.info must be a dict, got {show_value(result.info)}; fix: pass a dict or omit it")
    cause = result.info.get("cause")
    if cause is not None and not (isinstance(cause, str) and 0 < len(cause) <= MAX_CAUSE_CHARS):
        raise EnvironmentContractError(
            f"StepResult.info['cause'] must be a short label (a str of 1-{MAX_CAUSE_CHARS} characters), got "
            f"{show_value(cause)}; fix: name the kind of outcome (e.g. 'wrong_unit') and put details in other keys")
    return result


def show_value(value: Any) -> str:
    """A value as an error message shows it: its type and the start of its repr."""
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


# --------------------------------------------------------------------------- handles
@runtime_checkable
class SandboxHandle(Protocol):
    """What an environment may run code with. Results are ExecResult-like: `status` (a
    `postrain.sandbox.Status` or its str value), `stdout`, `stderr` (bytes or str), `exit_code`,
    `wall_s`; test reports are TestReport-like: `passed` {name: bool}, `errors` {name: str},
    `collect_error` (str or None), `result`."""

    async def exec(self, code: str, *, stdin: bytes | str | None = None,
                   files: dict[str, bytes] | None = None, timeout_s: float | None = None) -> Any:
        """Run `code` within `timeout_s`. Contract on cancellation: the caller stops waiting
        at once and gets no result; the run itself must still end within its own limits."""
        ...

    async def run_tests(self, solution: str, tests: str, *, test_timeout_s: float = 2.0,
                        timeout_s: float | None = None) -> Any:
        """Run `tests` against `solution`. Contract on cancellation: as `exec` (no report; the
        run still ends within its limits)."""
        ...

    def session(self, files: dict[str, bytes] | None = None, limits: dict | None = None) -> Any:
        """An async context manager of a sandbox session (a jail for one episode, with `files`
        laid into its work dir): inside, awaited `run(command, stdin=None, timeout_s=None)` (bash),
        `run_python(code)`, `read_file(path)`, `write_file(path, data)`, each an ExecResult-like
        result or bytes; on exit the session is closed. Contract on cancellation of the enter:
        no session is left open past the sandbox's own reaper; of a call: as `exec`."""
        ...


class LocalSandbox:
    """A `SandboxHandle` over an in-process `postrain.sandbox.Sandbox` (tests, `postrain eval`).

    `timeout_s` sets both the wall and the CPU limit of that one run. Must be awaited from trio
    (the Sandbox's `arun` runs in a trio worker thread). Cancellation: as `Sandbox.arun`.
    """

    def __init__(self, sandbox) -> None:
        self.sandbox = sandbox

    def _policy(self, timeout_s: float | None):
        if timeout_s is None:
            return None
        return self.sandbox.policy.replace(wall_time_s=float(timeout_s),
                                           cpu_time_s=max(1, math.ceil(timeout_s)))

    async def exec(self, code: str, *, stdin: bytes | str | None = None,
                   files: dict[str, bytes] | None = None, timeout_s: float | None = None):
        """`Sandbox.arun` of `code`. Cancellation: the caller stops waiting at once (the worker
        thread is abandoned); the run still ends within its wall limit and frees its worker."""
        return await self.sandbox.arun(code, stdin=stdin or b"", files=files,
                                       policy=self._policy(timeout_s), requester="environment")

    async def run_tests(self, solution: str, tests: str, *, test_timeout_s: float = 2.0,
                        timeout_s: float | None = None):
        """`arun_tests` of `tests` against `solution`. Cancellation: no report; the run still
        ends within its wall limit and frees its worker (as `exec`)."""
        from postrain.sandbox.rewards import arun_tests
        return await arun_tests(self.sandbox, solution, tests, test_timeout_s=test_timeout_s,
                                policy=self._policy(timeout_s), requester="environment")

    def session(self, files: dict[str, bytes] | None = None, limits: dict | None = None):
        """`Sandbox.asession`: an async context manager of a session with `files` in /work."""
        return self.sandbox.asession(files=files, limits=limits)


# --------------------------------------------------------------------------- the base class
class Environment:
    """Subclass this; override `reset` and `step` (and `truncated` if running out of turns
    deserves more than 0). Options come from the config's task options (`options`), checked
    by `options_model` where the class declares one; `max_turns` may be set there, as a class
    attribute, or both (an option that is not None wins)."""

    max_turns: int = 8            # actions per episode before `truncated()` ends it
    observation_role: str = "user"  # the chat role of step observations (user works everywhere)
    uses_sandbox: ClassVar[bool] = False   # True: it runs code; the environment actor needs a sandbox
    tools: tuple[str, ...] = ("python",)  # the tools its turns may call (env/tools.py); or per instance
    options_model: ClassVar[type[BaseModel] | None] = None  # its task options' model; None: AnyOptions

    def __init__(self, *, sandbox: SandboxHandle | None = None, scorers: Mapping[str, ScorerHandle] | None = None,
                 options: dict | BaseModel | None = None) -> None:
        self.sandbox = sandbox
        self.scorers = scorers if isinstance(scorers, Scorers) else Scorers(scorers)
        self.options = check_options(self.options_model, options, type(self).__name__)
        max_turns = getattr(self.options, "max_turns", None)
        if max_turns is not None:   # checked here too: AnyOptions checks nothing
            if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
                raise EnvironmentContractError(
                    f"options.max_turns must be an int >= 1, got {max_turns!r}; fix: e.g. 4")
            self.max_turns = max_turns

    def require_sandbox(self) -> SandboxHandle:
        """The sandbox handle, or a clear error when the caller gave none."""
        if self.sandbox is None:
            raise EnvironmentContractError(
                f"{type(self).__name__} runs code but was given no sandbox handle; fix: declare "
                f"uses_sandbox = True on the class (the environment actor then looks one up), or pass "
                f"sandbox=LocalSandbox(postrain.sandbox.Sandbox())")
        return self.sandbox

    async def reset(self, task: dict) -> str | list[dict]:
        """The episode's first observation for `task`. Contract on cancellation: the episode is
        abandoned; the object may be left half-reset, so the caller only `close`s it (or calls
        `reset` again), never `step`s it."""
        raise NotImplementedError(f"{type(self).__name__} must define async reset(self, task)")

    async def step(self, action: str) -> StepResult:
        """Apply the assistant's `action`. Contract on cancellation: not atomic; the episode is
        abandoned and the caller only `close`s the object; a handle call in flight ends within
        its own limits."""
        raise NotImplementedError(f"{type(self).__name__} must define async step(self, action)")

    async def truncated(self) -> Reward:
        """The final reward when the episode ended without `done` (`max_turns` actions passed,
        or the policy's token budget ran out). Contract on cancellation: the episode is
        abandoned, no reward is recorded; the caller then `close`s the object. The default
        holds no state, so cancelling it leaves nothing."""
        return Reward()

    async def close(self) -> None:
        """Release what the environment holds; called once per environment object.
        Contract on cancellation: callers await it in a `finally`, possibly inside an already
        cancelled scope where every await raises at once, and never retry it; an override that
        must await its cleanup shields it (a shielded cancel scope with its own timeout). The
        default holds nothing."""


class AnyOptions(BaseModel):
    """The task options of an environment (or task) that declares no `options_model`: nothing is
    checked, every option given is an attribute (`options.target`), and it reads as the plain
    dict it was (`options.get("target", 3)`, `options["target"]`, `"target" in options`), so
    environments written against dict options keep working. Frozen, like every options model."""

    model_config = ConfigDict(extra="allow", frozen=True)

    def get(self, key: str, default: Any = None) -> Any:
        return (self.model_extra or {}).get(key, default)

    def __getitem__(self, key: str) -> Any:
        return (self.model_extra or {})[key]

    def __contains__(self, key: object) -> bool:
        return key in (self.model_extra or {})

    def keys(self):
        return (self.model_extra or {}).keys()


OptionsT = TypeVar("OptionsT", bound=BaseModel)


def known_subset(name: str, value: tuple, known: tuple, example: str) -> tuple:
    """`value` as a non-empty subset of `known`, in `known`'s order; ValueError naming the field,
    the choices and an example (a task option's validator: levels, kinds...)."""
    if not value or set(value) - set(known):
        raise ValueError(f"{name} must be a non-empty subset of {list(known)}, got {list(value)}; "
                         f"fix: e.g. {name} = {example}")
    return tuple(k for k in known if k in value)


@overload
def check_options(model: type[OptionsT], options: dict | BaseModel | None, owner: str) -> OptionsT: ...
@overload
def check_options(model: None, options: dict | BaseModel | None, owner: str) -> BaseModel: ...
def check_options(model: type[BaseModel] | None, options: dict | BaseModel | None, owner: str) -> BaseModel:
    """The task options of `owner` validated by `model` (None: `AnyOptions`, unchecked): an
    instance of `model`, whose attributes the task reads. `options` is a dict (a config's
    `task_options`), None (all defaults) or an options instance: one of `model` comes back as it
    is (it was checked when made, and models are frozen), another model's set fields are checked
    anew. Raises TaskOptionsError naming every bad option and the options `model` knows."""
    model = model or AnyOptions
    if isinstance(options, model):
        return options
    if isinstance(options, BaseModel):
        options = options.model_dump(exclude_unset=True)
    try:
        return model.model_validate(dict(options or {}))
    except ValidationError as exc:
        from postrain.core.config import validation_lines
        lines = validation_lines(exc, prefix="task_options.")
        raise TaskOptionsError(f"{len(lines)} bad task option(s) of {owner}: " + "; ".join(lines)
                               + f"; known options: {sorted(model.model_fields)}") from None
