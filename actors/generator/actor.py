"""The generator actor: the engine behind the microkernel.

    [[actors]]
    name = "generator"
    cls = "postrain.actors.generator:GeneratorActor"
    options = { model = "tiny", kv_cache_mb = 64, max_num_seqs = 32, seed = 0 }

Options: `GeneratorOptions` below (model and seed usually come from [shared]).

Messages:
Every body and reply is a record of postrain.actors.records:
- `generate` GenerateRequest {"prompt_ids": [int] (or "prompt": str), "sampling": {SamplingParams fields}}
  -> GenerateReply {"prompt_len", "samples": [{"token_ids", "logprobs", "policy_versions",
  "finish_reason", "text"}]}: exact sampled ids, their logprobs (see
  postrain.actors.generator.sampling) and the policy version that sampled each token.
- `load_weights` WeightSync {"version": v, "weights": {name: tensor}} -> WeightSyncReply: swapped in
  between two engine steps; in-flight sequences go on, and tokens sampled afterwards
  carry v. A version lower than the current one is refused. A chunked sync (bodies that
  add "chunk" and "num_chunks", from a learner on another host) is assembled and swapped
  in with its last chunk; until then the reply is {"version": held, "complete": false}
  (postrain.actors.weights.assembly: order, and a sync dropped for a newer one). From a
  learner on another node each chunk's tensors come on the sealed channel ("sealed").
  A sync with a "patch" (LoRA adapters, or the elements changed since the version held) is
  turned into the whole weights and loaded only if their digest is the learner's; else it is
  refused and the weights held stay (postrain.actors.weights.patch).
- `digest` (no body) -> WeightsDigest {"version", "digest"}: a sha256 of the weights held.
- `weights_channel` (no body) -> WeightsChannel {"address"}: where a learner on another node sends sealed weights
  (opened on the first ask; core/sealed.py).
- `stats` (no body) -> GeneratorStats: the engine's KV utilisation, batch size, queue depth, tokens/s.

Design note. One task owns the engine. Handlers never touch it: they queue
requests and weights, and wait for an event. The engine task drains the
queues between steps and runs each step in a worker thread, so the event loop
keeps answering (heartbeats, new requests) while the model computes; requests
that arrive during a step join the batch at the next one (continuous batching).
"""
from __future__ import annotations

import itertools
from typing import Annotated, Literal

import anyio
import anyio.to_thread
from pydantic import AfterValidator, Field, model_validator

from postrain.core import Actor, Load, Options, handler
from postrain.core.config import auto_means_unset

from ..models.device import resolve_device
from ..models.loading import check_model_spec, load_model
from ..records import (GENERATE, GENERATOR_STATS, LOAD_WEIGHTS, WEIGHTS_CHANNEL, WEIGHTS_DIGEST,
                       GenerateReply, GenerateRequest, GeneratorStats, WeightsChannel, WeightsDigest, WeightSync,
                       WeightSyncReply)
from ..weights import WeightReceiver, model_weights, weights_digest
from .engine import Engine
from .requests import Waiter, engine_prompt, generate_reply
from .sampling import SamplingParams
from .speculative import SpeculativeOptions



