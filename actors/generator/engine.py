"""The generator engine: continuous batching over a paged KV cache.

    engine = Engine(model, tokenizer, kv_cache_mb=256)
    outputs = engine.generate(["2+3="], SamplingParams(n=4, temperature=1.0, max_new_tokens=16))
    outputs[0].outputs[2].token_ids, .logprobs, .policy_versions, .text, .finish_reason

or drive it by hand: `add_request(...)` any time, `step()` until `has_unfinished()`
is False; `load_weights(state_dict, version)` between steps.

Design note. Every `step()` is one iteration of the batch: (1) each running
sequence reserves the slot of the token it sampled last step (`pool.append`,
doing any copy-on-write block copies the allocator asks for; if blocks run out
the most recently admitted sequence is preempted: its blocks are freed and it
re-enters the queue to be recomputed, keeping what it generated); (2) waiting
requests are admitted while the batch has room (`pool.allocate`, which returns
how many prompt tokens the prefix cache already holds); (3) one forward pass
decodes the running sequences, one more pre-fills the admitted prompts (decode
first, so any block it completes is written before a prefix-cache hit reads
it); (4) each sequence samples its next token and may finish. A request with
n samples is pre-filled ONCE; after its prefill the other n-1 sequences fork
from it and share its blocks, and the first append into the shared partial
block copies it. Requests join and leave at every step.

With speculative decoding (`postrain.actors.generator.speculative`), step (1) first asks
the proposer for each running sequence's drafted tokens and reserves their
slots too (a sequence short of blocks drops its drafts before anyone is
preempted); the decode forward of (3) then scores the last token and the drafts
of every sequence together, and (4) keeps each sequence's accepted drafts plus
one token (`sampling.verify_rows`, exact) and rolls the rejected drafts' slots
back (`pool.truncate`).

Logprobs: see `postrain.actors.generator.sampling` (log_softmax(logits / T) before
truncation, the learner's definition). Every sampled token is tagged with
the engine's `policy_version` at the step that sampled it; `load_weights`
bumps it without touching in-flight sequences, whose earlier KV stays (it was
computed by the older weights: the usual asynchronous-RL trade, and the
decoupled objective in the learner accounts for it). The prefix cache is
reset on a weight swap, so new requests never reuse KV of older weights.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from ..models.loading import load_model
from ..models.llama import Float16Weights, LlamaModel, PagedBatch
from .sampling import SamplingParams, make_generator, sample_rows, verify_rows
from .speculative import (
    DraftModelProposer, Proposer, SpeculativeOptions, make_proposer, next_num_draft_tokens,
)
from postrain.core.errors import PostrainError
from postrain.ext import KVBlockPool, OutOfBlocksError


class EngineError(PostrainError, ValueError):
    """A request or engine setting the engine cannot serve."""


def _verify_width(num_drafts: list[int]) -> int:
    """Drafted tokens per sequence that one step verifies at most: the largest w that at least
    half the batch drafts. Every row of the verify forward is as wide as the widest (1 + w
    positions), so a few drafting sequences must not widen a large batch that drafts
    nothing (at batch 32 a 5-position forward costs ~2x a decode step on this CPU)."""
    ranked = sorted(num_drafts, reverse=True)
    return ranked[(len(ranked) - 1) // 2] if ranked else 0


@dataclass
class CompletionOutput:
    """One sample. token_ids are exactly the sampled ids (a stop string's tokens included)."""

    sample_index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)        # see postrain.actors.generator.sampling
    policy_versions: list[int] = field(default_factory=list)   # the weights that sampled each token
    text: str = ""                                             # decoded, cut before a stop string
    finish_reason: str | None = None                           # "stop" | "length" | "abort"


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_prompt_tokens: int = 0        # prompt tokens whose KV came from the prefix cache
    finished: bool = False


class _Sequence:
    """One sample in flight. Invariant while running, between steps: pool.num_tokens(seq_id)
    == len(token_ids) - 1 (the last sampled token's KV is written by the next decode); within
    a step, after its slots are reserved, == len(token_ids) + len(drafts)."""

    __slots__ = ("seq_id", "request", "output", "token_ids", "generator", "drafts", "num_draft_tokens")

    def __init__(self, seq_id, request, sample_index, generator, num_draft_tokens=0):
        self.seq_id = seq_id
        self.request = request
        self.output = CompletionOutput(sample_index)
        self.token_ids = list(request.output.prompt_token_ids)
        self.generator = generator
        self.drafts: list[int] = []               # this step's drafted tokens, verified by its forward
        self.num_draft_tokens = num_draft_tokens  # its adaptive k (speculative decoding)

    @property
    def finished(self) -> bool:
        return self.output.finish_reason is not None


