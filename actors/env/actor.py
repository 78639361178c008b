"""The environment actor: runs episodes token by token, so nothing is re-tokenized for training.

    [[actors]]
    name = "env"
    cls = "postrain.actors.env:EnvironmentActor"
    options = { generator = "generator", max_total_tokens = 768 }   # task, task_options, model: [shared]

Options: `EnvironmentOptions` below. `task` is a registered task, 'pkg.mod:TASK' or
'pkg.mod:EnvClass' (`get_task`); `task_options` are checked by the task's options model at
config load and again at setup, so a misspelt option is an error naming it. A sandbox actor
is looked up only when the task's environment declares `uses_sandbox` (or `sandbox` names
one); an environment that runs code and has no sandbox fails setup with the fix.

`rollout` {"task": {...}, "sample_id": str, "sampling": {...}} (a `records.RolloutRequest`; a
sampling field left out takes `SamplingParams`' default) -> a `records.Rollout` on the wire:
    {"token_ids", "loss_mask", "behavior_logprobs", "policy_versions",
     "reward": {"components", "weights"}, "num_turns", "num_policy_tokens", "tool_statuses",
     "timeline", "cause"}
where `timeline` lists the episode's hops: each generate call and each tool call with its
start, duration and outcome (actors/env/timeline.py; `postrain trace`), and `cause` is the
episode's (`Episode.cause`; left out when its environment named none).

Design note (tokens in, tokens out). The episode is played by the one driver,
`environment.run_episode`, the same that `postrain eval` uses, so a reward is the same in
training and evaluation; this actor only brings a token-level policy (`TokenPolicy`,
actors/env/token_policy.py), and the context policy of its `context` option (actors/env/context.py:
an episode that outgrows the context goes on in new segments, each trained as its own sample).
The rollout is one growing list of token ids: the rendered prompt, then for each turn
exactly the ids the generator sampled (loss_mask 1, with their logprobs and policy
versions), then the observation's tokens (loss_mask 0). The action text the environment
sees is the decode of the sampled ids; the sampled ids themselves are never re-encoded.
An observation's tokens are the chat template's text between the end of the
assistant's content and the next generation prompt, encoded alone.

An `AgentEnvironment` task (actors/env/agent.py) plays each episode as an agent program on the
OpenAI API instead: through the run's gateway actor (named "gateway"), whose per-episode token
record becomes the rollout.

Failures: an environment that raises, hangs past `step_timeout_s` or returns
garbage fails the request with `EnvironmentFailure`, whose message is the reason the
ledger records (with the user's file:line when their code raised) and then their
traceback, trimmed to their own frames (actors/env/user_errors.py: the orchestrator
shows the first and stops a step that fails mostly by one); the actor keeps serving.
"""
from __future__ import annotations

import contextlib

from pydantic import Field

from postrain.core import Actor, MessageKind, handler
from postrain.core.errors import ConfigError

from ..models.chat_template import OPTION_HELP as CHAT_TEMPLATE_HELP
from ..models.spec import spec_image_layout, spec_tokenizer
from ..models.tokenizer import Tokenizer
from ..records import (EXEC, GATEWAY_ADDRESS, ROLLOUT, RUN_TESTS, ExecRequest, Rollout, RolloutRequest,
                       RunTestsRequest)
from ..sandbox.client import ASK_SLACK_S
from ..tasks import TaskMixture, TaskOptions
from .timeline import Timeline, tool_status
from .agent import DEFAULT_GATEWAY, AgentEnvironment, agent_rollout
from .api import EnvironmentContractError, EnvironmentFailure
from .context import ContextOptions
from .episode import run_episode
from .scorers import RemoteScorer, Scorers, SharedJudges
from .token_policy import TokenPolicy
from .user_errors import reported_failure

DEFAULT_SANDBOX = "sandbox"   # the sandbox actor's name when the task needs one and none is named


class SandboxRequiredError(ConfigError):
    """The task's environment runs code (`uses_sandbox`) but the environment actor has no sandbox."""


def load_tokenizer(model: str | dict, chat_template: str | None = None) -> Tokenizer:
    """The tokenizer of a model spec without loading its weights where that is possible
    (ModelConfig fields, a built-in config, take the byte tokenizer), rendering with
    `chat_template` where set. TokenizerError here, at load, when it has no chat template."""
    tokenizer = spec_tokenizer(model).with_template(chat_template)
    tokenizer.template_source()
    return tokenizer




