"""The scorer actor: a frozen model beside the policy, served by the generator's engine.

    [[actors]]
    name = "teacher"
    cls = "postrain.actors.scorer:ScorerActor"
    options = { model = "runs/teacher/export", serves = "logprobs", top_k = 32 }

Options: `ScorerOptions` below. One scorer serves one use (`serves`):
- "logprobs" (a teacher, or the KL reference): `score_tokens` TokenScoresRequest ->
  TokenScoresReply, each sequence's rows from `score_from` on: the top_k ids and logprobs, the
  tail's log-mass and the actual token's logprob (postrain.actors.records.scorer). Each sequence
  is one scoring request of the engine (actors/generator/scoring.py): batched with the others,
  its prompt's blocks found in the prefix cache (the samples of a group share their prompt),
  chunked with `prefill_chunk_tokens`; nothing is sampled.
- "generate" (a judge, a simulated user): `generate` GenerateRequest -> GenerateReply exactly as
  a generator answers it (actors/generator/requests.py), and `chat` ChatRequest -> ChatReply
  (the messages rendered with the model's chat template, one sample's text), and
  `score_continuations` ContinuationsRequest -> ContinuationsReply (the same rendering, then
  each continuation's total logprob from one scoring request each: a judge in choice mode).
- "reward" (a reward model): `score_reward` RewardScoresRequest -> RewardScoresReply, the score
  head of a `*ForSequenceClassification` folder on each sequence's last token
  (postrain.actors.models.reward_model).
A message for a use it does not serve is refused with a `ScorerError` naming its `serves`.
Scorers hold frozen weights: there is no `load_weights`, and every reply's policy_version is 0.

Design note. As in the generator actor, one task owns the engine: handlers only queue engine
work (a function that adds a request under a given id) and wait for an event; the engine loop
adds the queued work between steps, aborts the requests whose callers went away, and runs each
step in a compute thread, so requests that arrive during a step join the next one. The
reward model has no engine: each request is scored whole in a compute thread, one at a time.
"""
from __future__ import annotations

import itertools
import json
from typing import Annotated, Any, Callable, Literal

import anyio
from pydantic import AfterValidator, Field, model_validator

from postrain.core import Actor, Load, Options, handler
from postrain.core.config import auto_means_unset
from postrain.core.errors import PostrainError

from ..generator.engine import Engine, RequestOutput
from ..generator.requests import (Waiter, chat_prompt, chat_reply, continuation_sequences, continuations_reply,
                                  engine_prompt, generate_reply)
from ..models.device import resolve_device
from ..models.loading import check_model_spec, load_model, model_config
from ..records import (CHAT, GENERATE, SCORE_CONTINUATIONS, SCORE_REWARD, SCORE_TOKENS, ChatReply, ChatRequest,
                       ContinuationsReply, ContinuationsRequest, GenerateReply,
                       GenerateRequest, RewardScoresReply, RewardScoresRequest, SamplingParams, SequenceScores,
                       TokenScoresReply, TokenScoresRequest)

SERVES = ("logprobs", "generate", "reward")
# What each use answers, for the refusal of a message it does not serve.
_ANSWERS = {"logprobs": "score_tokens", "generate": "generate, chat and score_continuations",
            "reward": "score_reward"}


class ScorerError(PostrainError, ValueError):
    """A message this scorer does not serve, or a scorer that cannot serve what it is declared for."""



