"""Scorers as an environment sees them: handles to the run's scorer actors (actors/scorer/).

    class Essay(Environment):
        async def step(self, action):
            verdict = await self.scorers.judge("judge", RUBRIC).judge(action, context=self.prompt)
            return StepResult(None, True, verdict.as_reward("rubric"))

An environment actor's `scorers` option names the scorer actors its environments may ask;
each environment gets them as `self.scorers`, a read-only mapping of name -> `ScorerHandle`
(beside `self.sandbox`). A handle asks its scorer for what it serves: `chat` (a judge or a
simulated user: the reply text to chat messages, rendered with the scorer model's own
template), `score_continuations` (a judge in choice mode: each of a few continuations' total
logprob after the messages), `score_tokens` (a teacher's rows, docs/scorers.md) or `reward` (a reward model's
scores). Each call is a hop of the episode's timeline, so the sample's trace shows it.
Environments never talk to sockets: the actor passes these handles in, and `postrain eval`
and the tests pass in-process ones with the same methods.

Judges are shared. `self.scorers.judge(name, rubric)` is the episode's view (`EpisodeJudge`) of
ONE `Judge` per (scorer, rubric digest, judge options), kept in a `SharedJudges` that the
environment actor makes once and hands to every episode's `Scorers`: so a Judge's cache sees
all the episodes' outputs, and a group whose samples repeat an output asks the judge once. Each
`judge(output)` through the view is a "judge" hop of the episode's timeline carrying the call's
record (`JudgeCall`: prompt, reply, verdict, tokens, latency, cached), failed calls too. A
`Scorers` made without a `SharedJudges` (a test, one episode) keeps its own.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

from ..records import (CHAT, SCORE_CONTINUATIONS, SCORE_REWARD, SCORE_TOKENS, ChatReply, ChatRequest,
                       ContinuationsReply, ContinuationsRequest, RewardScoresRequest, SamplingParams,
                       TokenScoresReply, TokenScoresRequest)
from ..scorer.judge import Judge, JudgeCall, JudgeFailed, JudgeVerdict
from ..scorer.rubric import Rubric
from .timeline import Timeline

SCORER_TIMEOUT_S = 600.0   # one call to a scorer, at most
MAX_SHARED_JUDGES = 256    # Judges a SharedJudges keeps (one per scorer, rubric and options), at most


@runtime_checkable
class ScorerHandle(Protocol):
    """What an environment may ask a scorer. Contract on cancellation of any call: the caller
    gets nothing; the scorer keeps no state of the call (its reply, if any, is dropped)."""

    async def chat(self, messages: list[dict], **sampling: Any) -> ChatReply:
        """The scorer model's reply to `messages` (SamplingParams fields as keywords)."""
        ...

    async def score_continuations(self, messages: list[dict], continuations: list[str], *, prefix: str = "",
                                  end_of_turn: bool = False) -> ContinuationsReply:
        """Each continuation's total logprob after `messages` (rendered with the scorer model's
        chat template, the assistant's turn opened) and `prefix` (records/chat.py)."""
        ...

    async def score_tokens(self, token_ids: list[list[int]], score_from: list[int],
                           top_k: int | None = None) -> TokenScoresReply:
        """The teacher's rows of each sequence from `score_from` on (docs/scorers.md)."""
        ...

    async def reward(self, conversations: list[list[dict]]) -> list[float]:
        """A reward model's score of each conversation (its last message the reply scored),
        rendered by the reward model's own tokenizer and chat template, at its declared scale."""
        ...


def _no_scorer(name: str, have: Iterator[str]) -> KeyError:
    names = ", ".join(sorted(have)) or "none"
    return KeyError(f"no scorer {name!r} was given to this environment (it has: {names}); fix: add "
                    f"a ScorerActor named {name!r} to the run and name it in the environment "
                    f"actor's options, scorers = [{name!r}]")


class SharedJudges:
    """The Judges the episodes of one environment actor share: one per (scorer name, rubric
    digest, judge options), made on first use over the scorer's handle as the actor holds it
    (outside any episode: each episode's `EpisodeJudge` records its own hop). At most
    `max_judges` are kept, the least recently used going first (an episode still holding one
    goes on using it; a later request makes a new one, its cache empty)."""

    def __init__(self, handles: Mapping[str, ScorerHandle], max_judges: int = MAX_SHARED_JUDGES) -> None:
        self.handles = dict(handles)
        self.max_judges = max_judges
        # Invariant: at most max_judges entries, least recently used first.
        self._judges: OrderedDict[tuple[Any, ...], Judge] = OrderedDict()

    def get(self, name: str, rubric: Rubric, **judge_options: Any) -> Judge:
        """The one Judge of `name`'s scorer, `rubric` and `judge_options` (Judge's keywords:
        cache_size, timeout_s); KeyError naming the scorers there are when `name` is none."""
        if name not in self.handles:
            raise _no_scorer(name, iter(self.handles))
        if not isinstance(rubric, Rubric):
            return Judge(self.handles[name], rubric, **judge_options)   # Judge names the error
        key = (name, rubric.digest, tuple(sorted(judge_options.items())))
        judge = self._judges.get(key)
        if judge is None:
            judge = self._judges[key] = Judge(self.handles[name], rubric, **judge_options)
            while len(self._judges) > self.max_judges:
                self._judges.popitem(last=False)
        else:
            self._judges.move_to_end(key)
        return judge

    def __len__(self) -> int:
        return len(self._judges)