class RemoteSandbox:
    """A `SandboxHandle` that calls the sandbox actor; with a `timeline`, each call is a hop in it.
    A call waits for a free worker up to ASK_SLACK_S beyond its own limit, as session calls do
    (an evaluation's episodes queue behind each other's runs on a small pool)."""

    def __init__(self, ref, timeline: Timeline | None = None):
        self.ref = ref
        self.timeline = timeline

    def for_episode(self, timeline: Timeline) -> "RemoteSandbox":
        return RemoteSandbox(self.ref, timeline)

    async def exec(self, code, *, stdin=None, files=None, timeout_s=None):
        """Run `code` on the sandbox actor (an "exec" hop). Cancellation: not atomic; the caller
        stops waiting, the run may still finish remotely within its limits (its reply is dropped)."""
        limits = {"wall_time_s": float(timeout_s)} if timeout_s is not None else None
        request = ExecRequest(code, stdin=stdin, files=files, limits=limits)
        return await self._call(EXEC, request, timeout_s=(timeout_s or 30) + ASK_SLACK_S)

    async def run_tests(self, solution, tests, *, test_timeout_s=2.0, timeout_s=None):
        """Run `tests` against `solution` on the sandbox actor (a "run_tests" hop). Cancellation:
        as `exec`; no report, the remote run still ends within its limits."""
        limits = {"wall_time_s": float(timeout_s)} if timeout_s is not None else None
        request = RunTestsRequest(solution, tests, test_timeout_s=float(test_timeout_s), limits=limits)
        return await self._call(RUN_TESTS, request, timeout_s=(timeout_s or 60) + ASK_SLACK_S)

    @contextlib.asynccontextmanager
    async def session(self, files=None, limits=None):
        """A session on the sandbox actor (`sandbox.client.remote_session`), closed on exit; with a
        timeline, each of its calls is a "tool" hop. Cancellation: as `remote_session` (the close
        is still sent; a session whose close is lost is reaped by the sandbox actor)."""
        from ..sandbox.client import remote_session
        async with remote_session(self.ref, files=files, limits=limits) as session:
            if self.timeline is not None:
                session = TimedSession(session, self.timeline, self.ref.name)
            yield session

    async def _call(self, kind: MessageKind, request, timeout_s: float):
        """`ref.call(kind, request)`, timed as a "tool" hop when there is a timeline. Cancellation:
        the request may still run remotely; the hop stays in the timeline, status "failed: Cancelled"."""
        if self.timeline is None:
            return await self.ref.call(kind, request, timeout_s=timeout_s)
        with self.timeline.hop("tool", self.ref.name, call=kind.name) as hop:
            reply = await self.ref.call(kind, request, timeout_s=timeout_s)
            hop.update(tool_status(reply))
        return reply


class TimedSession:
    """A sandbox session whose calls are "tool" hops of an episode's timeline (same methods).
    Cancellation of any call: as `_hop` (recorded as failed; the call ends remotely within its
    limits, and the session stays usable for its close)."""

    def __init__(self, session, timeline: Timeline, actor: str):
        self.session, self.timeline, self.actor = session, timeline, actor

    async def run(self, command: str, *, stdin=None, timeout_s=None):
        return await self._hop("session_exec", self.session.run(command, stdin=stdin, timeout_s=timeout_s))

    async def run_python(self, code: str, *, stdin=None, timeout_s=None):
        pending = self.session.run_python(code, stdin=stdin, timeout_s=timeout_s)
        return await self._hop("session_exec", pending)

    async def read_file(self, path: str):
        return await self._hop("session_read_file", self.session.read_file(path))

    async def write_file(self, path: str, data):
        return await self._hop("session_write_file", self.session.write_file(path, data))

    async def snapshot(self):
        return await self._hop("session_snapshot", self.session.snapshot())

    async def _hop(self, call: str, pending):
        """Await the call as a hop. Cancellation: the hop records "failed: Cancelled"; the call
        itself ends remotely within its limits."""
        with self.timeline.hop("tool", self.actor, call=call) as hop:
            result = await pending
            status = getattr(result, "status", None)
            if status is not None:
                hop["status"] = getattr(status, "value", status)
        return result


class EnvironmentOptions(TaskOptions):
    model: str | dict = Field("tiny", description="the policy (the generator's model spec): its tokenizer "
                              "renders the conversation")
    chat_template: str | None = Field(None, description=CHAT_TEMPLATE_HELP)
    generator: str = Field("generator", description="the generator actor's name")
    sandbox: str | None = Field(None, description="the sandbox actor's name; none: 'sandbox' when the "
                                "task's environment declares uses_sandbox, else no sandbox; '': no sandbox")
    scorers: list[str] = Field(default_factory=list, description="scorer actors (judges, teachers, reward "
                               "models) the environments may ask, as `self.scorers[name]` (docs/scorers.md)")
    step_timeout_s: float = Field(60.0, gt=0, description="time limit of each reset, step and "
                                  "truncated call, seconds; past it the sample is dropped")
    max_total_tokens: int = Field(1024, ge=1, description="tokens of one rollout (prompt, actions, "
                                  "observations) at most; the episode is truncated there (with a context "
                                  "policy: of each segment)")
    context: ContextOptions | None = Field(None, description="a context policy for episodes longer than the "
                                           "context: {max_tokens, strategy = 'truncate_tool_outputs' | "
                                           "'drop_oldest_turns' | 'summarize'} (actors/env/context.py)")


