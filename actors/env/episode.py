"""The one episode driver: `run_episode` plays an `Environment` against an `EpisodePolicy`.

    episode = await run_episode(env, task, policy, max_turns=4)   # -> Episode(messages, reward, ...)

It enforces the contract written in actors/env/api.py (observations, step results, the reward
rule, timeouts); the environment actor and `postrain eval` both play episodes through it.

With `context=` (a `ContextOptions`, actors/env/context.py) an episode may outgrow the model's
context: before each turn that would pass `context.max_tokens`, the driver changes the history
by the policy's strategy and tells the policy (`EpisodePolicy.restart`), which starts a new
segment; `Episode.num_segments` counts them. A policy that counts no tokens (`context_size()`
None: a text policy) plays without a context policy.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Awaitable, Callable, cast

import trio

from .api import (Environment, EnvironmentContractError, EnvironmentFailure, LocalSandbox, Reward, StepResult,
                  inline_image_files, show_value, validate_observation, validate_step_result)
from .user_errors import EnvironmentErrors
from .context import (SUMMARY_REQUEST, ContextOptions, after_summary, drop_oldest_turns, fits,
                      truncate_tool_outputs)


@dataclasses.dataclass
class Episode:
    """One finished episode. `messages` is the whole conversation (first observation, then
    alternating assistant actions and observations); `reward` follows the reward rule (the
    module docstring: every step's reward summed per component, plus `truncated()`'s; weights:
    the last ones given); `truncated` says the episode ended without `done`; `infos` holds
    each step's `StepResult.info`. With a context policy, `messages` is the history as the model
    last saw it, and `num_segments` counts the contexts the episode was played in (1: its history
    never changed)."""

    messages: list[dict]
    reward: Reward
    num_turns: int
    truncated: bool
    infos: list[dict]
    num_segments: int = 1

    @property
    def cause(self) -> str | None:
        """Why the episode ended as it did: the last `info["cause"]` its steps named (api.py,
        `StepResult`), None when none did."""
        return next((info["cause"] for info in reversed(self.infos) if info.get("cause")), None)


ActionFn = Callable[[list[dict]], Awaitable[str]]


class EpisodePolicy:
    """What plays the assistant turns of an episode for `run_episode`.

    The driver calls `begin` once with the first messages, then per turn `can_act` (False ends
    the episode as truncated: a token budget is spent) and `act`, and `observe` after each
    observation turn it appends. `messages` is the driver's conversation (read it, do not
    change it). Cancellation of `act`: the episode is abandoned, the policy's state with it.
    """

    def begin(self, messages: list[dict]) -> None:
        """The episode's first messages (a token-level policy renders its prompt from them)."""

    def can_act(self) -> bool:
        return True

    async def act(self, messages: list[dict]) -> str:
        """The next assistant turn's text. Contract on cancellation: the episode is abandoned,
        and the policy's state with it; the policy is not used again, so `act` need not be atomic."""
        raise NotImplementedError(f"{type(self).__name__} must define async act(self, messages)")

    def observe(self, messages: list[dict]) -> None:
        """`messages[-1]` is a new observation turn, after the assistant turn `act` gave."""

    # -- token counts, for a context policy (actors/env/context.py); a text policy counts none --

    def context_size(self) -> int | None:
        """Tokens of the context the next turn reads (the current segment's, exact); None: this
        policy counts no tokens, and the driver applies no context policy."""
        return None

    def turn_reserve(self) -> int:
        """Tokens the next turn may add at most (its max_new_tokens)."""
        return 0

    def measure(self, messages: list[dict]) -> int:
        """Tokens of a fresh context rendered from `messages` (with the generation prompt)."""
        raise NotImplementedError(f"{type(self).__name__} counts tokens, so it must define measure(messages)")

    def restart(self, messages: list[dict]) -> None:
        """The driver changed the history: a new segment starts, its context rendered from
        `messages`; nothing sampled before is part of it."""
        raise NotImplementedError(f"{type(self).__name__} counts tokens, so it must define restart(messages)")


class TextPolicy(EpisodePolicy):
    """A policy over text: `fn(messages) -> action text` (a script in tests, a local engine in
    `postrain eval`)."""

    def __init__(self, fn: ActionFn) -> None:
        self.fn = fn

    async def act(self, messages: list[dict]) -> str:
        """`fn` on a copy of `messages`. Cancellation: as `fn`'s; this policy keeps no state,
        so nothing of it remains."""
        return await self.fn(list(messages))


