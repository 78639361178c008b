"""Stability records: what `stable_reinforce` reads of each sampled sequence, kept by the server.

    records = StabilityRecords(max_tokens_per_session=4_000_000)
    records.record(session_id, "r-7-0", prompt, tokens, logprobs)     # an asample with record_stability_info
    datum = records.resolve(session_id, datum, "data[0]")             # TinkerAPIError 400, or the datum with
    datum.inputs[SAMPLER_LOGPROBS], datum.inputs[SAMPLED]               # (L,) the sampler's logprobs, 1 where sampled
    records.drop_session(session_id)                                   # the session finished

Design note. A sample request with `record_stability_info` makes the server keep, for each
sequence it returns (named by its `sequence_id`), the prompt, the sampled tokens and the
sampler's logprob of each sampled token, as the engine computed them. A `stable_reinforce`
datum names where its tokens came from with provenance spans (`Datum.with_provenance`): runs of
a recorded prompt or of recorded sampled tokens, tiling its input tokens and its target tokens.
`resolve` checks the claims against the record (the datum's input tokens at every span, and its
target tokens at every sampled span, are the recorded ones, else 400 naming the first
difference; targets named as prompt positions are not compared: tinker-cookbook's rl_loop puts
placeholder 0s there, and they carry no advantage), and that each sampled target is read in the
context it was sampled in: the datum's input up to it is exactly the record's prompt and its
sampled tokens before it. It then gives the loss the sampler's logprobs of the
targets that are sampled tokens, from the record, not from the client: the importance ratio
then compares the learner with what the sampler really computed, whatever the client sends.
A nonzero advantage on a target that is not a sampled token is refused (the loss trains sampled
tokens only).

Records belong to the session that sampled them. Each is kept a day after its last use (a
training request that names it restarts the day, as the hosted service's; `expire` drops the
stale ones of every session), and a session keeps at most `max_tokens_per_session` tokens
(prompt and sampled tokens counted per sequence, plus RECORD_OVERHEAD_TOKENS each for its
bookkeeping): past it the least recently used records go first. A sample request whose
sequences alone would pass the cap is refused (`check_fits`). A datum naming a record that is
gone gets a 400 that says why and how to sample again. A session's records go when it finishes.
Invariant: `_tokens[s]` is the sum of `size` over the records of session s, and each session's
records are ordered by last use, oldest first.
"""
from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .errors import TinkerAPIError
from .wire import Span, WireDatum

SAMPLER_LOGPROBS = "_sampler_logprobs"      # (L,) float32: the recorded logprob of each sampled target, 0 elsewhere
SAMPLED = "_sampled"                        # (L,) float32: 1 where the target is a recorded sampled token
KEEP_S = 24 * 3600.0
RECORD_OVERHEAD_TOKENS = 64                 # a record's Python and numpy bookkeeping, counted as tokens


def sequence_id(request_id: str, index: int) -> str:
    """The `sequence_id` of a sample request's `index`-th sequence (asample answers them)."""
    return f"{request_id}-{index}"


@dataclass
class RecordedSequence:
    prompt: np.ndarray        # (P,) int32, shared by the request's sequences
    tokens: np.ndarray        # (S,) int32, the sampled tokens
    logprobs: np.ndarray      # (S,) float32, the sampler's logprob of each
    used_s: float             # time.monotonic() of its recording or last use

    @property
    def size(self) -> int:
        return len(self.prompt) + len(self.tokens) + RECORD_OVERHEAD_TOKENS