class ScorerOptions(Options):
    not_shared = frozenset({"model"})   # its own model, never the policy's [shared] one
    model: Annotated[str | dict, AfterValidator(check_model_spec)] = Field(
        description="the frozen model: a built-in name, a Hugging Face folder, a .gguf file, or ModelConfig "
        "fields (any spec the generator takes); for serves = \"reward\", a *ForSequenceClassification folder")
    serves: Literal["logprobs", "generate", "reward"] = Field(
        "logprobs", description="what it answers: \"logprobs\" (a teacher or reference: score_tokens, top-k "
        "logprobs of every token), \"generate\" (a judge: generate and chat, as a frozen generator) or "
        "\"reward\" (a reward model: score_reward)")
    top_k: int = Field(32, ge=1, description="serves = \"logprobs\": ids kept per token (1 .. the vocabulary), "
                       "unless a request asks for its own")
    seed: int = Field(0, description="init of a from-scratch model; the base of per-request sampling seeds")
    kv_cache_mb: float = Field(64, gt=0, description="memory of the paged KV cache, MiB (serves = \"logprobs\" "
                               "or \"generate\"); unset or \"auto\": `postrain up` sizes it from the scorer's "
                               "model, max_num_seqs and the longest rollout, as a generator's (64 where "
                               "nothing sizes it)")
    max_num_seqs: int = Field(32, ge=1, description="sequences in one engine step at most (the batch)")
    max_num_batched_tokens: int = Field(4096, ge=1, description="new tokens in one engine step at most (a "
                                        "longer sequence runs alone); a scoring step keeps every position's "
                                        "logits, so this bounds that step's logits at this many x vocab floats")
    prefill_chunk_tokens: int = Field(0, ge=0, description="tokens read per engine step at most (chunked "
                                      "prefill; docs/long-context.md); 0 = a whole sequence in one step")
    kv_dtype: Literal["float32", "bfloat16", "int8", "float8_e4m3"] = Field(
        "float32", description="how the KV cache stores keys and values (as the generator's kv_dtype); "
        "a narrower one holds more blocks, the logprobs drift by the rounding")
    reward_scale: float = Field(1.0, description="serves = \"reward\": each score is reward_scale * score + "
                                "reward_offset (the declared scale of the reward model's raw score)")
    reward_offset: float = Field(0.0, description="serves = \"reward\": added to each scaled score")
    device: str = Field("auto", description="'auto' (the GPU the scheduler placed it on, where its spec has "
                        "gpus = 1; else the CPU), 'cpu', 'cuda' or 'cuda:N': where the model and its cache are")

    @model_validator(mode="before")
    @classmethod
    def _auto_means_unset(cls, data: Any) -> Any:
        return auto_means_unset(data, {"kv_cache_mb"})

    @model_validator(mode="after")
    def _the_model_serves_it(self) -> "ScorerOptions":
        """Names and configs only (no weights), so `--dry-run` names a model that cannot serve."""
        from ..models.reward_model import check_reward_model_spec

        if self.serves == "reward":
            check_reward_model_spec(self.model)
            return self
        if _is_reward_folder(self.model):
            raise ValueError(f"model {self.model!r} is a reward model (*ForSequenceClassification: a score "
                             f"head, no LM head), which serves \"reward\" only, not {self.serves!r}; set "
                             "serves = \"reward\", or name a causal LM")
        if self.serves == "logprobs":
            vocab = model_config(self.model).vocab_size
            if self.top_k > vocab:
                raise ValueError(f"top_k = {self.top_k} is more than the model's vocabulary ({vocab}); "
                                 f"set top_k to at most {vocab}")
        return self


def _is_reward_folder(spec: str | dict) -> bool:
    """A Hugging Face folder whose config.json names only `*ForSequenceClassification` classes."""
    from pathlib import Path

    from ..models.loading import resolve_model

    if isinstance(spec, dict):
        return False
    config = Path(resolve_model(spec)) / "config.json"
    if not config.is_file():
        return False
    try:
        names = json.loads(config.read_text()).get("architectures") or []
    except (ValueError, AttributeError):
        return False
    return bool(names) and all(str(n).endswith("ForSequenceClassification") for n in names)