class EnvironmentActor(Actor):
    """Plays episodes of the run's tasks (`rollout`: of the task it names) with the generator as
    the policy."""

    Options = EnvironmentOptions

    async def setup(self):
        """Resolve the task and its options, load the tokenizer, look up the generator, the
        sandbox and the scorers. Cancellation: not atomic (some attributes may be set), but a cancelled setup
        ends the actor's process (`Actor.setup`), so no partial state serves requests."""
        self.mixture = TaskMixture.of(self.options)   # one task, or a mixture's (actors/tasks/mixture.py)
        self.tokenizer = load_tokenizer(self.options.model, self.options.chat_template)
        self.image_layout = spec_image_layout(self.options.model)   # None: a text-only policy
        self.generator = await self.lookup(self.options.generator)
        self.sandbox = await self._find_sandbox()
        self.scorers = {name: RemoteScorer(await self.lookup(name)) for name in self.options.scorers}
        self.judges = SharedJudges(self.scorers)   # one Judge per (scorer, rubric), shared by the episodes
        self.gateway = None   # an AgentEnvironment task's episodes run through the run's gateway (agent.py)
        if any(issubclass(task.spec.env_class, AgentEnvironment) for task in self.mixture.tasks):
            self.gateway = await self.lookup(DEFAULT_GATEWAY)
            self.gateway_address = await self.gateway.call(GATEWAY_ADDRESS)

    async def _find_sandbox(self) -> RemoteSandbox | None:
        """The sandbox handle: looked up only when the task needs one or `sandbox` names one.
        Cancellation: nothing is left behind (no attribute is set; `lookup` makes no reference)."""
        name = self.options.sandbox
        needing = [task for task in self.mixture.tasks if task.spec.needs_sandbox(task.options)]
        if name is None:
            name = DEFAULT_SANDBOX if needing else ""
        if not name:
            if needing:
                task = needing[0]
                raise SandboxRequiredError(
                    f"task {task.name!r} runs code (its environment {task.spec.env_class.__name__} "
                    f"declares uses_sandbox = True) but environment actor {self.name!r} has sandbox = ''; "
                    f"fix: add a SandboxActor to the run and leave sandbox unset (it is then "
                    f"{DEFAULT_SANDBOX!r}) or set sandbox = its name")
            return None
        try:
            return RemoteSandbox(await self.lookup(name))
        except Exception as exc:  # noqa: BLE001 - the head's answer names what it knows
            why = (f"task {needing[0].name!r} runs code (its environment declares uses_sandbox = True, "
                   f"or needs a sandbox for these task options)"
                   if needing else f"its options name sandbox = {name!r}")
            raise SandboxRequiredError(
                f"environment actor {self.name!r} needs the sandbox actor {name!r} ({why}), but the "
                f"lookup failed: {exc}; fix: add a SandboxActor named {name!r} to the run, before this "
                f"actor") from None

    @handler(ROLLOUT, concurrent=True)
    async def rollout(self, request: RolloutRequest) -> Rollout:
        """One episode. An episode the environment failed raises `reported_failure`'s
        EnvironmentFailure: the reason, then the user's traceback (actors/env/user_errors.py).
        Cancellation: the episode is abandoned and its environment closed."""
        try:
            return await self._play(request)
        except (EnvironmentFailure, EnvironmentContractError) as exc:
            raise reported_failure(exc) from None

    async def _play(self, request: RolloutRequest) -> Rollout:
        """One episode, its failures as raised. Cancellation: as `rollout`."""
        timeline = Timeline()
        sandbox = self.sandbox.for_episode(timeline) if self.sandbox else None
        scorers = Scorers({name: scorer.for_episode(timeline) for name, scorer in self.scorers.items()},
                          judges=self.judges, timeline=timeline)
        task = self.mixture[request.task_name]   # MixtureError (naming the tasks) for an unknown name
        env = task.spec.make_env(sandbox=sandbox, scorers=scorers, options=task.options)
        if isinstance(env, AgentEnvironment):
            assert self.gateway is not None, "setup looks the gateway up for a mixture with an agent task"
            try:
                return await agent_rollout(env, request.task, self.gateway, self.gateway_address, timeline,
                                           self.name)
            finally:
                await env.close()
        context = self.options.context
        policy = TokenPolicy(self.generator, self.tokenizer, request.sampling, self.options.max_total_tokens,
                             timeline, max_context_tokens=context.max_tokens if context else None,
                             image_layout=self.image_layout)
        try:
            with timeline.hop("episode", self.name) as hop:
                episode = await run_episode(env, request.task, policy,
                                            step_timeout_s=self.options.step_timeout_s, context=context)
                hop.update(num_turns=episode.num_turns, num_segments=episode.num_segments)
            return policy.rollout(episode, timeline)
        finally:
            await env.close()
