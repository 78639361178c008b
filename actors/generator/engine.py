"""The generator engine: continuous batching over a paged KV cache, as a thin loop.

    engine = Engine(model, tokenizer, kv_cache_mb=256)
    outputs = engine.generate(["2+3="], SamplingParams(n=4, temperature=1.0, max_new_tokens=16))
    outputs[0].outputs[2].token_ids, .logprobs, .policy_versions, .text, .finish_reason

or drive it by hand: `add_request(...)` any time, `step()` until `has_unfinished()`
is False; `load_weights(state_dict, version)` between steps.

Scoring (a teacher's rows, nothing sampled; `postrain.actors.generator.scoring`):

    scores = engine.score([prompt + completion], score_from=[len(prompt)], top_k=32)
    scores[0].topk_ids, .topk_logprobs, .tail_logmass, .token_logprobs     # numpy, rows aligned with the ids

or `add_score_request(token_ids, score_from, top_k)` beside other requests: it is batched,
prefix-cached and chunked like a prompt, and finishes after its prefill with `output.scores`.

Design note. Every `step()` is: (drafts) -> schedule -> run -> sample/verify -> update.
The parts, vLLM v1's split: `scheduler.Scheduler` decides (reserves each running sequence's
next slot, preempting the newest when blocks run out; admits waiting prompts under the
sequence, token and block budgets) and emits a typed `StepPlan`; `kv_manager.KVManager`
owns the cache tensors and the block allocator (prefix caching, forks, copy-on-write);
`runner.ModelRunner` executes the plan (decode forward first, then prefill) through an
`attention.AttentionBackend`; `sampling` samples each row; `verify` drafts and verifies
speculative tokens. This module only strings them together and keeps the outputs. A request
with n samples is pre-filled ONCE; after its prefill the other n-1 sequences fork from it
and share its blocks, and the first append into the shared partial block copies it.
Requests join and leave at every step.

With speculative decoding (`postrain.actors.generator.speculative`), each step first asks
the proposer for each running sequence's drafted tokens; the plan carries them, the decode
forward scores the last token and the drafts of every sequence together, and each sequence
keeps its accepted drafts plus one token (`sampling.verify_rows`, exact); the rejected
drafts' slots are rolled back (`KVManager.truncate`).

Logprobs: see `postrain.actors.generator.sampling` (log_softmax(logits / T) before
truncation, the learner's definition). Every sampled token is tagged with
the engine's `policy_version` at the step that sampled it; `load_weights`
bumps it without touching in-flight sequences, whose earlier KV stays (it was
computed by the older weights: the usual asynchronous-RL trade, and the
decoupled objective in the learner accounts for it); the tokens they sample
next carry the new version although their context was read by the old
weights. With `exact` a swap instead sends every in-flight sequence back to
be read again by the new weights (`Scheduler.recompute_all`), keeping its
tokens, so each token's logprob is its version's, bit for bit. The prefix
cache is reset on a weight swap, and the blocks that sequences live at the swap
fill afterwards are never indexed (postrain.ext.kvpool: stale sequences), so
new requests never reuse KV of older weights.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import cast

import torch

from postrain.ext import OutOfBlocksError

from ..models.blocks import Float16Weights, ProjectionPath, default_projection
from ..models.exact import exact_token_logprobs, make_exact
from ..models.loading import load_model
from ..models.protocol import CausalLM
from .attention import AttentionBackend, ExactGatherBackend
from .images import ImageEncoder
from .kv_dtype import KV_DTYPE_NAMES, KVCache
from .kv_manager import KVManager
from .runner import ModelRunner, StepLogits
from .sampling import SamplingParams, make_generator, sample_rows
from .scheduler import ScheduledSequence, Scheduler, StepPlan
from .scoring import Scores, ScoreState
from .sequence import (CompletionOutput, EngineCounters, EngineError, PromptImages, Request, RequestOutput,
                       Sequence)
from .speculative import DraftModelProposer, Proposer, SpeculativeOptions, make_proposer
from .verify import propose_drafts, verify_drafts

__all__ = ["CompletionOutput", "Engine", "EngineError", "RequestOutput"]


class Engine:
    """Continuous-batching generator over `model` with a paged KV cache (see module docstring)."""

    # 8-token blocks: a sequence's last, partial block wastes 3.5 slots on average instead of
    # 7.5 (KV utilisation ~0.92 instead of ~0.86 on 40-token chat prompts plus 64 new tokens).
    DEFAULT_BLOCK_SIZE_TOKENS = 8

    def __init__(self, model: CausalLM, tokenizer=None, *, block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS,
                 num_blocks: int | None = None, kv_cache_mb: float = 256.0, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 4096, enable_prefix_caching: bool = True,
                 policy_version: int = 0, seed: int = 0, weight_precision: str = "float32",
                 speculative: SpeculativeOptions | None = None, proposer: Proposer | None = None,
                 attention_backend: AttentionBackend | None = None, prefill_chunk_tokens: int = 0,
                 kv_dtype: str | None = None, exact: bool = False):
        """model: any architecture of the registry (`postrain.actors.models.CausalLM`).
        weight_precision: "float32" multiplies by the model's own weights (what the learner
        scores); "float16" by float16 copies of them (`models.blocks.Float16Weights`: x86 CPU,
        half the weight bytes per token, logprobs off by the rounding of the weights).
        speculative: draft and verify tokens (`postrain.actors.generator.speculative`); None = off.
        proposer: where drafts come from, in place of the one `speculative.method` names (any
        object with the `Proposer` methods).
        attention_backend: how attention reads the paged cache; None = `default_backend()`.
        prefill_chunk_tokens: prompt tokens read per step at most, so running sequences keep
        decoding while a long prompt is read (`scheduler`: chunked prefill); 0 = one step.
        kv_dtype: how the KV cache stores keys and values: "float32", "bfloat16", "int8" or
        "float8_e4m3" (`kv_dtype`: 8-bit codes with a scale per token and head, more blocks in
        the same kv_cache_mb, logprobs off by the rounding); None = the model's dtype.
        exact: batch-invariant ops (`models.exact`): each sampled token's logprob equals the
        learner's `exact` recomputation bit for bit; needs a float32 model, weights and cache."""
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise EngineError(f"max_num_seqs and max_num_batched_tokens must be >= 1, got "
                              f"{max_num_seqs} and {max_num_batched_tokens}")
        if weight_precision not in ("float32", "float16"):
            raise EngineError(f"weight_precision must be 'float32' or 'float16', got {weight_precision!r}")
        if exact:
            attention_backend = self.exact_backend(weight_precision, kv_dtype, attention_backend)
            make_exact(cast(torch.nn.Module, model))                 # a CausalLM is a Module
        self.exact = exact
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config
        self.block_size_tokens = block_size_tokens
        self.kv = KVManager.for_model(model, block_size_tokens=block_size_tokens, num_blocks=num_blocks,
                                      kv_cache_mb=kv_cache_mb, enable_prefix_caching=enable_prefix_caching,
                                      kv_dtype=kv_dtype)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.counters = EngineCounters()
        self.scheduler = Scheduler(self.kv, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, counters=self.counters,
                                   prefill_chunk_tokens=prefill_chunk_tokens)
        self.runner = ModelRunner(model, self.kv, attention_backend)
        vision = getattr(model, "vision", None)
        self.image_encoder = ImageEncoder(vision, self.counters) if vision is not None else None   # images.py
        if getattr(self.config, "moe_layers", ()):      # MoE: record every token's experts (R3)
            self.runner.routing_sink = self._record_routing
        self.policy_version = policy_version
        self.weight_precision = weight_precision
        # Invariant: how a step multiplies by the linear weights (`default_projection`); float16
        # copies are of the model's current weights (refreshed per step).
        self._projection: ProjectionPath | None = default_projection(
            cast(torch.nn.Module, model), weight_precision, exact)       # a CausalLM is a Module
        self.speculative = speculative
        self._proposer = self._make_proposer(speculative, proposer, seed)
        self._rng = torch.Generator().manual_seed(seed)
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        # Every sample of an unfinished request, by seq_id (the plan names sequences by id).
        self._sequences: dict[int, Sequence] = {}

    @staticmethod
    def exact_backend(weight_precision: str, kv_dtype: str | None,
                      backend: AttentionBackend | None) -> AttentionBackend:
        """The attention backend of an exact engine; EngineError naming what exact cannot run with."""
        if weight_precision != "float32":
            raise EngineError(f"exact = true needs weight_precision = 'float32', got {weight_precision!r}: "
                              "float16 weight copies round every projection")
        if kv_dtype not in (None, "float32"):
            raise EngineError(f"exact = true needs a float32 KV cache, got kv_dtype = {kv_dtype!r}")
        if backend is not None and not isinstance(backend, ExactGatherBackend):
            raise EngineError(f"exact = true attends through ExactGatherBackend, not {type(backend).__name__}")
        return ExactGatherBackend()

    def _make_proposer(self, options: SpeculativeOptions | None, proposer: Proposer | None,
                       seed: int) -> Proposer | None:
        if proposer is not None and options is None:
            raise EngineError("a proposer needs speculative options (num_draft_tokens, adaptive); "
                              "pass speculative=SpeculativeOptions(...) too")
        if proposer is None and options is not None:
            proposer = (self._draft_model_proposer(options, seed) if options.method == "draft_model"
                        else make_proposer(options))
        return proposer

    def _draft_model_proposer(self, options: SpeculativeOptions, seed: int) -> DraftModelProposer:
        """An engine over `options.draft_model`, on the policy's device and dtype, drafting."""
        weight = next(self.model.parameters())
        assert options.draft_model is not None, "method draft_model has its draft_model (SpeculativeOptions)"
        draft, _ = load_model(options.draft_model, dtype=weight.dtype, device=weight.device)
        if draft.config.vocab_size != self.config.vocab_size:
            raise EngineError(f"the draft model {options.draft_model!r} has a vocabulary of "
                              f"{draft.config.vocab_size} tokens, the policy {self.config.vocab_size}: a "
                              "draft model must use the policy's tokenizer (pick a smaller model of the "
                              "policy's family)")
        kv_dtype = self.kv.kv_dtype.name if self.kv.kv_dtype.name in KV_DTYPE_NAMES else None  # the policy's
        return DraftModelProposer(Engine(draft, kv_cache_mb=options.draft_kv_cache_mb,
                                         max_num_seqs=self.max_num_seqs, seed=seed, kv_dtype=kv_dtype))

    # ------------------------------------------------------------------ the parts, for callers and tests

    @property
    def pool(self):
        """The KV block allocator (the KV manager's; tests may swap in a checked twin)."""
        return self.kv.pool

    @pool.setter
    def pool(self, pool) -> None:
        self.kv.pool = pool

    @property
    def kv_caches(self) -> list[tuple[KVCache, KVCache]]:
        return self.kv.kv_caches

    # ------------------------------------------------------------------ public API

    def sequences_of(self, request_id: str) -> list[Sequence]:
        """The sequences (one per sample) of a request still in the engine."""
        return self._requests[request_id].sequences

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, images: list | tuple = ()) -> str:
        """Queue a prompt (text or token ids); return its request id. images: a vision-language
        model's images (bytes, data URLs or PIL images), one per image placeholder run of the
        prompt, in order (models/vision.py `render_prompt` lays a chat prompt out so)."""
        params = params or SamplingParams()
        ids = self._encode(prompt)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise EngineError(f"request_id {request_id!r} is already in flight; use a new id")
        prompt_images = self._prompt_images(ids, list(images))
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos and self.tokenizer is not None:
            stop_ids |= set(self.tokenizer.eos_token_ids)
        request = Request(RequestOutput(request_id, ids, []), params, stop_ids, images=prompt_images)
        for i in range(params.n):
            seq = Sequence(next(self._ids), request, i, make_generator(params.seed, i, self._rng),
                           self.speculative.num_draft_tokens if self.speculative else 0)
            request.sequences.append(seq)
            request.output.outputs.append(seq.output)
            self._sequences[seq.seq_id] = seq
        self._requests[request_id] = request
        self.scheduler.add(request.sequences)
        return request_id

    def add_score_request(self, token_ids: list[int], score_from: int, top_k: int,
                          request_id: str | None = None) -> str:
        """Queue a sequence to score (module docstring: rows score_from .. len - 1 of the model's
        top_k ids and logprobs, tail log-mass and token logprobs); return its request id. It
        finishes after its prefill, with `RequestOutput.scores` and no samples."""
        ids = [int(t) for t in token_ids]
        self._check_scoring(ids, score_from, top_k)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise EngineError(f"request_id {request_id!r} is already in flight; use a new id")
        scoring = ScoreState(ids, score_from, top_k)
        request = Request(RequestOutput(request_id, ids, []), SamplingParams(), set(), scoring)
        seq = Sequence(next(self._ids), request, 0, None)    # no generator: it samples nothing
        request.sequences.append(seq)
        self._sequences[seq.seq_id] = seq
        self._requests[request_id] = request
        self.scheduler.add([seq], logits_from=scoring.logits_from)
        return request_id

    def score(self, sequences: list[list[int]], score_from: list[int], top_k: int) -> list[Scores]:
        """Score sequences to completion (`add_score_request` each); their rows in order."""
        if len(score_from) != len(sequences):
            raise EngineError(f"score_from has {len(score_from)} entries for {len(sequences)} sequences; "
                              "give one per sequence")
        ids = [self.add_score_request(seq, start, top_k) for seq, start in zip(sequences, score_from)]
        done: dict[str, Scores] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.scores is not None:
                    done[out.request_id] = out.scores
        return [done[i] for i in ids]

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[RequestOutput]:
        """One batch iteration: (drafts) -> schedule -> run -> sample/verify -> update; return
        the requests that finished in it."""
        start = time.perf_counter()
        failed = self.encode_images()              # the images of the requests added since the last step
        if failed:
            request_id, error = next(iter(failed.items()))
            raise EngineError(f"the image of request {request_id} failed in the vision tower ({type(error).__name__}: "
                              f"{error}); {len(failed)} request(s) aborted, the others go on at the next step")
        self._propose_drafts()
        plan = self.scheduler.schedule()
        finished: list[RequestOutput] = []
        if isinstance(self._projection, Float16Weights) and self._projection.is_stale():
            self._projection = Float16Weights(self.model)     # weights swapped or trained in place
        with torch.inference_mode():
            logits = self.runner.run(plan, self._projection)
            self._advance_decodes(plan, logits.decodes, finished)
            self._advance_prefills(plan, logits, finished)
        self.counters.num_steps += 1
        self.counters.busy_s += time.perf_counter() - start
        return finished

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                done[out.request_id] = out
        return [done[i] for i in ids]

    def encode_images(self) -> dict[str, Exception]:
        """Run the vision tower over the images of the requests added since the last call (step
        calls it first): every request whose image failed is aborted, and returned with its
        error; the others' rows are filled (generator/images.py)."""
        if self.image_encoder is None:
            return {}
        failed = self.image_encoder.encode_pending()
        if not failed:
            return {}
        owners = {id(request.images): request_id for request_id, request in self._requests.items()
                  if request.images is not None}
        out: dict[str, Exception] = {}
        for features, error in failed:
            request_id = owners.get(id(features))
            if request_id is not None:            # None: aborted before its images were encoded
                self.abort(request_id)
                out[request_id] = error
        return out

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its samples finish with reason 'abort'."""
        request = self._requests.get(str(request_id))
        if request is None:
            return None
        self.scheduler.drop_waiting(request)
        for seq in request.sequences:
            if not seq.finished:
                self._finish(seq, "abort")
        return self._complete(request)

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Swap in new weights between steps; tokens sampled from now on carry `version`."""
        from ..models.loading import load_state_dict_checked

        if version < self.policy_version:
            raise EngineError(f"policy version must not go back: engine is at {self.policy_version}, "
                              f"got {version}; send the learner's latest version")
        load_state_dict_checked(self.model, state_dict, source=f"weights for version {version}")
        if self.exact:
            self.scheduler.recompute_all()
        self.kv.reset_prefix_cache()
        if self.image_encoder is not None:
            self.image_encoder.clear()
        self.policy_version = version

    def stats(self) -> dict:
        """KV utilisation, batch size, queue depth, and throughput counters; with speculative
        decoding, `speculation_stats` too."""
        pool = self.kv.stats()
        busy = self.counters.busy_s
        return {
            "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
            "kv_num_used_blocks": pool["num_used_blocks"], "kv_num_blocks": pool["num_blocks"],
            "kv_utilization": self.kv_utilization(), "prefix_hit_rate": pool["prefix_hit_rate"],
            "policy_version": self.policy_version,
            "tokens_per_s": self.counters.num_generated_tokens / busy if busy else 0.0,
            **(self.speculation_stats() if self.speculative is not None else {}),
            **dataclasses.asdict(self.counters),
        }

    def speculation_stats(self) -> dict:
        """acceptance_rate: accepted over drafted tokens; tokens_per_verify_step: tokens a
        sequence emitted per step in which it verified drafts (1 + accepted); draft_time_share:
        the share of busy time spent proposing drafts. All 0.0 before any draft."""
        c = self.counters
        return {
            "acceptance_rate": c.num_accepted_tokens / c.num_drafted_tokens if c.num_drafted_tokens else 0.0,
            "tokens_per_verify_step": 1 + c.num_accepted_tokens / c.num_verify_steps if c.num_verify_steps else 0.0,
            "draft_time_share": c.draft_s / c.busy_s if c.busy_s else 0.0,
        }

    def kv_utilization(self) -> float:
        """Token slots holding a running sequence's KV over the slots of the blocks they hold
        (`KVManager.utilization`: a block shared by forked samples counts once)."""
        return self.kv.utilization([s.seq_id for s in self.scheduler.running])

    # ------------------------------------------------------------------ steps of `step`

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise EngineError("a text prompt needs a tokenizer; pass token ids or "
                                  "Engine(model, tokenizer)")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise EngineError("the prompt is empty; give at least one token")
        limit = self.config.max_position_embeddings
        if len(ids) >= limit:
            raise EngineError(f"the prompt has {len(ids)} tokens but the model's context is {limit} "
                              f"(max_position_embeddings); shorten it to at most {limit - 1} tokens")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise EngineError(f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        return ids

    def _prompt_images(self, ids: list[int], images: list) -> PromptImages | None:
        if not images:
            return None
        if self.image_encoder is None:
            raise EngineError(f"the request has {len(images)} image(s) but the model reads text only; "
                              "use a vision-language model, or send text")
        return self.image_encoder.features(ids, images)

    def _propose_drafts(self) -> None:
        """Each running sequence's drafted tokens for this step (none without speculation)."""
        if self._proposer is None:
            return
        start = time.perf_counter()
        propose_drafts(self.scheduler.running, self._proposer, self.config.max_position_embeddings)
        self.counters.draft_s += time.perf_counter() - start

    def _advance_decodes(self, plan: StepPlan, logits: torch.Tensor | None,
                         finished: list[RequestOutput]) -> None:
        """Sample (or verify the drafts of) every decoding sequence of the plan."""
        if logits is None:
            return
        seqs = [self._sequences[entry.seq_id] for entry in plan.decodes]
        if plan.has_drafts:
            self._verify_and_advance(seqs, logits, finished)
        else:
            self._sample_and_advance([[s] for s in seqs], logits, finished)

    def _advance_prefills(self, plan: StepPlan, step_logits: StepLogits,
                          finished: list[RequestOutput]) -> None:
        """Fork each prefill's samples (they run from now on) and sample them all from its row;
        a row that read an earlier chunk of its prompt only wrote KV; a scoring request's rows
        are reduced to its scores (`_advance_scoring`)."""
        logits = step_logits.prefills
        if logits is None:
            return
        if step_logits.scored:
            self._advance_scoring(plan, step_logits.scored, finished)
        rows = [i for i, entry in enumerate(plan.prefills) if entry.completes_prompt and entry.logits_from is None]
        if not rows:
            return
        if len(rows) < len(plan.prefills):
            logits = logits[rows]
        entries = [plan.prefills[i] for i in rows]
        groups = [self._group(entry) for entry in entries]
        for entry, group in zip(entries, groups):
            self.scheduler.start_running(entry, group)
        self._sample_and_advance(groups, logits, finished)

    def _advance_scoring(self, plan: StepPlan, scored: tuple[tuple[int, int, torch.Tensor], ...],
                         finished: list[RequestOutput]) -> None:
        """Reduce each scoring row's logits (`StepLogits.scored`) into its request's rows; a
        request whose last chunk this was finishes: its blocks are freed, its scores out."""
        for i, first, logits in scored:
            entry = plan.prefills[i]
            seq = self._sequences[entry.seq_id]
            scoring = seq.request.scoring
            assert scoring is not None, "a plan entry with logits_from is a scoring request's"
            scoring.add(first, logits)
            if entry.completes_prompt:
                seq.output.finish_reason = "stop"
                self.scheduler.release(entry)
                seq.request.output.scores = scoring.rows
                finished.append(self._complete(seq.request))

    def _check_scoring(self, ids: list[int], score_from: int, top_k: int) -> None:
        limit = self.config.max_position_embeddings
        if len(ids) < 2:
            raise EngineError(f"a sequence to score needs at least 2 tokens (row 0 has no context), got {len(ids)}")
        if len(ids) > limit:
            raise EngineError(f"the sequence to score has {len(ids)} tokens but the model's context is {limit} "
                              f"(max_position_embeddings); score at most {limit} tokens")
        if not 1 <= score_from <= len(ids):
            raise EngineError(f"score_from must be in [1, {len(ids)}] (the sequence's length), got {score_from}: "
                              "row t is the distribution of token t given the tokens before it")
        if not 1 <= top_k <= self.config.vocab_size:
            raise EngineError(f"top_k must be in [1, {self.config.vocab_size}] (the vocabulary), got {top_k}")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise EngineError(f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")

    def _group(self, entry: ScheduledSequence) -> list[Sequence]:
        return [self._sequences[entry.seq_id]] + [self._sequences[i] for i in entry.fork_seq_ids]

    def _sample_and_advance(self, groups: list[list[Sequence]], logits: torch.Tensor,
                            finished: list[RequestOutput]) -> None:
        """Row i of logits feeds every sequence of groups[i] (n samples share a prefill)."""
        rows = [i for i, group in enumerate(groups) for _ in group]
        seqs = [s for group in groups for s in group]
        picked = logits if len(rows) == logits.shape[0] else logits[rows]   # one row per group: as is
        params = [s.request.params for s in seqs]
        tokens, logprobs = sample_rows(picked, params, [s.generator for s in seqs])
        if self.exact:                                   # the learner's exact recomputation, bit for bit
            temps = torch.tensor([p.logprob_temperature for p in params])
            logprobs = exact_token_logprobs(picked.float().cpu(), torch.tensor(tokens), temps).tolist()
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            self._emit(seq, token, logprob, finished)

    def _verify_and_advance(self, seqs: list[Sequence], logits: torch.Tensor,
                            finished: list[RequestOutput]) -> None:
        """Keep each sequence's accepted drafts and one token more (`verify.verify_drafts`) and
        roll the rejected drafts' slots back. logits (B, T, V) from the decode forward."""
        assert self.speculative is not None, "sequences have drafts only with speculative options"
        verdicts = verify_drafts(logits, seqs, self.speculative, self.counters)
        if self.exact:                         # row j of a sequence scores its j-th emitted token
            verdicts = [(tokens, exact_token_logprobs(
                logits[row, :len(tokens)].float().cpu(), torch.tensor(tokens),
                seq.request.params.logprob_temperature).tolist(), num_drafted)
                for row, (seq, (tokens, _, num_drafted)) in enumerate(zip(seqs, verdicts))]
        for seq, (tokens, logprobs, num_drafted) in zip(seqs, verdicts):
            for token, logprob in zip(tokens, logprobs):
                self._emit(seq, token, logprob, finished)
                if seq.finished:
                    break
            if not seq.finished and len(tokens) - 1 < num_drafted:
                self._roll_back(seq)

    def _roll_back(self, seq: Sequence) -> None:
        """Release the slots of the sequence's rejected drafts (restoring the running invariant)."""
        try:
            self.kv.truncate(seq.seq_id, seq.token_ids[:-1])
        except OutOfBlocksError:      # its cut block is shared and no block is free to copy it
            self.scheduler.preempt(seq)

    def _emit(self, seq: Sequence, token: int, logprob: float, finished: list[RequestOutput]) -> None:
        """Append one sampled token to the sequence; finish it (and its request) if it stops."""
        seq.token_ids.append(token)
        out = seq.output
        out.token_ids.append(token)
        out.logprobs.append(logprob)
        out.policy_versions.append(self.policy_version)
        self.counters.num_generated_tokens += 1
        reason = self._stop_reason(seq, token)
        if reason is not None:
            self._finish(seq, reason)
            if all(s.finished for s in seq.request.sequences):
                finished.append(self._complete(seq.request))

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params, out = seq.request.params, seq.output
        if token in seq.request.stop_ids:
            return "stop"
        if params.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            if any(s in text for s in params.stop):
                return "stop"
        if len(out.token_ids) >= params.max_new_tokens:
            return "length"
        if len(seq.token_ids) >= self.config.max_position_embeddings:
            return "length"
        return None

    def _record_routing(self, entry: ScheduledSequence, experts) -> None:
        """The experts of a row's new tokens, kept by position; a prefill's forks get them too."""
        for seq_id in (entry.seq_id, *entry.fork_seq_ids):
            seq = self._sequences.get(seq_id)
            if seq is not None:
                seq.record_routing(entry.start_position, experts)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.output.finish_reason = reason
        if seq.routing is not None:
            from ..models.moe import encode_routing
            seq.output.routed_experts = encode_routing(seq.routing, len(seq.token_ids), self.config.num_experts)
        if self._proposer is not None and reason != "abort":
            self._proposer.record(seq.request.prompt_key, seq.output.token_ids)
        self.scheduler.finish(seq)
        if self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output.token_ids, skip_special_tokens=True)
            cuts = [text.find(s) for s in seq.request.params.stop if s in text]
            seq.output.text = text[:min(cuts)] if cuts else text

    def _complete(self, request: Request) -> RequestOutput:
        request.output.finished = True
        self._requests.pop(request.output.request_id, None)
        for seq in request.sequences:
            self._sequences.pop(seq.seq_id, None)
        return request.output