class _Request:
    __slots__ = ("output", "params", "sequences", "stop_ids", "prompt_key")

    def __init__(self, output: RequestOutput, params: SamplingParams, stop_ids: set[int]):
        self.output = output
        self.params = params
        self.sequences: list[_Sequence] = []
        self.stop_ids = stop_ids
        self.prompt_key = tuple(output.prompt_token_ids)    # the rollout proposer's store key


@dataclass
class _Prefill:
    """A prefill to run this step: `seqs[0]` owns the blocks; the others fork from it."""

    seqs: list[_Sequence]
    num_cached: int


class Engine:
    """Continuous-batching generator over `model` with a paged KV cache (see module docstring)."""

    # 8-token blocks: a sequence's last, partial block wastes 3.5 slots on average instead of
    # 7.5 (KV utilisation ~0.92 instead of ~0.86 on 40-token chat prompts plus 64 new tokens).
    DEFAULT_BLOCK_SIZE_TOKENS = 8

    def __init__(self, model: LlamaModel, tokenizer=None, *, block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS,
                 num_blocks: int | None = None, kv_cache_mb: float = 256.0, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 4096, enable_prefix_caching: bool = True,
                 policy_version: int = 0, seed: int = 0, weight_precision: str = "float32",
                 speculative: SpeculativeOptions | None = None, proposer: Proposer | None = None):
        """weight_precision: "float32" multiplies by the model's own weights (what the learner
        scores); "float16" by float16 copies of them (`model.Float16Weights`: x86 CPU, half the
        weight bytes per token, logprobs off by the rounding of the weights).
        speculative: draft and verify tokens (`postrain.actors.generator.speculative`); None = off.
        proposer: where drafts come from, in place of the one `speculative.method` names (any
        object with the `Proposer` methods)."""
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise EngineError(f"max_num_seqs and max_num_batched_tokens must be >= 1, got "
                              f"{max_num_seqs} and {max_num_batched_tokens}")
        if weight_precision not in ("float32", "float16"):
            raise EngineError(f"weight_precision must be 'float32' or 'float16', got {weight_precision!r}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config
        self.block_size_tokens = block_size_tokens
        if num_blocks is None:
            cfg = self.config
            bytes_per_block = (2 * cfg.num_layers * block_size_tokens * cfg.num_kv_heads * cfg.head_dim
                               * model.lm_head.weight.element_size())
            num_blocks = max(2, int(kv_cache_mb * 2**20 // bytes_per_block))
        self.pool = KVBlockPool(num_blocks, block_size_tokens, enable_prefix_caching)
        self.kv_caches = model.new_kv_caches(num_blocks, block_size_tokens)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy_version = policy_version
        self.weight_precision = weight_precision
        # Invariant: None, or float16 copies of the model's current weights (refreshed per step).
        self._float16_weights = Float16Weights(model) if weight_precision == "float16" else None
        self.speculative = speculative
        if proposer is not None and speculative is None:
            raise EngineError("a proposer needs speculative options (num_draft_tokens, adaptive); "
                              "pass speculative=SpeculativeOptions(...) too")
        if proposer is None and speculative is not None:
            proposer = (self._draft_model_proposer(speculative, seed) if speculative.method == "draft_model"
                        else make_proposer(speculative))
        self._proposer = proposer
        self._rng = torch.Generator().manual_seed(seed)
        self._ids = itertools.count()
        self._waiting: deque[_Prefill] = deque()     # FIFO; preempted sequences re-enter at the front
        self._running: list[_Sequence] = []          # admission order: the last is preempted first
        self._requests: dict[str, _Request] = {}
        self.counters = {"num_steps": 0, "num_generated_tokens": 0, "num_prefill_tokens": 0,
                         "num_cached_prompt_tokens": 0, "num_preemptions": 0, "busy_s": 0.0,
                         "num_verify_steps": 0, "num_drafted_tokens": 0, "num_accepted_tokens": 0,
                         "draft_s": 0.0}

    def _draft_model_proposer(self, options: SpeculativeOptions, seed: int) -> DraftModelProposer:
        """An engine over `options.draft_model`, on the policy's device and dtype, drafting."""
        weight = self.model.lm_head.weight
        draft, _ = load_model(options.draft_model, dtype=weight.dtype, device=weight.device)
        if draft.config.vocab_size != self.config.vocab_size:
            raise EngineError(f"the draft model {options.draft_model!r} has a vocabulary of "
                              f"{draft.config.vocab_size} tokens, the policy {self.config.vocab_size}: a "
                              "draft model must use the policy's tokenizer (pick a smaller model of the "
                              "policy's family)")
        return DraftModelProposer(Engine(draft, kv_cache_mb=options.draft_kv_cache_mb,
                                         max_num_seqs=self.max_num_seqs, seed=seed))

    # ------------------------------------------------------------------ public API

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a prompt (text or token ids); return its request id."""
        params = params or SamplingParams()
        ids = self._encode(prompt)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise EngineError(f"request_id {request_id!r} is already in flight; use a new id")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos and self.tokenizer is not None:
            stop_ids |= set(self.tokenizer.eos_token_ids)
        request = _Request(RequestOutput(request_id, ids, []), params, stop_ids)
        for i in range(params.n):
            seq = _Sequence(next(self._ids), request, i, make_generator(params.seed, i, self._rng),
                            self.speculative.num_draft_tokens if self.speculative else 0)
            request.sequences.append(seq)
            request.output.outputs.append(seq.output)
        self._requests[request_id] = request
        self._waiting.append(_Prefill(list(request.sequences), 0))
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[RequestOutput]:
        """One batch iteration; return the requests that finished in it."""
        start = time.perf_counter()
        decodes = self._reserve_decode_slots()
        prefills = self._admit(len(decodes))
        finished: list[RequestOutput] = []
        if self._float16_weights is not None and self._float16_weights.is_stale():
            self._float16_weights = Float16Weights(self.model)     # weights swapped or trained in place
        with torch.inference_mode():
            if any(s.drafts for s in decodes):
                self._verify_and_advance(decodes, self._forward_verify(decodes), finished)
            elif decodes:
                logits = self._forward_decode(decodes)
                self._sample_and_advance([[s] for s in decodes], logits, finished)
            if prefills:
                logits = self._forward_prefill(prefills)
                for prefill in prefills:
                    for child in prefill.seqs[1:]:
                        self.pool.fork(prefill.seqs[0].seq_id, child.seq_id)
                    self._running.extend(prefill.seqs)
                self._sample_and_advance([p.seqs for p in prefills], logits, finished)
        self.counters["num_steps"] += 1
        self.counters["busy_s"] += time.perf_counter() - start
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

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its samples finish with reason 'abort'."""
        request = self._requests.get(str(request_id))
        if request is None:
            return None
        self._waiting = deque(p for p in self._waiting if p.seqs[0].request is not request)
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
        self.pool.reset_prefix_cache()
        self.policy_version = version

    def stats(self) -> dict:
        """KV utilisation, batch size, queue depth, and throughput counters; with speculative
        decoding, `speculation_stats` too."""
        pool = self.pool.stats()
        busy = self.counters["busy_s"]
        return {
            "num_running": len(self._running), "num_waiting": len(self._waiting),
            "kv_num_used_blocks": pool["num_used_blocks"], "kv_num_blocks": pool["num_blocks"],
            "kv_utilization": self.kv_utilization(), "prefix_hit_rate": pool["prefix_hit_rate"],
            "policy_version": self.policy_version,
            "tokens_per_s": self.counters["num_generated_tokens"] / busy if busy else 0.0,
            **(self.speculation_stats() if self.speculative is not None else {}),
            **self.counters,
        }

    def speculation_stats(self) -> dict:
        """acceptance_rate: accepted over drafted tokens; tokens_per_verify_step: tokens a
        sequence emitted per step in which it verified drafts (1 + accepted); draft_time_share:
        the share of busy time spent proposing drafts. All 0.0 before any draft."""
        c = self.counters
        return {
            "acceptance_rate": c["num_accepted_tokens"] / c["num_drafted_tokens"] if c["num_drafted_tokens"] else 0.0,
            "tokens_per_verify_step": (1 + c["num_accepted_tokens"] / c["num_verify_steps"]
                                       if c["num_verify_steps"] else 0.0),
            "draft_time_share": c["draft_s"] / c["busy_s"] if c["busy_s"] else 0.0,
        }

    def kv_utilization(self) -> float:
        """Token slots holding a running sequence's KV over the slots of the blocks they hold.

        Physical: a block shared by n forked samples counts once (the prompt's KV, stored
        once, is not n times as useful), so this is what the reserved memory actually holds.
        """
        fill: dict[int, int] = {}
        size = self.block_size_tokens
        for seq in self._running:
            num_tokens = self.pool.num_tokens(seq.seq_id)
            for i, block in enumerate(self.pool.block_table(seq.seq_id)):
                fill[block] = max(fill.get(block, 0), min(size, num_tokens - i * size))
        return sum(fill.values()) / (len(fill) * size) if fill else 0.0

    # ------------------------------------------------------------------ scheduling

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

    def _reserve_decode_slots(self) -> list[_Sequence]:
        """Reserve the next slot of every running sequence (and of its drafted tokens, which it
        gives up first when blocks run short), preempting from the back if needed."""
        reserved: list[_Sequence] = []
        self._propose_drafts()
        while len(reserved) < len(self._running):
            seq = self._running[len(reserved)]
            if not self.pool.can_append(seq.seq_id, 1 + len(seq.drafts)):
                if seq.drafts:
                    seq.drafts = []
                    continue
                self._preempt(self._running[-1])      # the newest; may be `seq` itself
                continue
            self._copy_blocks(self.pool.append(seq.seq_id, seq.token_ids[-1:] + seq.drafts))
            reserved.append(seq)
        return reserved

    def _propose_drafts(self) -> None:
        """Each running sequence's drafted tokens for this step (none without speculation)."""
        if self._proposer is None:
            return
        start = time.perf_counter()
        limit = self.config.max_position_embeddings
        drafting: list[tuple[_Sequence, int]] = []
        for seq in self._running:
            params = seq.request.params
            # Room: tokens the sample may still emit after this step's own, and positions.
            room = min(seq.num_draft_tokens, params.max_new_tokens - len(seq.output.token_ids) - 1,
                       limit - len(seq.token_ids))
            seq.drafts = []
            if room > 0:
                drafting.append((seq, room))
        if drafting:
            requests = [(seq.token_ids, seq.request.prompt_key, room) for seq, room in drafting]
            for (seq, _), draft in zip(drafting, self._proposer.propose_batch(requests)):
                seq.drafts = list(draft)
        width = _verify_width([len(s.drafts) for s in self._running])
        for seq in self._running:
            del seq.drafts[width:]
        self.counters["draft_s"] += time.perf_counter() - start

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Do the allocator's copy-on-write block copies, (src, dst) block ids, in every layer."""
        for src, dst in pairs:
            for key_cache, value_cache in self.kv_caches:
                key_cache[dst].copy_(key_cache[src])
                value_cache[dst].copy_(value_cache[src])

    def _preempt(self, seq: _Sequence) -> None:
        """Free the sequence's blocks; it re-enters the queue first, to be recomputed."""
        seq.drafts = []
        self._running.remove(seq)
        self.pool.free(seq.seq_id)
        self._waiting.appendleft(_Prefill([seq], 0))
        self.counters["num_preemptions"] += 1

    def _admit(self, num_decoding: int) -> list[_Prefill]:
        admitted: list[_Prefill] = []
        num_seqs, num_tokens = num_decoding, 0
        while self._waiting:
            prefill = self._waiting[0]
            tokens = prefill.seqs[0].token_ids
            fan_out = len(prefill.seqs)
            if num_seqs + fan_out > self.max_num_seqs and num_seqs > 0:
                break
            if num_tokens + len(tokens) > self.max_num_batched_tokens and admitted:
                break
            # Room for the prompt plus one copy-on-write block per extra sample.
            needed = -(-len(tokens) // self.block_size_tokens) + fan_out - 1
            if needed > self.pool.num_free_blocks:
                if not admitted and not self._running:
                    raise EngineError(
                        f"a request needs {needed} KV blocks but the cache has only "
                        f"{self.pool.num_blocks}; raise kv_cache_mb/num_blocks or lower n or the "
                        "prompt length")
                break
            self._waiting.popleft()
            prefill.num_cached = self.pool.allocate(prefill.seqs[0].seq_id, tokens)
            admitted.append(prefill)
            num_seqs += fan_out
            num_tokens += len(tokens) - prefill.num_cached
            self.counters["num_prefill_tokens"] += len(tokens) - prefill.num_cached
            self.counters["num_cached_prompt_tokens"] += prefill.num_cached
            if len(prefill.seqs[0].token_ids) == len(prefill.seqs[0].request.output.prompt_token_ids):
                prefill.seqs[0].request.output.num_cached_prompt_tokens = prefill.num_cached
        return admitted

    # ------------------------------------------------------------------ forward passes

    def _block_tables(self, seq_ids: list[int]) -> torch.Tensor:
        width = max(len(self.pool.block_table(s)) for s in seq_ids)
        out = np.zeros((len(seq_ids), width), dtype=np.int32)
        self.pool.fill_block_tables(seq_ids, out)
        return torch.from_numpy(out).long()

    def _forward_decode(self, seqs: list[_Sequence]) -> torch.Tensor:
        """One new token per sequence; logits (B, V)."""
        device = self.model.lm_head.weight.device
        tables = self._block_tables([s.seq_id for s in seqs])
        positions = torch.tensor([len(s.token_ids) - 1 for s in seqs])[:, None]   # (B, 1)
        block_size = self.block_size_tokens
        slots = tables.gather(1, positions // block_size) * block_size + positions % block_size
        input_ids = torch.tensor([s.token_ids[-1] for s in seqs])[:, None]
        batch = PagedBatch(positions.to(device), slots.to(device), tables.to(device),
                           (positions[:, 0] + 1).to(device), self.kv_caches, num_padding=0,
                           weights=self._float16_weights)
        return self.model(input_ids.to(device), paged=batch,
                          logits_to_keep=torch.zeros(len(seqs), dtype=torch.long, device=device))

    def _forward_verify(self, seqs: list[_Sequence]) -> torch.Tensor:
        """Each sequence's last token and its drafts, right-padded into one batch; logits
        (B, 1 + max drafts, V): row b, column i scores the position after its i-th input."""
        device = self.model.lm_head.weight.device
        tables = self._block_tables([s.seq_id for s in seqs])
        width = 1 + max(len(s.drafts) for s in seqs)
        input_ids = torch.zeros(len(seqs), width, dtype=torch.long)
        positions = torch.zeros(len(seqs), width, dtype=torch.long)
        for row, seq in enumerate(seqs):
            new = seq.token_ids[-1:] + seq.drafts
            input_ids[row, :len(new)] = torch.tensor(new)
            positions[row, :len(new)] = torch.arange(len(seq.token_ids) - 1, len(seq.token_ids) - 1 + len(new))
        lengths = torch.tensor([1 + len(s.drafts) for s in seqs])
        valid = torch.arange(width)[None, :] < lengths[:, None]
        block_size = self.block_size_tokens
        slots = tables.gather(1, positions // block_size) * block_size + positions % block_size
        slots = torch.where(valid, slots, torch.full_like(slots, -1))
        context = torch.tensor([len(s.token_ids) + len(s.drafts) for s in seqs])
        batch = PagedBatch(positions.to(device), slots.to(device), tables.to(device),
                           context.to(device), self.kv_caches, weights=self._float16_weights)
        return self.model(input_ids.to(device), paged=batch)

    def _forward_prefill(self, prefills: list[_Prefill]) -> torch.Tensor:
        """The uncached prompt tokens of each prefill, right-padded into one batch; logits (B, V)."""
        device = self.model.lm_head.weight.device
        tables = self._block_tables([p.seqs[0].seq_id for p in prefills])
        new = [p.seqs[0].token_ids[p.num_cached:] for p in prefills]
        width = max(len(n) for n in new)
        input_ids = torch.zeros(len(new), width, dtype=torch.long)
        positions = torch.zeros(len(new), width, dtype=torch.long)
        for row, (p, toks) in enumerate(zip(prefills, new)):
            input_ids[row, :len(toks)] = torch.tensor(toks)
            positions[row, :len(toks)] = torch.arange(p.num_cached, p.num_cached + len(toks))
        lengths = torch.tensor([len(n) for n in new])
        valid = torch.arange(width)[None, :] < lengths[:, None]
        block_size = self.block_size_tokens
        slots = tables.gather(1, positions // block_size) * block_size + positions % block_size
        slots = torch.where(valid, slots, torch.full_like(slots, -1))
        context = torch.tensor([len(p.seqs[0].token_ids) for p in prefills])
        batch = PagedBatch(positions.to(device), slots.to(device), tables.to(device),
                           context.to(device), self.kv_caches, weights=self._float16_weights)
        return self.model(input_ids.to(device), paged=batch, logits_to_keep=(lengths - 1).to(device))

    # ------------------------------------------------------------------ sampling and finishing

    def _sample_and_advance(self, groups: list[list[_Sequence]], logits: torch.Tensor,
                            finished: list[RequestOutput]) -> None:
        """Row i of logits feeds every sequence of groups[i] (n samples share a prefill)."""
        rows = [i for i, group in enumerate(groups) for _ in group]
        seqs = [s for group in groups for s in group]
        picked = logits if len(rows) == logits.shape[0] else logits[rows]   # one row per group: as is
        tokens, logprobs = sample_rows(picked, [s.request.params for s in seqs],
                                       [s.generator for s in seqs])
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            self._emit(seq, token, logprob, finished)

    def _emit(self, seq: _Sequence, token: int, logprob: float, finished: list[RequestOutput]) -> None:
        """Append one sampled token to the sequence; finish it (and its request) if it stops."""
        seq.token_ids.append(token)
        out = seq.output
        out.token_ids.append(token)
        out.logprobs.append(logprob)
        out.policy_versions.append(self.policy_version)
        self.counters["num_generated_tokens"] += 1
        reason = self._stop_reason(seq, token)
        if reason is not None:
            self._finish(seq, reason)
            if all(s.finished for s in seq.request.sequences):
                finished.append(self._complete(seq.request))

    def _verify_and_advance(self, seqs: list[_Sequence], logits: torch.Tensor,
                            finished: list[RequestOutput]) -> None:
        """Keep each sequence's accepted drafts and one token more (`verify_rows`), roll the
        rejected drafts' slots back, and adapt its k. logits (B, T, V) from `_forward_verify`."""
        options = self.speculative
        verdicts = verify_rows(logits, [s.drafts for s in seqs], [s.request.params for s in seqs],
                               [s.generator for s in seqs])
        for seq, (tokens, logprobs) in zip(seqs, verdicts):
            drafts = seq.drafts
            seq.drafts = []
            num_accepted = len(tokens) - 1
            self.counters["num_drafted_tokens"] += len(drafts)
            self.counters["num_accepted_tokens"] += num_accepted
            self.counters["num_verify_steps"] += bool(drafts)
            if options.adaptive:
                seq.num_draft_tokens = next_num_draft_tokens(seq.num_draft_tokens, len(drafts), num_accepted,
                                                             options.num_draft_tokens)
            for token, logprob in zip(tokens, logprobs):
                self._emit(seq, token, logprob, finished)
                if seq.finished:
                    break
            if not seq.finished and num_accepted < len(drafts):
                self._roll_back(seq)

    def _roll_back(self, seq: _Sequence) -> None:
        """Release the slots of the sequence's rejected drafts (restoring the running invariant)."""
        try:
            self._copy_blocks(self.pool.truncate(seq.seq_id, seq.token_ids[:-1]))
        except OutOfBlocksError:      # its cut block is shared and no block is free to copy it
            self._preempt(seq)

    def _stop_reason(self, seq: _Sequence, token: int) -> str | None:
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

    def _finish(self, seq: _Sequence, reason: str) -> None:
        seq.output.finish_reason = reason
        if self._proposer is not None and reason != "abort":
            self._proposer.record(seq.request.prompt_key, seq.output.token_ids)
        if seq in self._running:
            self._running.remove(seq)
            self.pool.free(seq.seq_id)
        if self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output.token_ids, skip_special_tokens=True)
            cuts = [text.find(s) for s in seq.request.params.stop if s in text]
            seq.output.text = text[:min(cuts)] if cuts else text

    def _complete(self, request: _Request) -> RequestOutput:
        request.output.finished = True
        self._requests.pop(request.output.request_id, None)
        return request.output
