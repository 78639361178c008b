"""`AgentEnvironment`: an episode is any agent program that calls the OpenAI API.

    class MyAgent(AgentEnvironment):
        async def run(self, client, task) -> Reward:        # client: openai.AsyncOpenAI
            reply = await client.chat.completions.create(model=self.model, messages=[...])
            return Reward({"correct": float(check(reply, task))})

The environment actor plays it (`agent_rollout`): it opens an episode on the run's gateway
actor (postrain.actors.gateway), whose API key is the episode's own, hands `run` an
`openai.AsyncOpenAI` at the gateway's base URL with that key, and when `run` returns its
Reward, closes the episode and gets its segments: the exact ids the generator sampled, in the
contexts it sampled them (token-in/token-out, actors/gateway/episodes.py). `self.model` is the
model id to send.

`run` is asyncio code (the OpenAI client and agent frameworks such as the OpenAI Agents SDK or
LangGraph run on asyncio), so each episode runs on its own asyncio loop in a worker thread;
the actor's trio loop keeps serving meanwhile. Tools that run code use `self.sandbox` as any
environment does (its calls go to the sandbox actor).

Every segment trains: an episode whose harness rewrote its history is several segments; the
rollout's own lists are its last (the one that holds the final answer) and `earlier_segments`
the others, oldest first (records/rollout.py). The orchestrator trains each as its own sample
with the episode's reward. No trained token was sampled in a context other than the one it is
trained in.
"""
from __future__ import annotations

import uuid

import anyio
import anyio.to_thread

from ..records import (CLOSE_EPISODE, OPEN_EPISODE, CloseEpisode, EpisodeSegment, GatewayAddress, OpenEpisode,
                       Rollout, RolloutSegment)
from .timeline import Timeline
from .api import Environment, EnvironmentContractError, EnvironmentFailure, Reward, StepResult, show_value

DEFAULT_GATEWAY = "gateway"   # the gateway actor's name an agent task uses


class AgentEnvironment(Environment):
    """Subclass this and write `async def run(self, client, task) -> Reward` (asyncio code).
    `reset` and `step` are not used: the agent drives its own turns through the API."""

    model: str = "policy"          # the model id clients send; set to the gateway's before `run`
    timeout_s: float = 600.0       # one episode's time limit, seconds

    async def run(self, client, task: dict) -> Reward:
        """Play `task` with `client` (an openai.AsyncOpenAI whose key is this episode's); return its
        Reward. Contract on cancellation (the episode past `timeout_s`): the episode is dropped."""
        raise NotImplementedError(f"{type(self).__name__} must define async run(self, client, task)")

    async def reset(self, task: dict):
        raise EnvironmentContractError(f"{type(self).__name__} is an AgentEnvironment: its episodes run "
                                       "through run(client, task) on a gateway, not reset/step")

    async def step(self, action: str) -> StepResult:
        return await self.reset({})


def run_in_asyncio(env: AgentEnvironment, base_url: str, key: str, task: dict) -> Reward:
    """`env.run` on a fresh asyncio loop (this thread's), with a client for the episode."""
    import asyncio

    import openai

    async def main():
        client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=2, timeout=env.timeout_s)
        try:
            return await asyncio.wait_for(env.run(client, task), env.timeout_s)
        finally:
            await client.close()
    return asyncio.run(main())


async def agent_rollout(env: AgentEnvironment, task: dict, gateway, address: GatewayAddress,
                        timeline: Timeline, env_actor: str = "env") -> Rollout:
    """One agent episode through the gateway as a Rollout (the module's design note); its
    timeline's episode hop is `env_actor`'s, each model call a hop to the gateway. Raises
    EnvironmentFailure when the agent raises, returns no Reward or makes no model call.
    Cancellation: the episode's worker thread is abandoned (its calls end with their own
    timeouts) and the gateway's episode is left to its bound on open episodes."""
    key = f"episode-{uuid.uuid4().hex}"
    await gateway.call(OPEN_EPISODE, OpenEpisode(key=key))
    env.model = address.model
    try:
        with timeline.hop("episode", env_actor, agent=type(env).__name__) as hop:
            try:
                reward = await anyio.to_thread.run_sync(run_in_asyncio, env, address.base_url, key, task,
                                                        abandon_on_cancel=True)
            except Exception as exc:
                raise EnvironmentFailure(f"{type(env).__name__}.run raised {type(exc).__name__}: {exc}") from exc
            if not isinstance(reward, Reward):
                raise EnvironmentContractError(f"{type(env).__name__}.run must return a Reward, got "
                                               f"{show_value(reward)}; fix: return Reward({{'correct': 1.0}})")
    finally:
        with anyio.CancelScope(shield=True):
            closed = await gateway.call(CLOSE_EPISODE, CloseEpisode(key=key))
    segments = closed.segments
    hop.update(num_turns=closed.num_calls, num_segments=len(segments), num_calls=closed.num_calls)
    if not segments:
        raise EnvironmentFailure(f"{type(env).__name__}.run made no model call; fix: call the client it is "
                                 f"given (its key is the episode's), with model=self.model")
    for index, segment in enumerate(segments):
        for call in segment.calls:
            timeline.hops.append({"hop": "generate", "actor": gateway.name, "start": call.start,
                                  "duration_ms": call.duration_ms, "num_tokens": call.num_tokens,
                                  "policy_versions": call.policy_versions, "segment": index})
    return segments_rollout(segments, reward, timeline.to_list())


def segments_rollout(segments: list[EpisodeSegment], reward: Reward, timeline: list[dict] | None = None) -> Rollout:
    """The Rollout of an agent episode's gateway segments (oldest first): its own lists the last
    segment's, `earlier_segments` the others (every one is trained)."""
    *earlier, last = segments
    return Rollout(token_ids=last.token_ids, loss_mask=last.loss_mask,
                   behavior_logprobs=last.behavior_logprobs, policy_versions=last.policy_versions,
                   reward=reward, num_turns=sum(len(s.calls) for s in segments),
                   num_policy_tokens=sum(last.loss_mask), timeline=list(timeline or []),
                   earlier_segments=[segment_record(s) for s in earlier] or None)


def segment_record(segment: EpisodeSegment) -> RolloutSegment:
    """A gateway segment (actors/gateway/episodes.py) as the rollout's record of it."""
    return RolloutSegment(token_ids=segment.token_ids, loss_mask=segment.loss_mask,
                          behavior_logprobs=segment.behavior_logprobs,
                          policy_versions=segment.policy_versions, num_policy_tokens=sum(segment.loss_mask))