class GeneratorOptions(Options):
    model: Annotated[str | dict, AfterValidator(check_model_spec)] = Field(
        "tiny", description="the policy: a built-in name, a Hugging Face folder, a "
        ".gguf file, or ModelConfig fields (the learner's must match)")
    seed: int = Field(0, description="init of a from-scratch model; the base of per-request sampling seeds")
    kv_cache_mb: float = Field(64, gt=0, description="memory of the paged KV cache, MiB; unset or \"auto\": "
                               "derived from the model and the run where `postrain up` sizes it "
                               "(docs/your-model.md#sizing), else 64")
    max_num_seqs: int = Field(32, ge=1, description="sequences decoded together at most (the batch)")
    prefill_chunk_tokens: int = Field(0, ge=0, description="prompt tokens read per engine step at most, "
                                      "so decoding keeps its pace while a long prompt is read (chunked "
                                      "prefill; docs/long-context.md); 0 = a whole prompt in one step")
    kv_dtype: Literal["float32", "bfloat16", "int8", "float8_e4m3"] = Field(
        "float32", description="how the KV cache stores keys and values: 'bfloat16' halves a token's "
        "bytes, 'int8' / 'float8_e4m3' (8-bit codes, a scale per token and head) about quarter them, so "
        "kv_cache_mb holds that many more blocks; logprobs drift by the rounding (docs/long-context.md)")
    weight_precision: Literal["float32", "float16"] = Field("float32", description="'float16': sample "
                                                            "with float16 weight copies (x86 CPU; see Engine)")
    device: str = Field("auto", description="'auto' (the GPU the scheduler placed it on, where its spec "
                        "has gpus = 1; else the CPU), 'cpu', 'cuda' or 'cuda:N': where the model, the KV "
                        "cache and the sampling are")
    exact: bool = Field(False, description="batch-invariant ops: each sampled token's logprob equals the "
                        "learner's recomputation bit for bit (set `exact = true` in [shared]; float32 weights "
                        "and cache; docs/exactness.md)")
    speculative: SpeculativeOptions | None = Field(None, description="draft and verify tokens (exact: "
                                                   "same distribution and logprobs); None = off. Example: "
                                                   "{ method = \"ngram\", num_draft_tokens = 4 }")

    @model_validator(mode="before")
    @classmethod
    def _auto_means_unset(cls, data):
        return auto_means_unset(data, {"kv_cache_mb"})

    @model_validator(mode="after")
    def _exact_settings(self):
        """What an exact engine cannot run with, refused at load (Engine's own check)."""
        if self.exact:
            Engine.exact_backend(self.weight_precision, self.kv_dtype, None)
        return self


