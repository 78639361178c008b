"""Scorers as an environment sees them: handles to the run's scorer actors (actors/scorer/).

    class Essay(Environment):
        async def step(self, action):
            verdict = await self.judge(self.scorers["judge"], RUBRIC).judge(action)
            return StepResult(None, True, Reward({"rubric": verdict.reward}))

An environment actor's `scorers` option names the scorer actors its environments may ask;
each environment gets them as `self.scorers`, a read-only mapping of name -> `ScorerHandle`
(beside `self.sandbox`). A handle asks its scorer for what it serves: `chat` (a judge or a
simulated user: the reply text to chat messages, rendered with the scorer model's own
template), `score_tokens` (a teacher's rows, docs/scorers.md) or `reward` (a reward model's
scores). Each call is a hop of the episode's timeline, so the sample's trace shows it.
Environments never talk to sockets: the actor passes these handles in, and `postrain eval`
and the tests pass in-process ones with the same methods.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

from ..records import (CHAT, SCORE_REWARD, SCORE_TOKENS, ChatReply, ChatRequest, RewardScoresRequest,
                       SamplingParams, TokenScoresReply, TokenScoresRequest)
from .timeline import Timeline

SCORER_TIMEOUT_S = 600.0   # one call to a scorer, at most


@runtime_checkable
class ScorerHandle(Protocol):
    """What an environment may ask a scorer. Contract on cancellation of any call: the caller
    gets nothing; the scorer keeps no state of the call (its reply, if any, is dropped)."""

    async def chat(self, messages: list[dict], **sampling: Any) -> ChatReply:
        """The scorer model's reply to `messages` (SamplingParams fields as keywords)."""
        ...

    async def score_tokens(self, token_ids: list[list[int]], score_from: list[int],
                           top_k: int | None = None) -> TokenScoresReply:
        """The teacher's rows of each sequence from `score_from` on (docs/scorers.md)."""
        ...

    async def reward(self, token_ids: list[list[int]]) -> list[float]:
        """A reward model's score of each sequence."""
        ...


class Scorers(Mapping[str, ScorerHandle]):
    """The scorers an environment may ask, by the name the run config gives them. Asking for a
    name the actor was not given is a KeyError naming the ones it has and the option to set."""

    def __init__(self, handles: Mapping[str, ScorerHandle] | None = None):
        self._handles = dict(handles or {})

    def __getitem__(self, name: str) -> ScorerHandle:
        try:
            return self._handles[name]
        except KeyError:
            have = ", ".join(sorted(self._handles)) or "none"
            raise KeyError(f"no scorer {name!r} was given to this environment (it has: {have}); fix: add "
                           f"a ScorerActor named {name!r} to the run and name it in the environment "
                           f"actor's options, scorers = [{name!r}]") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._handles)

    def __len__(self) -> int:
        return len(self._handles)


class RemoteScorer:
    """A `ScorerHandle` over a scorer actor's ActorRef; with a `timeline`, each call is a hop of it."""

    def __init__(self, ref, timeline: Timeline | None = None):
        self.ref = ref
        self.timeline = timeline

    def for_episode(self, timeline: Timeline | None) -> "RemoteScorer":
        return RemoteScorer(self.ref, timeline)

    async def _call(self, hop: str, kind, request):
        if self.timeline is None:
            return await self.ref.call(kind, request, timeout_s=SCORER_TIMEOUT_S)
        with self.timeline.hop(hop, self.ref.name):
            return await self.ref.call(kind, request, timeout_s=SCORER_TIMEOUT_S)

    async def chat(self, messages: list[dict], **sampling: Any) -> ChatReply:
        request = ChatRequest(messages=list(messages), sampling=SamplingParams.from_wire(sampling))
        reply: ChatReply = await self._call("chat", CHAT, request)
        return reply

    async def score_tokens(self, token_ids: list[list[int]], score_from: list[int],
                           top_k: int | None = None) -> TokenScoresReply:
        request = TokenScoresRequest(token_ids=[list(t) for t in token_ids], score_from=list(score_from),
                                     top_k=top_k)
        reply: TokenScoresReply = await self._call("score_tokens", SCORE_TOKENS, request)
        return reply

    async def reward(self, token_ids: list[list[int]]) -> list[float]:
        reply = await self._call("reward", SCORE_REWARD, RewardScoresRequest(token_ids=[list(t) for t in token_ids]))
        return list(reply.scores)