async def _guarded(what: str, fn, *args, timeout_s: float | None):
    """`await fn(*args)` within `timeout_s`, its errors turned into EnvironmentFailure (a
    contract error passes through). Cancellation: trio's Cancelled passes through unchanged
    (it is not an Exception); the environment is left wherever `fn` stopped."""
    try:
        if timeout_s is None:
            return await fn(*args)
        with trio.fail_after(timeout_s):
            return await fn(*args)
    except trio.TooSlowError:
        raise EnvironmentFailure(f"environment {what} did not return within {timeout_s} s") from None
    except (EnvironmentContractError, EnvironmentFailure):
        raise
    except Exception as exc:  # noqa: BLE001 - a user's environment may raise anything
        raise EnvironmentFailure(f"environment raised {type(exc).__name__}: {exc}") from exc


async def checked_reset(env: Environment, task: dict, *, timeout_s: float | None = 60.0) -> list[dict]:
    """`env.reset(task)` under the contract: the first messages (a str becomes one user message).
    Raises EnvironmentFailure (raised or hung) or EnvironmentContractError (garbage).
    Cancellation: no messages; `env` may be half-reset (the caller closes it)."""
    first = validate_observation(await _guarded("reset", env.reset, task, timeout_s=timeout_s))
    if isinstance(first, str):
        return [{"role": "user", "content": first}]
    return inline_image_files(first, where="reset")      # an image by file:// path: read here, where it lives


async def checked_step(env: Environment, action: str, *, timeout_s: float | None = 60.0) -> StepResult:
    """`env.step(action)` under the contract (raises as `checked_reset`). Cancellation: not
    atomic; no result, `env` is left mid-step and the episode is abandoned (the caller closes it)."""
    return validate_step_result(await _guarded("step", env.step, action, timeout_s=timeout_s))


async def checked_truncated(env: Environment, *, timeout_s: float | None = 60.0) -> Reward:
    """`env.truncated()` under the contract (raises as `checked_reset`). Cancellation: no
    reward; the episode is abandoned (the caller closes `env`)."""
    final = await _guarded("truncated", env.truncated, timeout_s=timeout_s)
    if not isinstance(final, Reward):
        raise EnvironmentContractError(
            f"truncated must return a Reward, got {show_value(final)}; fix: return Reward({{...}})")
    return final


async def run_episode(env: Environment, task: dict, policy: EpisodePolicy | ActionFn, *,
                      step_timeout_s: float | None = 60.0,
                      context: ContextOptions | dict | None = None) -> Episode:
    """Play one episode of `env` on `task`: the one driver of training and evaluation.

    `policy` is an `EpisodePolicy`, or `fn(messages) -> action text` (wrapped in `TextPolicy`).
    The episode ends at `done`, after `env.max_turns` actions, or when `policy.can_act()` says
    no; its reward follows the reward rule of the module docstring. Raises EnvironmentFailure
    (raised/hung) or EnvironmentContractError (garbage); the caller drops the sample with
    `drop_reason(exc)` (actors/env/user_errors.py). Runs on trio. `context`: a context policy
    (module docstring); the episode is truncated when not even its first messages and last turn
    fit. Cancellation: the
    episode is abandoned (the caller closes `env`)."""
    if not isinstance(policy, EpisodePolicy):
        policy = TextPolicy(policy)
    if isinstance(context, dict):
        context = cast(ContextOptions, ContextOptions.model_validate(context))  # Options' base is Any to mypy
    messages = await checked_reset(env, task, timeout_s=step_timeout_s)
    num_first = len(messages)
    policy.begin(list(messages))
    components: dict[str, float] = {}
    weights: dict[str, float] = {}
    infos: list[dict] = []
    num_turns, done, num_segments = 0, False, 1
    while not done and num_turns < env.max_turns:
        if context is not None:   # first: a full context is changed, not the end of the episode
            fitted, num_new = await fit_context(messages, num_first, policy, context, env.observation_role)
            num_segments += num_new
            if fitted is None:
                break
            messages = fitted
        if not policy.can_act():
            break
        action = await policy.act(messages)
        messages.append({"role": "assistant", "content": action})
        num_turns += 1
        result = await checked_step(env, action, timeout_s=step_timeout_s)
        infos.append(result.info)
        if result.reward is not None:
            _accumulate(result.reward, components, weights)
        done = result.done
        if not done:
            messages.append({"role": env.observation_role, "content": result.observation})
            policy.observe(messages)
    if not done:
        _accumulate(await checked_truncated(env, timeout_s=step_timeout_s), components, weights)
    return Episode(messages=messages, reward=Reward(components, weights), num_turns=num_turns,
                   truncated=not done, infos=infos, num_segments=num_segments)