class EpisodeJudge:
    """One episode's view of a shared `Judge` (`Scorers.judge`): `judge(output, context=...)`
    asks it and records a "judge" hop of the episode's timeline, actor = the scorer's name, with
    the rubric's digest and the call's record (`call`: a JudgeCall's wire map; a verdict from the
    cache or from a call another episode made shows that call with cached = true). A JudgeFailed
    is recorded in the hop (status "failed: JudgeFailed", `error`, `call`) and goes on: the
    sample is dropped with its reason, out of its group's baseline."""

    def __init__(self, shared: Judge, scorer: str, timeline: Timeline | None = None) -> None:
        self.shared = shared
        self.scorer = scorer
        self.timeline = timeline

    @property
    def rubric(self) -> Rubric:
        return self.shared.rubric

    async def judge(self, output: str | bytes, *, context: str | None = None) -> JudgeVerdict:
        """The shared Judge's verdict (`Judge.judge`), recorded as a hop. Raises JudgeFailed as it
        does. Cancellation: as `Judge.judge`; the hop records "failed: Cancelled"."""
        if self.timeline is None:
            return await self.shared.judge(output, context=context)
        with self.timeline.hop("judge", self.scorer, rubric=self.shared.rubric.digest) as hop:
            try:
                verdict = await self.shared.judge(output, context=context)
            except JudgeFailed as exc:
                hop["error"] = exc.reason
                if exc.call is not None:
                    hop["call"] = judge_call_info(exc.call)
                raise
            hop["call"] = judge_call_info(verdict.call)
        return verdict


def judge_call_info(call: JudgeCall) -> dict[str, Any]:
    """A judge call as a hop carries it: the JudgeCall's wire map (plain data; `cached` always)."""
    return {"cached": False, **call.to_wire()}


class Scorers(Mapping[str, ScorerHandle]):
    """The scorers an environment may ask, by the name the run config gives them. Asking for a
    name the actor was not given is a KeyError naming the ones it has and the option to set.
    `judges`: the environment actor's SharedJudges (None: this Scorers keeps its own, over
    `handles`); `timeline`: the episode's, where `judge` records its hops."""

    def __init__(self, handles: Mapping[str, ScorerHandle] | None = None, *,
                 judges: SharedJudges | None = None, timeline: Timeline | None = None) -> None:
        self._handles = dict(handles or {})
        self.judges = judges if judges is not None else SharedJudges(self._handles)
        self.timeline = timeline

    def judge(self, name: str, rubric: Rubric, **judge_options: Any) -> EpisodeJudge:
        """This episode's view of the one Judge of scorer `name` and `rubric` that every episode
        of the environment actor shares (`judge_options`: Judge's cache_size, timeout_s)."""
        if name not in self._handles:
            raise _no_scorer(name, iter(self._handles))
        return EpisodeJudge(self.judges.get(name, rubric, **judge_options), name, self.timeline)

    def __getitem__(self, name: str) -> ScorerHandle:
        try:
            return self._handles[name]
        except KeyError:
            raise _no_scorer(name, iter(self._handles)) from None

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

    async def score_continuations(self, messages: list[dict], continuations: list[str], *, prefix: str = "",
                                  end_of_turn: bool = False) -> ContinuationsReply:
        request = ContinuationsRequest(messages=list(messages), continuations=list(continuations), prefix=prefix,
                                       end_of_turn=end_of_turn)
        reply: ContinuationsReply = await self._call("score_continuations", SCORE_CONTINUATIONS, request)
        return reply

    async def score_tokens(self, token_ids: list[list[int]], score_from: list[int],
                           top_k: int | None = None) -> TokenScoresReply:
        request = TokenScoresRequest(token_ids=[list(t) for t in token_ids], score_from=list(score_from),
                                     top_k=top_k)
        reply: TokenScoresReply = await self._call("score_tokens", SCORE_TOKENS, request)
        return reply

    async def reward(self, conversations: list[list[dict]]) -> list[float]:
        request = RewardScoresRequest(conversations=[list(conversation) for conversation in conversations])
        reply = await self._call("reward", SCORE_REWARD, request)
        return list(reply.scores)
