"""The engine's per-request state: the outputs callers read (`RequestOutput`, `CompletionOutput`),
the sequences in flight that the scheduler and the engine share, a prompt's images
(`PromptImages`, made by images.py), and `EngineError`."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from postrain.core.errors import PostrainError

from .sampling import SamplingParams
from .scoring import Scores, ScoreState



class EngineError(PostrainError, ValueError):
    """A request or engine setting the engine cannot serve."""



@dataclass(slots=True)
class EngineCounters:
    """The engine's counters since start, one object its parts add to: the engine (steps, busy
    and draft seconds, generated tokens), the scheduler (prefill and cached prompt tokens,
    preemptions) and speculative verification (drafted, accepted tokens, verify steps).
    Invariant: every field only grows; `Engine.stats` reports them with GeneratorStats' names."""

    num_steps: int = 0
    num_generated_tokens: int = 0
    num_prefill_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    num_recomputed_on_swap: int = 0     # sequences whose KV a weight swap made them read again (exact)
    busy_s: float = 0.0
    num_verify_steps: int = 0
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    draft_s: float = 0.0
    num_image_encodes: int = 0

@dataclass
class CompletionOutput:
    """One sample. token_ids are exactly the sampled ids (a stop string's tokens included)."""

    sample_index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)        # see postrain.actors.generator.sampling
    policy_versions: list[int] = field(default_factory=list)   # the weights that sampled each token
    text: str = ""                                             # decoded, cut before a stop string
    finish_reason: str | None = None                           # "stop" | "length" | "abort"
    routed_experts: bytes | None = None   # MoE models: per token of prompt + sample, the experts it was
                                          # routed to in each MoE layer (models.moe.encode_routing)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_prompt_tokens: int = 0        # prompt tokens whose KV came from the prefix cache
    finished: bool = False
    scores: Scores | None = None             # a scoring request's rows, once finished (`scoring`);
                                             # such a request has no outputs (nothing is sampled)


class Sequence:
    """One sample in flight. Invariant while running, between steps: the KV manager holds
    len(token_ids) - 1 tokens of it (the last sampled token's KV is written by the next
    decode); within a step, after its slots are reserved, len(token_ids) + len(drafts)."""

    __slots__ = ("seq_id", "request", "output", "token_ids", "generator", "drafts", "num_draft_tokens",
                 "routing")

    def __init__(self, seq_id, request, sample_index, generator, num_draft_tokens=0):
        self.seq_id = seq_id
        self.request = request
        self.output = CompletionOutput(sample_index)
        self.token_ids = list(request.output.prompt_token_ids)
        self.generator = generator
        self.drafts: list[int] = []               # this step's drafted tokens, verified by its forward
        self.num_draft_tokens = num_draft_tokens  # its adaptive k (speculative decoding)
        self.routing = None     # MoE: (>= positions computed, L, k) int16 experts by position, -1 = not computed

    def record_routing(self, start: int, experts) -> None:
        """Keep the experts (n, L, k) the tokens at positions start.. were routed to (a later
        forward of the same position, after a preemption or a rejected draft, overwrites)."""
        import numpy as np

        end = start + len(experts)
        table = self.routing
        if table is None or table.shape[0] < end:
            size = max(end, 2 * (0 if table is None else table.shape[0]))
            grown = np.full((size,) + tuple(experts.shape[1:]), -1, dtype=np.int16)
            if table is not None:
                grown[:table.shape[0]] = table
            table = self.routing = grown
        table[start:end] = experts

    @property
    def finished(self) -> bool:
        return self.output.finish_reason is not None


@dataclass(eq=False)
class PromptImages:
    """A prompt's images: `rows` (N, H) on the model's device, `positions` (N,) the sorted prompt
    positions of their placeholders, `keys` the images' content hashes, `salt` the prefix-cache salt.
    Only `rows` is ever set after construction, once, by the image encoder (images.py)."""

    rows: torch.Tensor | None          # None until the engine's next step encodes them (images.py)
    positions: np.ndarray
    keys: tuple[str, ...]
    salt: int
    rope: np.ndarray | None = None     # (3, prompt length) multimodal rotary positions (module docstring)
    rope_delta: int = 0                # a position p past the prompt turns by p + rope_delta
    runs: tuple[tuple[int, int], ...] = ()   # (first, stop) of each image run read in ONE prefill chunk and
                                             # attended both ways (a `bidirectional` tower: Gemma 3); () none

    def span(self, start: int, stop: int) -> tuple[np.ndarray, torch.Tensor]:
        """(positions - start, rows) of the placeholders at positions start .. stop - 1."""
        assert self.rows is not None, "a step reads a prompt's images after the engine encoded them"
        lo, hi = np.searchsorted(self.positions, [start, stop])
        return self.positions[lo:hi] - start, self.rows[lo:hi]

    def chunk_end(self, start: int, end: int) -> int:
        """The end of a prefill chunk start .. end - 1 moved off the inside of a run: back to the
        run's first position when the chunk holds tokens before it, else on to the run's stop."""
        for first, stop in self.runs:
            if first < end < stop:
                return first if first > start else stop
        return end

    def rope_span(self, start: int, stop: int) -> np.ndarray:
        """(3, stop - start) multimodal rotary positions of positions start .. stop - 1."""
        assert self.rope is not None, "a prompt of a multimodal-rotary model has its table"
        length = self.rope.shape[1]
        inside = min(stop, length) - start
        if inside >= stop - start:
            return self.rope[:, start:stop]
        tail = np.arange(max(start, length), stop) + self.rope_delta
        return np.concatenate([self.rope[:, start:start + max(inside, 0)], np.broadcast_to(tail, (3, len(tail)))], 1)


class Request:
    """A prompt and its n samples (`sequences`, all sharing the prompt's blocks once forked); or,
    with `scoring`, a sequence to score (one `Sequence` that is pre-filled and never samples)."""

    __slots__ = ("output", "params", "sequences", "stop_ids", "prompt_key", "scoring", "images")

    def __init__(self, output: RequestOutput, params: SamplingParams, stop_ids: set[int],
                 scoring: ScoreState | None = None, images: PromptImages | None = None):
        self.images = images            # the prompt's image rows (images.py), None: text only
        self.output = output
        self.params = params
        self.sequences: list[Sequence] = []
        self.stop_ids = stop_ids
        self.prompt_key = tuple(output.prompt_token_ids)    # the rollout proposer's store key
        self.scoring = scoring
