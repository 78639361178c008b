"""A judge's handle over an in-process engine, no scorer actor: benches, tests, a local evaluation.

    engine = Engine(model, tokenizer, kv_cache_mb=256)
    handle = LocalChatScorer(engine)                 # async chat(messages, **sampling) -> ChatReply
    verdict = await Judge(handle, rubric).judge(output, context=question)
    await handle.score_continuations(messages, ["PASS", "FAIL"], prefix="VERDICT: ")   # a choice judge's

`chat` and `score_continuations` answer as a `ScorerActor` with serves = "generate" does (the
messages rendered with the model's chat template; one sample, or one scoring request per
continuation: actors/generator/requests.py).
Concurrent calls share the engine's steps, so they are batched as the scorer actor batches them:
each call queues its request, and whichever caller finds no step running adds every queued
request and runs one step in a worker thread, then hands out what finished; the others wait for
that step. The engine is only touched by the event loop's thread between steps, or by the one
step in its worker thread. Runs on trio or asyncio (anyio).
"""
from __future__ import annotations

import itertools
from typing import Any, Callable

import anyio

from ..generator.engine import Engine, RequestOutput
from ..generator.requests import chat_prompt, chat_reply, continuation_sequences, continuations_reply
from ..records import ChatReply, ContinuationsReply, ContinuationsRequest, SamplingParams

Add = Callable[[Engine, str], Any]   # adds one request to the engine under the given id


class LocalChatScorer:
    """The `chat` of a judge scorer over `engine` (module docstring)."""

    def __init__(self, engine: Engine) -> None:
        if engine.tokenizer is None:
            raise ValueError("LocalChatScorer renders chat messages with the engine's tokenizer, and this "
                             "engine has none; fix: Engine(model, tokenizer, ...)")
        self.engine = engine
        self._ids = itertools.count()
        # Invariants: a request id is in at most one of _queued (not yet in the engine), the
        # engine, _done (finished, not yet taken) or _abandoned (its caller left; the engine still
        # holds it, to be aborted between steps). _stepping: a step runs in a worker thread.
        self._queued: list[tuple[str, Add]] = []
        self._done: dict[str, RequestOutput] = {}
        self._abandoned: set[str] = set()
        self._stepping = False
        self._stepped = anyio.Event()

    async def chat(self, messages: list[dict], **sampling: Any) -> ChatReply:
        """The model's reply to `messages` (SamplingParams fields as keywords; one sample).
        Cancellation: no reply; the request is dropped from the queue or aborted between steps."""
        params = SamplingParams.from_wire(sampling)
        if params.n != 1:
            raise ValueError(f"a chat call gets one reply; got n = {params.n}")
        prompt = chat_prompt(self.engine.tokenizer, messages)
        (output,) = await self._run([lambda engine, request_id: engine.add_request(prompt, params, request_id=request_id)])
        return chat_reply(prompt, output)

    async def score_continuations(self, messages: list[dict], continuations: list[str], *, prefix: str = "",
                                  end_of_turn: bool = False) -> ContinuationsReply:
        """Each continuation's total logprob after `messages` and `prefix` (records/chat.py's
        ContinuationsRequest). Cancellation: as `chat`."""
        request = ContinuationsRequest(messages=list(messages), continuations=list(continuations), prefix=prefix,
                                       end_of_turn=end_of_turn)
        start, sequences = continuation_sequences(self.engine.tokenizer, request)
        outputs = await self._run([_score(ids, start) for ids in sequences])
        scores = []
        for output in outputs:
            assert output.scores is not None, "a finished scoring request has its scores"
            scores.append(output.scores)
        return continuations_reply(start, sequences, scores)

    async def _run(self, adds: list[Add]) -> list[RequestOutput]:
        """Queue each request and wait for all of them, in order. Cancellation: each is dropped from
        the queue or aborted between steps."""
        ids = [f"req-{next(self._ids)}" for _ in adds]
        self._queued.extend(zip(ids, adds))
        outputs = []
        try:
            for request_id in ids:
                outputs.append(await self._wait_for(request_id))
        except BaseException:
            for request_id in ids:
                self._leave(request_id)
            raise
        return outputs

    async def _wait_for(self, request_id: str) -> RequestOutput:
        """Step the engine, or wait for the caller that does, until `request_id` finished.
        Cancellation: as `chat` (a step already in its thread finishes first)."""
        while request_id not in self._done:
            if self._stepping:
                await self._stepped.wait()
                continue
            self._stepping = True
            try:
                self._admit()
                with anyio.CancelScope(shield=True):    # the step's outputs are others' too: never lost
                    outputs = await anyio.to_thread.run_sync(self.engine.step)
                for output in outputs:
                    if output.request_id in self._abandoned:
                        self._abandoned.discard(output.request_id)
                    else:
                        self._done[output.request_id] = output
            finally:
                self._stepping = False
                stepped, self._stepped = self._stepped, anyio.Event()
                stepped.set()
        return self._done.pop(request_id)

    def _admit(self) -> None:
        """Between steps: abort what was abandoned, add what was queued."""
        for request_id in self._abandoned:
            self.engine.abort(request_id)
        self._abandoned.clear()
        queued, self._queued = self._queued, []
        for request_id, add in queued:
            add(self.engine, request_id)

    def _leave(self, request_id: str) -> None:
        """A caller gave up on `request_id`: forget it wherever it is."""
        self._done.pop(request_id, None)
        before = len(self._queued)
        self._queued = [item for item in self._queued if item[0] != request_id]
        if len(self._queued) == before and self.engine.has_unfinished():
            if self._stepping:
                self._abandoned.add(request_id)       # aborted before the next step
            else:
                self.engine.abort(request_id)


def _score(ids: list[int], start: int) -> Add:
    return lambda engine, request_id: engine.add_score_request(ids, start, 1, request_id=request_id)