async def fit_context(messages: list[dict], num_first: int, policy: EpisodePolicy, context: ContextOptions,
                      observation_role: str) -> tuple[list[dict] | None, int]:
    """(the history the next turn reads, the segments started): `messages` itself while the turn
    fits `context.max_tokens`, else a changed one that fits, whose new segment the policy has
    started (a summary turn adds one more segment before it); None when nothing fits (the
    episode ends truncated). Raises EnvironmentFailure when the first messages alone leave no
    room for a turn. Invariant on return: the policy's context_size() + turn_reserve() <=
    context.max_tokens, or None. Cancellation (summarize's turn): the episode is abandoned."""
    size = policy.context_size()
    if size is None:
        return messages, 0
    limit = context.max_tokens - policy.turn_reserve()
    if size <= limit:
        return messages, 0
    if len(messages) <= num_first:
        raise EnvironmentFailure(
            f"the first messages are {size} tokens; with the next turn's {policy.turn_reserve()} new tokens "
            f"they pass context.max_tokens = {context.max_tokens}; fix: raise max_tokens or lower max_new_tokens")
    measure = policy.measure
    if context.strategy == "summarize":
        return await _summarize(messages, num_first, policy, limit, observation_role, context.keep_chars)
    if context.strategy == "truncate_tool_outputs":
        fitted = truncate_tool_outputs(messages, num_first, observation_role, context.keep_chars, measure, limit)
    else:
        fitted = drop_oldest_turns(messages, num_first, measure, limit)
    if fitted is None:
        return None, 0
    policy.restart(list(fitted))
    return fitted, 1


async def _summarize(messages: list[dict], num_first: int, policy: EpisodePolicy, limit: int,
                     observation_role: str, keep_chars: int) -> tuple[list[dict] | None, int]:
    """The summarize strategy: the summary turn in a segment of its own (the history, cut to fit
    as truncate_tool_outputs does, then SUMMARY_REQUEST), then the history it replaces.
    Cancellation: the episode is abandoned."""
    request = {"role": "user", "content": SUMMARY_REQUEST}
    cost = policy.measure([*messages, request]) - policy.measure(messages)
    base = truncate_tool_outputs(messages, num_first, observation_role, keep_chars, policy.measure, limit - cost)
    if base is None:
        return None, 0
    asked = [*base, request]
    policy.restart(list(asked))
    summary = await policy.act(asked)
    replaced = after_summary(messages, num_first, summary, observation_role)
    if not fits(replaced, policy.measure, limit):
        return None, 1
    policy.restart(list(replaced))
    return replaced, 2


def _accumulate(reward: Reward, components: dict, weights: dict) -> None:
    for name, x in reward.components.items():
        components[name] = components.get(name, 0.0) + x
    weights.update(reward.weights)


async def score_episodes(task, task_options, tasks: list[dict], play,
                         errors: EnvironmentErrors | None = None) -> tuple[list[float], int]:
    """Play each held-out task once with `await play(env, item)` (a result with `.reward`), in a
    one-worker warm sandbox when the task runs code; (scores, episodes that failed). A failed
    episode scores 0 and is counted; every env is closed. `errors` (actors/env/user_errors.py), when
    given, shows the first failure at once and raises EnvironmentErrorStop, after the last episode,
    when one error failed most of them."""
    scores, failed, reasons = [], 0, []
    with contextlib.ExitStack() as stack:
        sandbox = None
        if task.needs_sandbox(task_options):
            from postrain.sandbox import Sandbox
            sandbox = LocalSandbox(stack.enter_context(Sandbox(mode="warm", num_workers=1)))
        for item in tasks:
            env = task.make_env(sandbox=sandbox, options=task_options)
            try:
                result = await play(env, item)
                scores.append(result.reward.components.get("correct", result.reward.total))
            except Exception as exc:
                failed += 1
                scores.append(0.0)
                reason = errors.record(exc) if errors is not None else None
                if reason is not None:
                    reasons.append(reason)
            finally:
                await env.close()
    if errors is not None:
        errors.check(reasons, len(tasks), "held-out episodes")
    return scores, failed