class GeneratorActor(Actor):
    Options = GeneratorOptions
    needs_bulk_key = True         # opens the sealed weights the learner publishes (core/identity.py)

    async def setup(self):
        """Load the model, build the engine, start the engine loop. Cancelled: the process is
        ending (a start past its timeout), so nothing outlives it."""
        options = self.options
        self.model, self.tokenizer = load_model(options.model, seed=options.seed,
                                                device=resolve_device(options.device))
        self.engine = Engine(self.model, self.tokenizer, kv_cache_mb=options.kv_cache_mb,
                             max_num_seqs=options.max_num_seqs, seed=options.seed,
                             prefill_chunk_tokens=options.prefill_chunk_tokens, kv_dtype=options.kv_dtype,
                             weight_precision=options.weight_precision, speculative=options.speculative,
                             exact=options.exact)
        self._request_ids = itertools.count()
        self._new_requests: list[tuple[str, list[int] | str, SamplingParams, list[bytes]]] = []
        self._waiters: dict[str, Waiter] = {}       # request id -> its caller, until answered
        self._in_engine: set[str] = set()            # request ids the engine holds
        self._new_weights: list[tuple[dict, int, anyio.Event, list]] = []
        self.receiver = WeightReceiver(self.node.keys, self.address)   # the sync protocol's receiving end
        self._work = anyio.Event()
        self.node.spawn(self._engine_loop)

    async def teardown(self):
        """Close the sealed channel, if open. Does not wait."""
        self.receiver.close()

    @handler(GENERATE, concurrent=True)
    async def generate(self, request: GenerateRequest) -> GenerateReply:
        """Cancelled: the request is aborted at the next step."""
        params = request.sampling
        prompt = engine_prompt(request)
        request_id = str(next(self._request_ids))
        waiter = self._waiters[request_id] = Waiter()
        self._new_requests.append((request_id, prompt, params, request.images or []))
        self._work.set()
        try:
            await waiter.done.wait()
        finally:
            self._waiters.pop(request_id, None)
        if waiter.error is not None:
            raise waiter.error
        out = waiter.output
        assert out is not None, "the engine loop sets the output or the error before done"
        return generate_reply(out)

    @handler(LOAD_WEIGHTS)
    async def load_weights(self, sync: WeightSync) -> WeightSyncReply:
        """Swap in the weights (a whole sync, or the last chunk of one) at the engine loop's next
        safe point. Cancelled: not withdrawn; the engine loop still loads them (whole, in its
        thread), only the reply is lost. A chunk that does not complete its sync does not wait."""
        version = sync.version
        held = max([self.engine.policy_version] + [queued[1] for queued in self._new_weights])
        weights = await self.receiver.receive(sync, held, self._held_weights)
        if weights is None:
            return WeightSyncReply(version=self.engine.policy_version, complete=False)
        result: list[Exception]   # the engine loop's error applying them, if any
        applied, result = anyio.Event(), []
        self._new_weights.append((weights, version, applied, result))
        self._work.set()
        await applied.wait()
        if result and isinstance(result[0], Exception):
            raise result[0]
        return WeightSyncReply(version=version)

    def _held_weights(self) -> dict:
        """The engine's weights now ({HF name: tensor}, no tied duplicate): what a patch applies to."""
        return model_weights(self.engine.model)

    @handler(WEIGHTS_DIGEST)
    async def digest(self, body: None) -> WeightsDigest:
        """The version held and a sha256 of the engine's weights (the learner's publish.weights_digest).
        Does not wait (cancel-safe)."""
        return WeightsDigest(version=self.engine.policy_version, digest=weights_digest(self._held_weights()))

    @handler(WEIGHTS_CHANNEL)
    async def weights_channel(self, body: None) -> WeightsChannel:
        """The address of this actor's sealed channel for weights (opened now if not yet). Does not
        wait (cancel-safe)."""
        return WeightsChannel(address=self.receiver.channel_address())

    @handler(GENERATOR_STATS)
    async def stats(self, body: None) -> GeneratorStats:
        """The engine's counters. Does not wait (cancel-safe)."""
        return GeneratorStats.from_wire(self.engine.stats())

    def load(self) -> Load:
        """Requests waiting for a batch slot and decoding (not a pool: its batch does not resize);
        with speculative decoding, its acceptance rate, tokens per verify step and draft time share."""
        stats = self.engine.stats()
        figures = {"kv_utilization": round(stats["kv_utilization"], 3), "policy_version": stats["policy_version"]}
        if self.engine.speculative is not None:
            figures.update({name: round(stats[name], 3) for name in
                            ("acceptance_rate", "tokens_per_verify_step", "draft_time_share")})
        return super().load().replace(queued=stats["num_waiting"], running=stats["num_running"], figures=figures)

    async def _engine_loop(self) -> None:
        """Admit new requests and weights, abort abandoned ones, step the engine, hand out what
        finished. Cancelled (the actor stops): a step or a weight load already in its thread
        finishes (they cannot be abandoned), then the loop ends; waiting callers are never answered."""
        engine = self.engine
        while True:
            if not (self._new_requests or self._new_weights or engine.has_unfinished()):
                await self._work.wait()
                self._work = anyio.Event()
            for weights, version, applied, result in self._new_weights:
                try:
                    await anyio.to_thread.run_sync(engine.load_weights, weights, version)
                except Exception as exc:  # reported to the caller of load_weights
                    result.append(exc)
                applied.set()
            self._new_weights.clear()
            requests, self._new_requests = self._new_requests, []
            for request_id, prompt, params, images in requests:
                try:
                    engine.add_request(prompt, params, request_id=request_id, images=images)
                    self._in_engine.add(request_id)
                except Exception as exc:
                    self._finish(request_id, None, exc)
            for request_id in self._in_engine - self._waiters.keys():
                engine.abort(request_id)  # its caller was cancelled
                self._in_engine.discard(request_id)
            if requests and engine.image_encoder is not None:   # a request whose image fails fails alone
                for request_id, error in (await self.in_compute_thread(engine.encode_images)).items():
                    self._in_engine.discard(request_id)
                    self._finish(request_id, None, error)
            if engine.has_unfinished():
                for output in await self.in_compute_thread(engine.step):  # threads: its cores now
                    self._in_engine.discard(output.request_id)
                    self._finish(output.request_id, output, None)

    def _finish(self, request_id: str, output, error) -> None:
        waiter = self._waiters.get(request_id)
        if waiter is not None:
            waiter.output, waiter.error = output, error
            waiter.done.set()