class ScorerActor(Actor):
    Options = ScorerOptions

    async def setup(self) -> None:
        """Load the model; for "logprobs" and "generate" build the engine and start its loop.
        Cancelled: the process is ending (a start past its timeout), so nothing outlives it."""
        options = self.options
        device = resolve_device(options.device)
        self.serves: str = options.serves
        self.model_name = options.model if isinstance(options.model, str) else json.dumps(options.model,
                                                                                           sort_keys=True)
        self._request_ids = itertools.count()
        self._new_requests: list[tuple[str, Callable[[Engine, str], Any]]] = []
        self._waiters: dict[str, Waiter] = {}       # request id -> its caller, until answered
        self._in_engine: set[str] = set()            # request ids the engine holds
        self._work = anyio.Event()
        self._reward_lock = anyio.Lock()
        self._num_reward_waiting = 0
        self._num_reward_running = 0
        self.engine: Engine | None = None
        if self.serves == "reward":
            from ..models.reward_model import load_reward_model

            assert isinstance(options.model, str), "a reward model is a folder (the options' check)"
            self.reward_model = load_reward_model(options.model, device=device)
            return
        self.model, self.tokenizer = load_model(options.model, seed=options.seed, device=device)
        vocab = self.model.config.vocab_size
        if options.serves == "logprobs" and options.top_k > vocab:
            raise ScorerError(f"top_k = {options.top_k} is more than the model's vocabulary ({vocab}); "
                              f"set top_k to at most {vocab}")
        self.engine = Engine(self.model, self.tokenizer, kv_cache_mb=options.kv_cache_mb,
                             max_num_seqs=options.max_num_seqs,
                             max_num_batched_tokens=options.max_num_batched_tokens, seed=options.seed,
                             prefill_chunk_tokens=options.prefill_chunk_tokens, kv_dtype=options.kv_dtype)
        self.node.spawn(self._engine_loop)

    # ------------------------------------------------------------------ handlers

    @handler(SCORE_TOKENS, concurrent=True)
    async def score_tokens(self, request: TokenScoresRequest) -> TokenScoresReply:
        """Each sequence's rows (serves = "logprobs"). Cancelled: its sequences still queued or in
        the engine are aborted at the next step."""
        self._refuse_unless("logprobs", SCORE_TOKENS.name)
        top_k = request.top_k if request.top_k is not None else self.options.top_k
        adds = [_score_request(_token_ids(ids), start, top_k)
                for ids, start in zip(request.token_ids, request.score_from)]
        outputs = await self._run_in_engine(adds)
        sequences = []
        for out in outputs:
            assert out.scores is not None, "a finished scoring request has its scores"
            rows = out.scores
            sequences.append(SequenceScores(topk_ids=rows.topk_ids, topk_logprobs=rows.topk_logprobs,
                                            tail_logmass=rows.tail_logmass, token_logprobs=rows.token_logprobs))
        return TokenScoresReply(sequences=sequences, model=self.model_name)

    @handler(GENERATE, concurrent=True)
    async def generate(self, request: GenerateRequest) -> GenerateReply:
        """Samples as a generator gives them (serves = "generate"), at policy version 0.
        Cancelled: the request is aborted at the next step."""
        self._refuse_unless("generate", GENERATE.name)
        (out,) = await self._run_in_engine([_generate_request(engine_prompt(request), request.sampling)])
        return generate_reply(out)

    @handler(CHAT, concurrent=True)
    async def chat(self, request: ChatRequest) -> ChatReply:
        """The reply to chat messages, rendered with the model's chat template (serves =
        "generate"). Cancelled: the request is aborted at the next step."""
        self._refuse_unless("generate", CHAT.name)
        if request.sampling.n != 1:
            raise ScorerError(f"a chat request gets one reply; got sampling.n = {request.sampling.n} (send n "
                              "requests, or a generate request for n samples)")
        if self.tokenizer is None:
            raise ScorerError(f"scorer {self.name!r}: model {self.model_name!r} has no tokenizer to render chat "
                              "messages with; name a model folder with tokenizer.json")
        prompt = chat_prompt(self.tokenizer, request.messages)
        (out,) = await self._run_in_engine([_generate_request(prompt, request.sampling)])
        return chat_reply(prompt, out)

    @handler(SCORE_CONTINUATIONS, concurrent=True)
    async def score_continuations(self, request: ContinuationsRequest) -> ContinuationsReply:
        """Each continuation's total logprob after the messages and the prefix (serves =
        "generate"; actors/generator/requests.py's `continuation_sequences`): one scoring request
        each, the shared prompt found in the prefix cache. Cancelled: as `chat`."""
        self._refuse_unless("generate", SCORE_CONTINUATIONS.name)
        if self.tokenizer is None:
            raise ScorerError(f"scorer {self.name!r}: model {self.model_name!r} has no tokenizer to render chat "
                              "messages with; name a model folder with tokenizer.json")
        start, sequences = continuation_sequences(self.tokenizer, request)
        outputs = await self._run_in_engine([_score_request(ids, start, 1) for ids in sequences])
        scores = []
        for out in outputs:
            assert out.scores is not None, "a finished scoring request has its scores"
            scores.append(out.scores)
        return continuations_reply(start, sequences, scores)

    @handler(SCORE_REWARD, concurrent=True)
    async def score_reward(self, request: RewardScoresRequest) -> RewardScoresReply:
        """The reward model's score of each sequence (serves = "reward"), one request at a time.
        Cancelled while waiting: nothing is scored; while scoring: the scoring finishes in its
        thread and its result is dropped."""
        self._refuse_unless("reward", SCORE_REWARD.name)
        token_ids = (self._rendered(request.conversations) if request.conversations is not None
                     else [_token_ids(ids) for ids in request.token_ids or []])
        waiting = True
        self._num_reward_waiting += 1
        try:
            async with self._reward_lock:
                self._num_reward_waiting -= 1
                waiting = False
                self._num_reward_running += 1
                try:
                    scores = await self.in_compute_thread(self.reward_model.score, token_ids)
                finally:
                    self._num_reward_running -= 1
        finally:
            if waiting:                            # cancelled before its turn
                self._num_reward_waiting -= 1
        scale, offset = self.options.reward_scale, self.options.reward_offset
        return RewardScoresReply(scores=[scale * float(score) + offset for score in scores])

    def _rendered(self, conversations: list[list[dict]]) -> list[list[int]]:
        """Each conversation's token ids by the reward model's own tokenizer and chat template (its
        last message the reply scored, so no generation prompt after it)."""
        tokenizer = self.reward_model.tokenizer
        if tokenizer is None:
            raise ScorerError(f"reward model {self.options.model!r} has no tokenizer.json, so it cannot read "
                              "conversations; send token ids in its vocabulary, or add its tokenizer files")
        return [tokenizer.encode(tokenizer.apply_chat_template(conversation, add_generation_prompt=False))
                for conversation in conversations]

    def load(self) -> Load:
        """Requests queued and in the engine (or being scored by the reward model), with the KV
        cache's utilisation and prefix hit rate; `serves` among the figures."""
        if self.engine is None:
            return super().load().replace(queued=self._num_reward_waiting, running=self._num_reward_running,
                                          figures={"serves": self.serves})
        stats = self.engine.stats()
        waiting = stats["num_waiting"]
        figures = {"serves": self.serves, "kv_utilization": round(stats["kv_utilization"], 3),
                   "prefix_hit_rate": round(stats["prefix_hit_rate"], 3)}
        return super().load().replace(queued=waiting + len(self._new_requests),
                                      running=max(0, len(self._in_engine) - waiting), figures=figures)

    # ------------------------------------------------------------------ the engine's side

    def _refuse_unless(self, use: str, kind: str) -> None:
        if self.serves != use:
            raise ScorerError(f"scorer {self.name!r} serves {self.serves!r} (it answers {_ANSWERS[self.serves]}), "
                              f"not {kind!r}: a {kind} goes to a scorer with serves = {use!r}; fix: send it to "
                              f"such a scorer, or declare this one with serves = {use!r}")

    async def _run_in_engine(self, adds: list[Callable[[Engine, str], Any]]) -> list[RequestOutput]:
        """Queue each `add(engine, request_id)` for the engine loop and wait for all of them; the
        first error of any is raised. Cancelled (or on an error): the waiters are dropped, so the
        loop aborts their requests at its next pass."""
        ids = [str(next(self._request_ids)) for _ in adds]
        waiters = [self._waiters.setdefault(request_id, Waiter()) for request_id in ids]
        self._new_requests.extend(zip(ids, adds))
        self._work.set()
        try:
            for waiter in waiters:
                await waiter.done.wait()
                if waiter.error is not None:
                    raise waiter.error
        finally:
            for request_id in ids:
                self._waiters.pop(request_id, None)
        outputs = [waiter.output for waiter in waiters]
        assert all(out is not None for out in outputs), "the engine loop sets the output or the error before done"
        return [out for out in outputs if out is not None]

    async def _engine_loop(self) -> None:
        """Add queued requests, abort abandoned ones, step the engine, hand out what finished.
        Cancelled (the actor stops): a step already in its thread finishes (it cannot be
        abandoned), then the loop ends; waiting callers are never answered."""
        engine = self.engine
        assert engine is not None, "the loop runs only where setup built an engine"
        while True:
            if not (self._new_requests or engine.has_unfinished()):
                await self._work.wait()
                self._work = anyio.Event()
            requests, self._new_requests = self._new_requests, []
            for request_id, add in requests:
                if request_id not in self._waiters:       # its caller already gave up
                    continue
                try:
                    add(engine, request_id)
                    self._in_engine.add(request_id)
                except Exception as exc:  # reported to the caller
                    self._finish(request_id, None, exc)
            for request_id in self._in_engine - self._waiters.keys():
                engine.abort(request_id)  # its caller was cancelled
                self._in_engine.discard(request_id)
            if engine.has_unfinished():
                for output in await self.in_compute_thread(engine.step):
                    self._in_engine.discard(output.request_id)
                    self._finish(output.request_id, output, None)

    def _finish(self, request_id: str, output: RequestOutput | None, error: Exception | None) -> None:
        waiter = self._waiters.get(request_id)
        if waiter is not None:
            waiter.output, waiter.error = output, error
            waiter.done.set()


def _token_ids(ids: Any) -> list[int]:
    """A sequence's ids as ints (a record's `Vector`: a list, a numpy array or a tensor)."""
    return [int(t) for t in ids]


def _score_request(token_ids: list[int], score_from: int, top_k: int) -> Callable[[Engine, str], Any]:
    """What the engine loop runs to add one sequence to score."""
    return lambda engine, request_id: engine.add_score_request(token_ids, score_from, top_k, request_id=request_id)


def _generate_request(prompt: list[int] | str, params: SamplingParams) -> Callable[[Engine, str], Any]:
    """What the engine loop runs to add one prompt to sample."""
    return lambda engine, request_id: engine.add_request(prompt, params, request_id=request_id)
