"""The generator actor: the engine behind the microkernel.

    [[actors]]
    name = "generator"
    cls = "postrain.actors.generator_actor:GeneratorActor"
    options = { model = "tiny", kv_cache_mb = 64, max_num_seqs = 32, seed = 0 }
    # weight_precision = "float16": float16 weight copies (x86 CPU), see Engine

Messages:
- `generate` {"prompt_ids": [int] (or "prompt": str), "sampling": {SamplingParams fields}}
  -> {"prompt_len", "samples": [{"token_ids", "logprobs", "policy_versions",
  "finish_reason", "text"}]}: exact sampled ids, their logprobs (see
  postrain.actors.sampling) and the policy version that sampled each token.
- `load_weights` {"version": v, "weights": {name: tensor}} -> {"version": v}: swapped in
  between two engine steps; in-flight sequences go on, and tokens sampled afterwards
  carry v. A version lower than the current one is refused.
- `stats` -> the engine's KV utilisation, batch size, queue depth, tokens/s.

Design note. One task owns the engine. Handlers never touch it: they queue
requests and weights, and wait for an event. The engine task drains the
queues between steps and runs each step in a worker thread, so the event loop
keeps answering (heartbeats, new requests) while the model computes; requests
that arrive during a step join the batch at the next one (continuous batching).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import anyio
import anyio.to_thread

from postrain.core import Actor, handler

from .checkpoint import load_model
from .engine import Engine, RequestOutput
from .sampling import SamplingParams


@dataclass
class _Waiter:
    done: anyio.Event = field(default_factory=anyio.Event)
    output: RequestOutput | None = None
    error: Exception | None = None


class GeneratorActor(Actor):
    async def setup(self):
        options = self.options
        self.model, self.tokenizer = load_model(options.get("model", "tiny"), seed=options.get("seed", 0))
        self.engine = Engine(self.model, self.tokenizer, kv_cache_mb=options.get("kv_cache_mb", 64),
                             max_num_seqs=options.get("max_num_seqs", 32), seed=options.get("seed", 0),
                             weight_precision=options.get("weight_precision", "float32"))
        self._request_ids = itertools.count()
        self._new_requests: list[tuple[str, list[int] | str, SamplingParams]] = []
        self._waiters: dict[str, _Waiter] = {}       # request id -> its caller, until answered
        self._in_engine: set[str] = set()            # request ids the engine holds
        self._new_weights: list[tuple[dict, int, anyio.Event, list]] = []
        self._work = anyio.Event()
        self.node.spawn(self._engine_loop)

    @handler("generate", concurrent=True)
    async def generate(self, body):
        """Cancelled: the request is aborted at the next step."""
        params = SamplingParams(**(body.get("sampling") or {}))
        prompt = body.get("prompt_ids")
        prompt = [int(t) for t in prompt] if prompt is not None else body["prompt"]
        request_id = str(next(self._request_ids))
        waiter = self._waiters[request_id] = _Waiter()
        self._new_requests.append((request_id, prompt, params))
        self._work.set()
        try:
            await waiter.done.wait()
        finally:
            self._waiters.pop(request_id, None)
        if waiter.error is not None:
            raise waiter.error
        out = waiter.output
        return {"prompt_len": len(out.prompt_token_ids),
                "samples": [{"token_ids": s.token_ids, "logprobs": s.logprobs,
                             "policy_versions": s.policy_versions, "finish_reason": s.finish_reason,
                             "text": s.text} for s in out.outputs]}

    @handler("load_weights")
    async def load_weights(self, body):
        version = int(body["version"])
        if version < self.engine.policy_version:
            raise ValueError(f"policy version must not go back: generator is at "
                             f"{self.engine.policy_version}, got {version}")
        applied, result = anyio.Event(), []
        self._new_weights.append((body["weights"], version, applied, result))
        self._work.set()
        await applied.wait()
        if result and isinstance(result[0], Exception):
            raise result[0]
        return {"version": version}

    @handler("stats")
    async def stats(self, body):
        return self.engine.stats()

    def load(self):
        stats = self.engine.stats()
        return {**super().load(), "gen_running": stats["num_running"], "gen_waiting": stats["num_waiting"],
                "kv_utilization": round(stats["kv_utilization"], 3), "policy_version": stats["policy_version"]}

    async def _engine_loop(self) -> None:
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
            for request_id, prompt, params in requests:
                try:
                    engine.add_request(prompt, params, request_id=request_id)
                    self._in_engine.add(request_id)
                except Exception as exc:
                    self._finish(request_id, None, exc)
            for request_id in self._in_engine - self._waiters.keys():
                engine.abort(request_id)  # its caller was cancelled
                self._in_engine.discard(request_id)
            if engine.has_unfinished():
                for output in await anyio.to_thread.run_sync(engine.step):
                    self._in_engine.discard(output.request_id)
                    self._finish(output.request_id, output, None)

    def _finish(self, request_id: str, output, error) -> None:
        waiter = self._waiters.get(request_id)
        if waiter is not None:
            waiter.output, waiter.error = output, error
            waiter.done.set()
