"""The one episode driver: `run_episode` plays an `Environment` against an `EpisodePolicy`.

    episode = await run_episode(env, task, policy, max_turns=4)   # -> Episode(messages, reward, ...)

It enforces the contract written in actors/env/api.py (observations, step results, the reward
rule, timeouts); the environment actor and `postrain eval` both play episodes through it.
"""
from __future__ import annotations

import dataclasses
from typing import Awaitable, Callable

import trio

from .api import (Environment, EnvironmentContractError, EnvironmentFailure, Reward, StepResult,
                  show_value, validate_observation, validate_step_result)


@dataclasses.dataclass
class Episode:
    """One finished episode. `messages` is the whole conversation (first observation, then
    alternating assistant actions and observations); `reward` follows the reward rule (the
    module docstring: every step's reward summed per component, plus `truncated()`'s; weights:
    the last ones given); `truncated` says the episode ended without `done`; `infos` holds
    each step's `StepResult.info`."""

    messages: list[dict]
    reward: Reward
    num_turns: int
    truncated: bool
    infos: list[dict]


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


class TextPolicy(EpisodePolicy):
    """A policy over text: `fn(messages) -> action text` (a script in tests, a local engine in
    `postrain eval`)."""

    def __init__(self, fn: ActionFn) -> None:
        self.fn = fn

    async def act(self, messages: list[dict]) -> str:
        """`fn` on a copy of `messages`. Cancellation: as `fn`'s; this policy keeps no state,
        so nothing of it remains."""
        return await self.fn(list(messages))


def drop_reason(exc: BaseException) -> str:
    """The short reason a caller records when it drops a sample because of `exc`."""
    if isinstance(exc, EnvironmentFailure):
        return exc.reason
    if isinstance(exc, EnvironmentContractError):
        return f"environment contract: {exc}"[:300]
    return f"environment raised {type(exc).__name__}: {exc}"[:300]


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
        raise EnvironmentFailure(drop_reason(exc)) from exc


async def checked_reset(env: Environment, task: dict, *, timeout_s: float | None = 60.0) -> list[dict]:
    """`env.reset(task)` under the contract: the first messages (a str becomes one user message).
    Raises EnvironmentFailure (raised or hung) or EnvironmentContractError (garbage).
    Cancellation: no messages; `env` may be half-reset (the caller closes it)."""
    first = validate_observation(await _guarded("reset", env.reset, task, timeout_s=timeout_s))
    return [{"role": "user", "content": first}] if isinstance(first, str) else list(first)


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
                      step_timeout_s: float | None = 60.0) -> Episode:
    """Play one episode of `env` on `task`: the one driver of training and evaluation.

    `policy` is an `EpisodePolicy`, or `fn(messages) -> action text` (wrapped in `TextPolicy`).
    The episode ends at `done`, after `env.max_turns` actions, or when `policy.can_act()` says
    no; its reward follows the reward rule of the module docstring. Raises EnvironmentFailure
    (raised/hung) or EnvironmentContractError (garbage); the caller drops the sample with
    `drop_reason(exc)`. Runs on trio. Cancellation: the episode is abandoned (the caller
    closes `env`)."""
    if not isinstance(policy, EpisodePolicy):
        policy = TextPolicy(policy)
    messages = await checked_reset(env, task, timeout_s=step_timeout_s)
    policy.begin(list(messages))
    components: dict[str, float] = {}
    weights: dict[str, float] = {}
    infos: list[dict] = []
    num_turns, done = 0, False
    while not done and num_turns < env.max_turns and policy.can_act():
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
                   truncated=not done, infos=infos)


def _accumulate(reward: Reward, components: dict, weights: dict) -> None:
    for name, x in reward.components.items():
        components[name] = components.get(name, 0.0) + x
    weights.update(reward.weights)
