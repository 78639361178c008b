"""Sampling for the Tinker API: saved sampler weights, sampling sessions, and `asample` on
postrain's generator engine, in process.

    store = SamplerStore(kv_cache_mb=64)
    path = store.save(model_id, name, held, tenant.merged_weights())   # "tinker://m-1/sampler_weights/s1"
    sampler = store.open_session(session_id, held, path)               # or path None: the base model
    body = sampler.sample(prompt_ids, num_samples, params, prompt_logprobs=True)   # SampleResponse bytes

Design note. A saved sampler path is a snapshot of the merged weights (base + scale * B @ A,
the function the learner publishes with); an engine (actors/generator/engine.py: paged KV
cache, the generator's sampler and logprobs) is built once per path on a model holding those
weights and shared by every sampling session of that path. Requests on the same weights are
batched continuously, as the generator actor batches: each waits in its weights' `pending` list,
and every engine step (`step_engine`, under the service's compute limiter) first admits all
that wait, then decodes every request in flight together; a request is answered the step it
finishes. A request's samples depend on its own seed only, not on what shares its steps. The sampled
logprobs are the engine's (log_softmax of logits / T, T the temperature, 1 for greedy); prompt
logprobs are the model's at T = 1, NaN at position 0.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import numpy as np
import torch

from ..generator.engine import Engine
from ..models.config import ModelConfig
from ..models.loading import model_from_state
from ..records import SamplingParams
from .base_models import HeldModel
from .errors import TinkerAPIError
from .wire import WireSequence, encode_sample_response

DEFAULT_MAX_TOKENS = SamplingParams().max_new_tokens


@dataclass
class PendingSample:
    """A sample request accepted and waiting for its weights' next engine call."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    prompt_logprobs: bool
    record_in: str | None = None   # the session that keeps its sequences for stable_reinforce, or None


@dataclass
class SamplerWeights:
    path: str | None              # None: the base model's own weights
    held: HeldModel
    state: dict[str, torch.Tensor] | None
    config: ModelConfig | None = None   # the model's config when not the base's (an adapted, untied head)
    engine: Engine | None = None  # built on first use
    # Invariant: `draining` is True while a task of the service steps these weights' engine; it
    # admits every pending request before each step and stops when none waits and none is in
    # flight. `in_flight` maps the engine's request ids to the requests admitted and unanswered.
    pending: list[PendingSample] = field(default_factory=list)
    in_flight: dict[str, PendingSample] = field(default_factory=dict)
    draining: bool = False

    def engine_for(self, kv_cache_mb: float) -> Engine:
        if self.engine is None:
            held = self.held
            state = self.state if self.state is not None else {k: v.detach().clone() for k, v in
                                                               held.model.state_dict().items()}
            model = model_from_state(self.config or held.model.config, state,
                                     source=f"sampler weights {self.path or held.name}")
            self.engine = Engine(model, held.tokenizer, kv_cache_mb=kv_cache_mb, seed=held.seed)
        return self.engine


@dataclass
class Answered:
    """A request that finished: its SampleResponse bytes and sequences, or the error that
    refused it at admission."""

    item: PendingSample
    answer: bytes | Exception
    sequences: list[WireSequence] = field(default_factory=list)


def step_engine(weights: SamplerWeights, admit: list[PendingSample], kv_cache_mb: float) -> list[Answered]:
    """Admit `admit` into the weights' engine, run one engine step, and return each request that
    finished (run it from a worker thread, one call at a time)."""
    engine = weights.engine_for(kv_cache_mb)
    answered: list[Answered] = []
    for item in admit:
        try:
            weights.in_flight[engine.add_request(item.prompt, item.params)] = item
        except Exception as exc:            # this request's own fault: the others go on
            answered.append(Answered(item, exc))
    if engine.has_unfinished():
        for output in engine.step():
            item = weights.in_flight.pop(output.request_id)
            sequences = [WireSequence(list(c.token_ids), list(c.logprobs),
                                      "length" if c.finish_reason == "length" else "stop") for c in output.outputs]
            scored = prompt_logprobs(engine, item.prompt) if item.prompt_logprobs else None
            answered.append(Answered(item, encode_sample_response(sequences, scored, output.num_cached_prompt_tokens),
                                     sequences))
    return answered


@torch.no_grad()
def prompt_logprobs(engine: Engine, prompt: list[int]) -> np.ndarray:
    """The model's logprob of each prompt token given the ones before it (T = 1), NaN at position 0."""
    model = engine.model
    ids = torch.tensor([prompt], dtype=torch.long)                                  # (1, P)
    hidden = model.hidden_states(ids)[0]                                            # (P, H)
    logits = hidden[:-1] @ model.lm_head.weight.t()                                 # (P - 1, V)
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
    return np.concatenate([[np.nan], logp.numpy()]).astype(np.float32)