class StabilityRecords:
    """The recorded sequences of each session (module docstring)."""

    def __init__(self, max_tokens_per_session: int, keep_s: float = KEEP_S):
        self.max_tokens_per_session, self.keep_s = max_tokens_per_session, keep_s
        self._sessions: dict[str, OrderedDict[str, RecordedSequence]] = {}
        self._tokens: dict[str, int] = {}

    def num_tokens(self, session_id: str) -> int:
        return self._tokens.get(session_id, 0)

    def record(self, session_id: str, sequence_id: str, prompt: np.ndarray, tokens: list[int] | np.ndarray,
               logprobs: list[float] | np.ndarray, now_s: float | None = None) -> None:
        now_s = time.monotonic() if now_s is None else now_s
        seq = RecordedSequence(prompt, np.asarray(tokens, dtype=np.int32), np.asarray(logprobs, dtype=np.float32),
                               now_s)
        records = self._sessions.setdefault(session_id, OrderedDict())
        records[sequence_id] = seq
        self._tokens[session_id] = self._tokens.get(session_id, 0) + seq.size
        self._expire(session_id, now_s)

    def check_fits(self, num_samples: int, prompt_tokens: int, max_tokens: int) -> None:
        """TinkerAPIError 400 for a sample request whose sequences alone would pass the cap (the
        first would be dropped before its own request is answered)."""
        largest = num_samples * (prompt_tokens + max_tokens + RECORD_OVERHEAD_TOKENS)
        if largest > self.max_tokens_per_session:
            raise TinkerAPIError(400, f"asample: record_stability_info keeps up to {largest} tokens for this request "
                                      f"({num_samples} samples of a {prompt_tokens}-token prompt and {max_tokens} "
                                      f"new tokens), past the session's {self.max_tokens_per_session}; ask for fewer "
                                      "samples or tokens, or raise --max-recorded-tokens-per-session")

    def expire(self, now_s: float | None = None) -> None:
        """Drop every session's records unused for keep_s (the service's periodic sweep)."""
        now_s = time.monotonic() if now_s is None else now_s
        for session_id in list(self._sessions):
            self._expire(session_id, now_s)

    def drop_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
        self._tokens.pop(session_id, None)

    def _expire(self, session_id: str, now_s: float) -> None:
        """Drop the session's records unused for keep_s, then the least recently used past the cap."""
        records = self._sessions[session_id]
        while records:
            oldest_id, oldest = next(iter(records.items()))
            if now_s - oldest.used_s < self.keep_s and self._tokens[session_id] <= self.max_tokens_per_session:
                break
            del records[oldest_id]
            self._tokens[session_id] -= oldest.size

    def _get(self, session_id: str, sequence_id: str, where: str, now_s: float) -> RecordedSequence:
        records = self._sessions.get(session_id, OrderedDict())
        if session_id in self._sessions:
            self._expire(session_id, now_s)
        seq = records.get(sequence_id)
        if seq is None:
            raise TinkerAPIError(400, f"{where}: sequence_id {sequence_id!r} is not recorded in this session. "
                                      "stable_reinforce trains on sequences sampled with record_stability_info=True "
                                      "(save_weights_and_get_sampling_client(record_stability_info=True)) in the same "
                                      f"session; a record is kept {self.keep_s / 3600:g} h after its last use and a "
                                      f"session keeps at most {self.max_tokens_per_session} tokens of them (the least "
                                      "recently used go first): sample it again")
        seq.used_s = now_s
        records.move_to_end(sequence_id)
        return seq

    def resolve(self, session_id: str, datum: WireDatum, where: str, now_s: float | None = None) -> WireDatum:
        """The datum with SAMPLER_LOGPROBS and SAMPLED among its inputs, its provenance checked
        against the session's records (module docstring); TinkerAPIError 400 naming what is wrong."""
        now_s = time.monotonic() if now_s is None else now_s
        if datum.input_spans is None or datum.target_spans is None:
            raise TinkerAPIError(400, f"{where}: loss 'stable_reinforce' needs provenance on every datum, naming "
                                      "the sampled sequence behind its tokens (Datum.with_provenance with the "
                                      "sequence_id of each SampledSequence)")
        targets = np.asarray(datum.inputs["target_tokens"], dtype=np.int64)
        self._check_spans(session_id, datum.input_spans, datum.tokens, f"{where}.model_input", now_s,
                          ("prompt", "sampled"))
        recorded = self._check_spans(session_id, datum.target_spans, targets,
                                     f"{where}.loss_fn_inputs['target_tokens']", now_s, ("sampled",))
        self._check_contexts(datum, recorded, where)
        sampler_logprobs = np.zeros(len(targets), dtype=np.float32)
        sampled = np.zeros(len(targets), dtype=np.float32)
        start = 0
        for span, seq in zip(datum.target_spans, recorded):
            if span.kind == "sampled":
                sampler_logprobs[start:start + span.length] = seq.logprobs[span.offset:span.offset + span.length]
                sampled[start:start + span.length] = 1.0
            start += span.length
        unsampled = np.flatnonzero((np.asarray(datum.inputs["advantages"]) != 0) & (sampled == 0))
        if len(unsampled):
            raise TinkerAPIError(400, f"{where}: advantages are nonzero at position {int(unsampled[0])}, whose "
                                      "target the provenance names a prompt token; stable_reinforce trains sampled "
                                      "tokens only: put 0 there")
        inputs = {**datum.inputs, SAMPLER_LOGPROBS: sampler_logprobs, SAMPLED: sampled}
        return dataclasses.replace(datum, inputs=inputs)

    @staticmethod
    def _check_contexts(datum: WireDatum, recorded: list[RecordedSequence], where: str) -> None:
        """Each sampled target span's context: the datum's input up to its last target is exactly
        the record's prompt and its sampled tokens before that target (the sampler's context)."""
        assert datum.target_spans is not None, "resolve checks provenance first"
        start = 0
        for span, seq in zip(datum.target_spans, recorded):
            if span.kind == "sampled" and span.length:
                context = np.concatenate([seq.prompt, seq.tokens[:span.offset + span.length - 1]])
                end = start + span.length                   # inputs 0 .. end - 1 predict targets up to it
                if end != len(context) or not np.array_equal(datum.tokens[:end], context):
                    raise TinkerAPIError(400, f"{where}: targets {start} to {end - 1} are sampled tokens of "
                                              f"{span.sequence_id!r}, but the model_input before them is not that "
                                              "sequence's prompt and its sampled tokens before them; a "
                                              "stable_reinforce datum is the sampled sequence's prompt and tokens, "
                                              "each target the token after its input (as Datum.with_provenance "
                                              "in tinker-cookbook's rl_loop)")
            start += span.length

    def _check_spans(self, session_id: str, spans: list[Span], values: np.ndarray, where: str, now_s: float,
                     compared: tuple[str, ...]) -> list[RecordedSequence]:
        """Each span's record, after checking that the spans tile `values` and that each run of
        `values` under a span of a kind in `compared` is the recorded one."""
        total = sum(span.length for span in spans)
        if total != len(values):
            raise TinkerAPIError(400, f"{where}: its provenance spans cover {total} positions, it has "
                                      f"{len(values)}; the spans must tile it")
        out, start = [], 0
        for span in spans:
            seq = self._get(session_id, span.sequence_id, where, now_s)
            source = seq.tokens if span.kind == "sampled" else seq.prompt
            if span.offset + span.length > len(source):
                raise TinkerAPIError(400, f"{where}: a {span.kind} span of {span.sequence_id!r} covers positions "
                                          f"{span.offset} to {span.offset + span.length - 1}; the recorded "
                                          f"{'sampled tokens' if span.kind == 'sampled' else 'prompt'} has "
                                          f"{len(source)}")
            claimed = values[start:start + span.length]
            differ: np.ndarray = np.flatnonzero(claimed != source[span.offset:span.offset + span.length]) \
                if span.kind in compared else np.zeros(0, dtype=np.int64)
            if len(differ):
                at = int(differ[0])
                raise TinkerAPIError(400, f"{where}: position {start + at} holds token {int(claimed[at])}, but its "
                                          f"provenance names token {int(source[span.offset + at])} (position "
                                          f"{span.offset + at} of {span.sequence_id!r}'s {span.kind} tokens)")
            out.append(seq)
            start += span.length
        return out