def engine_params(params: dict, num_samples: int, prompt_len: int, held: HeldModel) -> SamplingParams:
    """The engine's SamplingParams for a Tinker `sampling_params` dict; TinkerAPIError 400 for a value
    out of range (a prompt and max_tokens over the context included)."""
    room = held.max_context_tokens - prompt_len
    max_tokens = params.get("max_tokens")
    max_tokens = min(DEFAULT_MAX_TOKENS, room) if max_tokens is None else int(max_tokens)
    if room < 1 or max_tokens > room:
        raise TinkerAPIError(400, f"sampling_params.max_tokens={max_tokens} with a {prompt_len}-token prompt "
                                  f"exceeds {held.name!r}'s context of {held.max_context_tokens} tokens; "
                                  f"ask for at most {max(room, 0)}")
    stop = params.get("stop")
    strings: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] = ()
    ignore_eos = False
    if isinstance(stop, str):
        strings = (stop,)
    elif stop is not None and all(isinstance(s, str) for s in stop):
        strings = tuple(stop)
        ignore_eos = len(stop) == 0           # `[]`: no stop at all, EOS included
    elif stop is not None:
        stop_ids, ignore_eos = tuple(int(s) for s in stop), True   # token ids replace the EOS ids
    top_k = int(params.get("top_k", -1))
    try:
        return SamplingParams(n=num_samples, temperature=float(params.get("temperature", 1.0)),
                              top_p=float(params.get("top_p", 1.0)), top_k=0 if top_k < 0 else top_k,
                              seed=params.get("seed"), max_new_tokens=max_tokens, stop=strings,
                              stop_token_ids=stop_ids, ignore_eos=ignore_eos)
    except ValueError as exc:
        raise TinkerAPIError(400, f"sampling_params: {exc}") from None


class Sampler:
    """One sampling session: the weights it samples from."""

    def __init__(self, sampling_session_id: str, session_id: str, weights: SamplerWeights, kv_cache_mb: float):
        self.sampling_session_id, self.session_id, self.weights = sampling_session_id, session_id, weights
        self.kv_cache_mb = kv_cache_mb
        self.num_clients = 1      # join_sampling_session hands out 1, 2, ... (the original client is 0)

    @property
    def base_model(self) -> str:
        return self.weights.held.name

    @property
    def model_path(self) -> str | None:
        return self.weights.path


UNNAMED = "auto-"           # the name prefix of weights saved without a name (save_weights_and_get_sampling_client)
MAX_UNNAMED_PER_MODEL = 4   # unnamed saves a training client keeps; an older one is dropped with its sessions
MAX_RETIRED_KEPT = 4096     # dropped sessions remembered, to answer them 410 rather than 404


class SamplerStore:
    """Saved sampler weights by path and sampling sessions by id. Each save holds a merged copy
    of the model, so a training client keeps only its MAX_UNNAMED_PER_MODEL newest unnamed saves
    (a loop that samples from a fresh save every step, as tinker-cookbook's rl_loop does, would
    otherwise hold one per step): an older one, and the sampling sessions on it, are dropped;
    named saves stay until the training client ends."""

    def __init__(self, kv_cache_mb: float = 64.0):
        self.kv_cache_mb = kv_cache_mb
        self._weights: dict[str, SamplerWeights] = {}
        self._bases: dict[str, SamplerWeights] = {}
        self._sessions: dict[str, Sampler] = {}
        self._retired: dict[str, str] = {}      # dropped sampling session id -> the path it sampled
        self._unnamed: dict[str, list[str]] = {}    # model id -> its unnamed saves' paths, oldest first

    def save(self, model_id: str, name: str | None, held: HeldModel, state: dict[str, torch.Tensor],
             config: ModelConfig | None = None) -> str:
        """The path of `state` saved under `name`, or under a new unnamed one (name None)."""
        path = f"tinker://{model_id}/sampler_weights/{name or UNNAMED + uuid.uuid4().hex[:8]}"
        self._weights[path] = SamplerWeights(path, held, state, config)
        if name is None:
            unnamed = self._unnamed.setdefault(model_id, [])
            unnamed.append(path)
            while len(unnamed) > MAX_UNNAMED_PER_MODEL:
                self._retire(unnamed.pop(0))
        return path

    def _retire(self, path: str) -> None:
        weights = self._weights.pop(path)
        for key in [k for k, s in self._sessions.items() if s.weights is weights]:
            del self._sessions[key]
            self._retired[key] = path
        while len(self._retired) > MAX_RETIRED_KEPT:
            del self._retired[next(iter(self._retired))]

    def open_session(self, session_id: str, held: HeldModel | None, path: str | None,
                     register: bool = True) -> Sampler:
        """A new sampling session on the weights at `path`, or on `held`'s base weights; kept by its
        id unless `register` is False (a one-off asample that names its weights itself)."""
        if path is not None:
            weights = self._weights.get(path)
            if weights is None:
                raise TinkerAPIError(404, f"model_path {path!r} names no saved sampler weights on this server; "
                                          "save them first with save_weights_for_sampler")
        else:
            assert held is not None, "a sampling session names a path or a base model"
            weights = self._bases.setdefault(held.name, SamplerWeights(None, held, None))
        sampler = Sampler(f"sampler-{uuid.uuid4().hex[:16]}", session_id, weights, self.kv_cache_mb)
        if register:
            self._sessions[sampler.sampling_session_id] = sampler
        return sampler

    def get(self, sampling_session_id: str | None) -> Sampler:
        sampler = self._sessions.get(sampling_session_id or "")
        if sampler is None and sampling_session_id in self._retired:
            raise TinkerAPIError(410, f"sampling session {sampling_session_id!r} sampled the unnamed weights "
                                      f"{self._retired[sampling_session_id]}, dropped when the training client saved "
                                      f"{MAX_UNNAMED_PER_MODEL} newer ones; sample from a newer save, or name the "
                                      "weights you keep (save_weights_for_sampler(name))")
        if sampler is None:
            raise TinkerAPIError(404, f"unknown sampling_session_id {sampling_session_id!r}; create one with "
                                      "create_sampling_client")
        return sampler

    def close_sessions_of(self, session_id: str) -> None:
        for key in [k for k, s in self._sessions.items() if s.session_id == session_id]:
            del self._sessions[key]

    def forget_weights_of(self, model_id: str) -> None:
        self._unnamed.pop(model_id, None)
        for path in [p for p in self._weights if p.startswith(f"tinker://{model_id}/")]:
            del self._weights[path]
