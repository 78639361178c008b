"""What the Tinker server does for each endpoint, apart from HTTP (app.py routes to it).

    service = TinkerService(BaseModels.load(["tiny"]), TinkerOptions(), nursery)
    await service.create_model(body)          # -> {"request_id": ...}; the result through retrieve_future

Design note. The hosted Tinker API is asynchronous: a training or sampling POST is accepted at
once with a request id (a future), the work runs later, and the client polls
`retrieve_future`. Here, checks that need no compute (a known model_id, token ids inside the
vocabulary, a loss and its inputs) run in the POST, so bad input is a 4xx at once and never
reaches a queue; the work itself runs in a worker thread under one compute limiter (every
tenant shares the base models, and one computes at a time), in each training client's seq_id
order (ordering.py). A failure while it runs fails that request's future alone: the other
tenants and the server go on.

Limits and eviction. Admission rules answer 429 with Retry-After (`_refuse`): a base takes
at most `max_training_clients_per_base` resident tenants (create_model; evicted ones do not
count) and, where `max_training_memory_mb_per_base` is set, at most that much resident training
state (LoRA weights, gradients, AdamW moments: `tenants.training_state_bytes`; a tenant evicted
and later resumed on its next request is not refused), and a session has at most `max_queued_requests_per_session` requests accepted and not
yet finished (training ops and samples; a re-sent request already accepted is answered, never
refused); the sandbox extension (sandbox_runs.py) adds a third, at most `sandbox_workers` runs at
once. A tenant with nothing queued or running and no request for `evict_after_s` is
evicted (`evict_idle`, run every `_sweep_period_s` and before a create_model is refused): its
state goes to a file in `state_dir` and its adapter leaves the base. Each op of a tenant runs
through `_resident`, which resumes an evicted tenant first, in the op's worker thread under the
compute limiter, so eviction and resumption never overlap a compute, and a restore is never
refused (its request was already accepted): a base may then hold more than its limit until
its idle tenants are evicted.

Batching tenants. With `batch_tenants` (the default), the `forward_backward` and `forward`
requests of one base's tenants that are ready at the same time run as one compute: each such
op, once its seq_id's turn comes (`_drain`), joins its base's pending list instead of taking
the compute limiter itself, and one task per base (`_run_batches`) takes, each time it holds
the limiter, every op pending then (the window is zero: what came while the previous compute
ran, nothing is waited for), up to `batch_tenants_max_tokens` padded tokens, and runs them as
one forward and one backward (tenants.forward_backward_together: each adapter on its own rows,
each tenant's loss on its rows as alone, their sum backpropagated once; the adapters are
disjoint, so each gets its own gradient). Each op's result goes to its own future, and its
tenant's drain goes on only then, so each tenant has at most one op pending and its seq_id
order, dedup and eviction (a tenant with an op pending is `running`) are as without batching;
an op not ready (waiting for an earlier seq_id) is not pending and holds nobody back. An op
alone in its batch runs exactly as without batching. A batch whose forward fails is run again
op by op (each fails alone, or succeeds); one whose backward fails fails its training ops (their
gradients may hold part of it). `num_batched_forwards` and `num_batched_ops` count the
computes of two or more ops and the ops they ran.
"""
from __future__ import annotations

import dataclasses
import logging
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, NoReturn

import numpy as np
import trio
from ..records import SamplingParams
from .base_models import BaseModels, HeldModel
from .batching import BatchableOp, compute_batch, failure, outcome, take_batch
from .errors import SUPPORTED_SDK_VERSION, TinkerAPIError, check_sdk_version
from .futures import FutureStore, Result
from .losses import check_loss_inputs, loss_config
from .options import TinkerOptions
from .ordering import Op, SeqOrder
from .sampling import Answered, PendingSample, SamplerStore, SamplerWeights, engine_params, step_engine
from .sandbox_runs import SandboxRuns
from .sessions import SessionStore
from .stability import StabilityRecords, sequence_id
from .tenants import TenantCheckpoint, TenantJob, TrainingTenant, lora_targets, training_state_bytes
from .wire import ForwardBackwardCall, decode_forward_backward, encode_forward_backward_output

log = logging.getLogger("postrain.tinker")

# Flags the SDK reads from /client/config: plain httpx, chunks sent in parallel (executed in order
# here), no server-side custom losses, no retrieve_futures poller.
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "use_pyqwest_transport": False,
                 "parallel_fwdbwd_chunks": True, "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
                 "custom_loss_server_side": False, "sample_join_sampling_session": False}
UNSUPPORTED_SAMPLE_FIELDS = ("topk_prompt_logprobs", "topk_sample_logprobs", "target_prompt_logprobs",
                             "prompt_alt_tokens_k", "prompt_logprobs_last_n")


def _check(cls, body: dict, where: str):
    """`body` validated into the SDK's own request type `cls`; TinkerAPIError 400 naming the fields."""
    from pydantic import ValidationError
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
        raise TinkerAPIError(400, f"{where}: the body is not a valid request ({problems})") from None


class TinkerService:
    """Sessions, tenants, samplers and futures of one server (module docstring)."""

    def __init__(self, bases: BaseModels, options: TinkerOptions, nursery: trio.Nursery):
        self.bases, self.options, self.nursery = bases, options, nursery
        self.sessions = SessionStore()
        self.futures = FutureStore(poll_wait_s=options.poll_wait_s)
        self.samplers = SamplerStore(kv_cache_mb=options.kv_cache_mb)
        self.stability = StabilityRecords(options.max_recorded_tokens_per_session)
        self.compute = trio.CapacityLimiter(1)
        self.tenants: dict[str, TrainingTenant] = {}
        self.orders: dict[str, SeqOrder] = {}
        self._created: dict[tuple[str, str, int], str] = {}     # (session, kind, seq) -> request or sampler id
        self._samples: dict[tuple[str, int], dict] = {}         # (sampling session, seq_id) -> the POST's answer
        self.checkpoints: dict[str, TenantCheckpoint] = {}      # tinker://MODEL_ID/weights/NAME -> saved state
        self._num_creating: dict[str, int] = {}                 # base -> tenants being built (counted as resident)
        self._bytes_creating: dict[str, int] = {}               # base -> their training state, bytes
        self._pending_batch: dict[str, list[BatchableOp]] = {}  # base -> ready forward_backward ops, FIFO
        self.num_batched_forwards = 0                           # computes of two or more tenants' ops
        self.num_batched_ops = 0                                # the ops they ran
        self.trio_token = trio.lowlevel.current_trio_token()    # for callers on other threads (tests)
        self._owns_state_dir = options.state_dir is None
        self.state_dir = Path(options.state_dir or tempfile.mkdtemp(prefix="postrain-tinker-"))
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.sandbox = SandboxRuns(num_workers=options.sandbox_workers, timeout_s=options.sandbox_timeout_s,
                                   max_timeout_s=options.sandbox_max_timeout_s,
                                   max_output_bytes=options.sandbox_max_output_bytes,
                                   memory_mb=options.sandbox_memory_mb, refuse=self._refuse,
                                   enabled=options.enable_sandbox)
        if options.evict_after_s is not None or options.session_timeout_s is not None:
            nursery.start_soon(self._sweep)

    def close(self) -> None:
        """Stop the sandbox extension's jails; delete what the server wrote to state_dir (the folder
        too when it made it); at stop."""
        self.sandbox.close()
        for tenant in self.tenants.values():
            if tenant.evicted_to is not None:
                tenant.evicted_to.unlink(missing_ok=True)
        if self._owns_state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    # ------------------------------------------------------------------ sessions
    def client_config(self, body: dict) -> dict:
        check_sdk_version(body.get("sdk_version"), "client/config")
        return dict(CLIENT_CONFIG)

    def create_session(self, body: dict) -> dict:
        from tinker import types
        request = _check(types.CreateSessionRequest, body, "create_session")
        session_id = self.sessions.create(request.sdk_version, request.tags, request.user_metadata)
        return {"type": "create_session", "session_id": session_id,
                "info_message": f"postrain Tinker server (tinker=={SUPPORTED_SDK_VERSION})"}

    def heartbeat(self, body: dict) -> dict:
        self.sessions.heartbeat(str(body.get("session_id")))
        return {"type": "session_heartbeat"}

    async def finish_session(self, session_id: str, body: dict) -> None:
        """Finish the session and free its tenants and sampling sessions. Cancelled: the session is
        finished; tenants not yet freed stay until the server stops."""
        reason = str((body.get("reason") or {}).get("type", "success"))
        session = self.sessions.finish(session_id, reason)
        if session is None:
            return
        self.samplers.close_sessions_of(session_id)
        self.stability.drop_session(session_id)
        for model_id in session.model_ids:
            await self.drop_tenant(model_id)
        self.futures.forget(session_id)                 # its results are not asked for again

    async def drop_tenant(self, model_id: str) -> None:
        tenant = self.tenants.pop(model_id, None)
        self.orders.pop(model_id, None)
        self.samplers.forget_weights_of(model_id)
        if tenant is not None:
            await trio.to_thread.run_sync(tenant.close, limiter=self.compute)

    def capabilities(self) -> dict:
        return {"supported_models": self.bases.capabilities()}

    # ------------------------------------------------------------------ training clients
    async def create_model(self, body: dict) -> dict:
        from tinker import types
        request = _check(types.CreateModelRequest, body, "create_model")
        key = (request.session_id, "model", request.model_seq_id)
        self.sessions.get(request.session_id)
        if key in self._created:
            return {"request_id": self._created[key]}
        held = self.bases.get(request.base_model)
        if request.optimizer_config.type != "adamw":
            raise TinkerAPIError(400, f"optimizer_config.type {request.optimizer_config.type!r} is not supported; "
                                      "this server trains with AdamW ('adamw')")
        lora = request.lora_config or types.LoraConfig(rank=32)
        targets = lora_targets(lora.train_attn, lora.train_mlp, lora.train_unembed)
        seed = lora.seed if lora.seed is not None else secrets.randbelow(2 ** 31)
        tenant = await self._new_tenant(request.session_id, request.model_seq_id, held, lora.rank, seed, targets)
        request_id = self.futures.open(request.session_id)
        self.futures.resolve(request_id, Result.json({"model_id": tenant.model_id, "type": "create_model"}))
        self._created[key] = request_id
        return {"request_id": request_id, "model_id": tenant.model_id}

    async def _new_tenant(self, session_id: str, model_seq_id: int, held: HeldModel, rank: int, seed: int,
                          targets: tuple[str, ...]) -> TrainingTenant:
        """A new tenant of the session, its id `SESSION:train:SEQ` (the id the SDK derives itself); 429
        when `held` has max_training_clients_per_base resident tenants and none is idle past
        evict_after_s. Cancelled: no tenant is added (one built meanwhile is dropped)."""
        session = self.sessions.get(session_id)
        limit = self.options.max_training_clients_per_base
        needed = training_state_bytes(held.model, rank, targets)
        if self.num_resident(held.name) >= limit or not self._memory_fits(held.name, needed):
            await self.evict_idle()
        self._check_memory(held.name, needed, rank)
        if (num := self.num_resident(held.name)) >= limit:
            idle = ("" if self.options.evict_after_s is None else
                    f" or let a training client idle past evict_after_s={self.options.evict_after_s:g} s")
            self._refuse(f"base model {held.name!r} holds {num} training clients, the most it takes "
                         f"(max_training_clients_per_base={limit}); finish a session (ServiceClient.close){idle} to "
                         "free one, or raise the limit with `postrain serve --tinker --max-training-clients-per-base N`")
        model_id = f"{session_id}:train:{model_seq_id}"
        self._num_creating[held.name] = self._num_creating.get(held.name, 0) + 1    # its slot, while it is built
        self._bytes_creating[held.name] = self._bytes_creating.get(held.name, 0) + needed
        try:
            tenant = await trio.to_thread.run_sync(
                lambda: TrainingTenant(model_id, held, rank=rank, seed=seed, targets=targets, session_id=session_id),
                limiter=self.compute)
        finally:
            self._num_creating[held.name] -= 1
            self._bytes_creating[held.name] -= needed
        self.tenants[model_id] = tenant
        self.orders[model_id] = SeqOrder(model_id)
        session.model_ids.append(model_id)
        return tenant

    def resident_bytes(self, base_model: str) -> int:
        """The training state of `base_model`'s resident tenants and of those being built, bytes."""
        return (sum(t.state_bytes for t in self.tenants.values() if t.held.name == base_model and t.is_resident)
                + self._bytes_creating.get(base_model, 0))

    def _memory_fits(self, base_model: str, needed: int) -> bool:
        limit_mb = self.options.max_training_memory_mb_per_base
        return limit_mb is None or self.resident_bytes(base_model) + needed <= limit_mb * 2**20

    def _check_memory(self, base_model: str, needed: int, rank: int) -> None:
        """400 for a tenant larger than the whole budget; 429 when the resident ones leave no room."""
        limit_mb = self.options.max_training_memory_mb_per_base
        if limit_mb is None or self._memory_fits(base_model, needed):
            return
        if needed > limit_mb * 2**20:
            raise TinkerAPIError(400, f"a rank-{rank} adapter on {base_model!r} needs {needed / 2**20:.1f} MiB of "
                                      f"training state, more than max_training_memory_mb_per_base={limit_mb:g}; "
                                      "lower lora_config.rank, or raise the limit with `postrain serve --tinker "
                                      "--max-training-memory-mb-per-base MB`")
        self._refuse(f"base model {base_model!r} holds {self.resident_bytes(base_model) / 2**20:.1f} MiB of training "
                     f"state and a rank-{rank} adapter needs {needed / 2**20:.1f} MiB more, past "
                     f"max_training_memory_mb_per_base={limit_mb:g}; finish a session (ServiceClient.close) to free "
                     "some, or raise the limit with `postrain serve --tinker --max-training-memory-mb-per-base MB`")

    def num_resident(self, base_model: str) -> int:
        """Tenants of `base_model` whose adapter is on it or being built (evicted ones are not)."""
        return (sum(t.is_resident for t in self.tenants.values() if t.held.name == base_model)
                + self._num_creating.get(base_model, 0))

    def _refuse(self, message: str) -> NoReturn:
        """Raise the 429 of a limit: `{"detail": message}` and Retry-After: retry_after_s."""
        raise TinkerAPIError(429, message + f"; retry after {self.options.retry_after_s} s (the tinker SDK "
                                            "retries a 429 by itself)", retry_after_s=self.options.retry_after_s)

    def _check_queue(self, session_id: str | None) -> None:
        """429 when the session has max_queued_requests_per_session requests not yet finished."""
        limit = self.options.max_queued_requests_per_session
        if session_id and (num := self.futures.num_pending(session_id)) >= limit:
            self._refuse(f"session {session_id!r} has {num} requests queued and not yet finished, the most it may "
                         f"(max_queued_requests_per_session={limit}); wait for earlier results, or raise the limit "
                         "with `postrain serve --tinker --max-queued-requests-per-session N`")

    def tenant(self, model_id: str | None) -> TrainingTenant:
        tenant = self.tenants.get(model_id or "")
        if tenant is None:
            raise TinkerAPIError(404, f"unknown model_id {model_id!r}: no training client of that id is held here "
                                      "(never created, or its session finished); create one with "
                                      "create_lora_training_client")
        return tenant

    def get_info(self, body: dict) -> dict:
        tenant = self.tenant(body.get("model_id"))
        held = tenant.held
        return {"type": "get_info", "model_id": tenant.model_id, "is_lora": True, "lora_rank": tenant.rank,
                "model_name": held.name, "model_data": {"arch": held.architecture, "model_name": held.name,
                                                        "tokenizer_id": None}}

    def forward_backward(self, body: bytes) -> dict:
        call = decode_forward_backward(body)
        tenant = self.tenant(call.model_id)
        config = loss_config(call.loss_fn, call.loss_fn_config)
        self._check_datums(call, tenant.held)
        order = self.orders[tenant.model_id]
        if call.loss_fn == "stable_reinforce" and call.seq_id not in order.request_ids:   # not a re-sent request
            call = dataclasses.replace(call, datums=[self.stability.resolve(tenant.session_id or "", d, f"data[{i}]")
                                                     for i, d in enumerate(call.datums)])

        def work() -> Result:
            outputs, metrics = tenant.forward_backward(call.datums, call.loss_fn, config, call.forward_only)
            return Result.proto(encode_forward_backward_output(outputs, metrics))
        job = TenantJob(tenant, call.datums, call.loss_fn, config, call.forward_only)
        return self._submit(tenant, call.seq_id, work, job if self.options.batch_tenants else None)

    def _check_datums(self, call: ForwardBackwardCall, held: HeldModel) -> None:
        if not call.datums:
            raise TinkerAPIError(400, "forward_backward got no data; send at least one Datum")
        for i, d in enumerate(call.datums):
            where = f"data[{i}]"
            if len(d.tokens) == 0 or len(d.tokens) > held.max_context_tokens:
                raise TinkerAPIError(400, f"{where}.model_input has {len(d.tokens)} tokens; {held.name!r} takes 1 to "
                                          f"{held.max_context_tokens}")
            check_loss_inputs(call.loss_fn, d.inputs, len(d.tokens), where)
            _check_ids(d.tokens, held, f"{where}.model_input")
            _check_ids(d.inputs["target_tokens"], held, f"{where}.loss_fn_inputs['target_tokens']")
            for name, value in d.inputs.items():
                if not np.all(np.isfinite(value)):
                    raise TinkerAPIError(400, f"{where}.loss_fn_inputs[{name!r}] holds a NaN or infinity")

    def optim_step(self, body: dict) -> dict:
        from tinker import types
        tenant = self.tenant(body.get("model_id"))
        params = body.get("adam_params") or body.get("optim_params") or body.get("optimizer_params")
        if not isinstance(params, dict):
            raise TinkerAPIError(400, "optim_step: the body carries no adam_params; send AdamParams(learning_rate=...)")
        if params.get("type", "adam") not in ("adam", "adamw"):
            raise TinkerAPIError(400, f"optim_step: optimizer {params.get('type')!r} is not supported; send AdamParams")
        adam = _check(types.AdamParams, {k: v for k, v in params.items() if k != "type"}, "optim_step.adam_params")
        if not adam.learning_rate >= 0 or not 0 <= adam.beta1 < 1 or not 0 <= adam.beta2 < 1 or not adam.eps >= 0:
            raise TinkerAPIError(400, f"optim_step: adam_params out of range ({adam}); want learning_rate >= 0, "
                                      "0 <= beta1, beta2 < 1, eps >= 0")

        def work() -> Result:
            metrics = tenant.optim_step(learning_rate=adam.learning_rate, beta1=adam.beta1, beta2=adam.beta2,
                                        eps=adam.eps, weight_decay=adam.weight_decay,
                                        grad_clip_norm=adam.grad_clip_norm)
            return Result.json({"type": "optim_step", "metrics": metrics})
        return self._submit(tenant, body.get("seq_id"), work)

    def save_weights_for_sampler(self, body: dict) -> dict:
        tenant = self.tenant(body.get("model_id"))
        name = body.get("path")
        auto = name is None

        def work() -> Result:
            state = tenant.merged_weights()
            path = self.samplers.save(tenant.model_id, name, tenant.held, state, tenant.sampler_config())
            if not auto:
                return Result.json({"type": "save_weights_for_sampler", "path": path})
            sampler = self.samplers.open_session(tenant.session_id or "", None, path)
            return Result.json({"type": "save_weights_for_sampler", "path": path,
                                "sampling_session_id": sampler.sampling_session_id})
        return self._submit(tenant, body.get("seq_id"), work)

    def save_weights(self, body: dict) -> dict:
        from tinker import types
        request = _check(types.SaveWeightsRequest, body, "save_weights")
        tenant = self.tenant(request.model_id)
        name = request.path or f"step-{tenant.num_steps:06d}"
        if "/" in name or not name:
            raise TinkerAPIError(400, f"save_weights: path {name!r} must be a plain name such as 'step-100'")
        path = f"tinker://{tenant.model_id}/weights/{name}"

        def work() -> Result:
            if path in self.checkpoints and not request.overwrite:
                raise TinkerAPIError(400, f"save_weights: {path} exists; pass another name or overwrite=True")
            self.checkpoints[path] = tenant.checkpoint()
            return Result.json({"type": "save_weights", "path": path})
        return self._submit(tenant, request.seq_id, work)

    async def load_weights(self, body: dict) -> dict:
        """Load a saved state into a training client, or create one from it (create-by-load:
        session_id and model_seq_id instead of model_id). Cancelled: as create_model."""
        from tinker import types
        request = _check(types.LoadWeightsRequest, body, "load_weights")
        checkpoint = self.checkpoints.get(request.path)
        if checkpoint is None:
            raise TinkerAPIError(404, f"load_weights: {request.path!r} names no weights saved on this server; save "
                                      "them with save_state (save_weights) first")
        if request.model_id is not None:
            tenant = self.tenant(request.model_id)

            def work() -> Result:
                tenant.restore(checkpoint, request.optimizer, request.path)
                return Result.json({"type": "load_weights", "path": request.path, "model_id": tenant.model_id})
            return self._submit(tenant, request.seq_id, work)
        if request.session_id is None or request.model_seq_id is None:
            raise TinkerAPIError(400, "load_weights: send model_id, or session_id and model_seq_id to create a "
                                      "training client from the saved state")
        key = (request.session_id, "model", request.model_seq_id)
        if key not in self._created:
            held = self.bases.get(request.base_model or checkpoint.base_model)
            tenant = await self._new_tenant(request.session_id, request.model_seq_id, held, checkpoint.rank,
                                            checkpoint.seed, checkpoint.targets)
            answer = Result.json({"type": "load_weights", "path": request.path, "model_id": tenant.model_id})

            def restore() -> Result:
                tenant.restore(checkpoint, request.optimizer, request.path)
                return answer
            await trio.to_thread.run_sync(self._resident, tenant, restore, limiter=self.compute)
            request_id = self.futures.open(request.session_id)
            self.futures.resolve(request_id, answer)
            self._created[key] = request_id
        return {"request_id": self._created[key]}

    def _submit(self, tenant: TrainingTenant, seq_id: int | None, work: Callable[[], Result],
                job: TenantJob | None = None) -> dict:
        """Queue `work` in the tenant's seq_id order (a seq_id seen before: its first request id);
        429 past max_queued_requests_per_session. The work runs with the tenant resident; with
        `job` (a forward_backward's) it may run batched with other tenants' (module docstring)."""
        order = self.orders[tenant.model_id]
        if seq_id is not None and int(seq_id) in order.request_ids:      # a re-sent request: never refused
            return {"request_id": order.request_ids[int(seq_id)], "model_id": tenant.model_id}
        self._check_queue(tenant.session_id)
        tenant.last_used_s = time.monotonic()
        request_id = self.futures.open(tenant.session_id)
        op = (Op(request_id, lambda: self._resident(tenant, work)) if job is None
              else BatchableOp(request_id, lambda: self._resident(tenant, work), job))
        if seq_id is None:                     # no order asked for: after what is queued
            seq_id = max([order.next_seq_id - 1, *order.waiting]) + 1
        request_id, is_new = order.add(int(seq_id), op)
        if is_new:
            if order.gap_before(int(seq_id)):
                self.nursery.start_soon(self._watch_gap, order, int(seq_id))
            self.nursery.start_soon(self._drain, order)
        return {"request_id": request_id, "model_id": tenant.model_id}

    async def _drain(self, order: SeqOrder) -> None:
        """Run the order's ready ops one after another. Cancelled (the server stops): the op
        running finishes in its thread; the rest stay queued."""
        if order.running:
            return
        order.running = True
        try:
            while (op := order.pop_ready()) is not None:
                if isinstance(op, BatchableOp):
                    await self._execute_batchable(op)
                else:
                    await self._execute(op)
                if (tenant := self.tenants.get(order.model_id)) is not None:
                    tenant.last_used_s = time.monotonic()     # idle from the end of its last op
        finally:
            order.running = False

    @staticmethod
    def _resident(tenant: TrainingTenant, work: Callable[[], Result]) -> Result:
        """`work` with the tenant on its base: an evicted one is resumed first (in the worker
        thread, under the compute limiter, as every op)."""
        tenant.resume()
        return work()

    # ------------------------------------------------------------------ eviction
    async def evict(self, model_id: str) -> bool:
        """Write the tenant to state_dir and take its adapter off the base, when nothing of it is
        queued or running; whether it is evicted now. Its next op resumes it (`_resident`).
        Cancelled: the write finishes in its thread; the tenant is evicted or resident, never half."""
        tenant, order = self.tenants.get(model_id), self.orders.get(model_id)
        if tenant is None or order is None or not tenant.is_resident or order.waiting or order.running:
            return False
        path = self.state_dir / f"{model_id.replace(':', '_')}.pt"
        await trio.to_thread.run_sync(tenant.evict, path, limiter=self.compute)
        log.info("tinker: evicted idle training client %s to %s", model_id, path)
        return not tenant.is_resident

    async def evict_idle(self, now_s: float | None = None) -> list[str]:
        """Evict every resident tenant with no request for evict_after_s (the clock: `now_s`,
        time.monotonic() by default; a test passes a later one); the ids evicted."""
        if self.options.evict_after_s is None:
            return []
        now_s = time.monotonic() if now_s is None else now_s
        idle = [model_id for model_id, tenant in self.tenants.items()
                if tenant.is_resident and now_s - tenant.last_used_s >= self.options.evict_after_s]
        return [model_id for model_id in idle if await self.evict(model_id)]

    async def finish_silent_sessions(self, now_s: float | None = None) -> list[str]:
        """Finish every session with no heartbeat for session_timeout_s (the clock: `now_s`,
        time.monotonic() by default; a test passes a later one), freeing its tenants; their ids."""
        if self.options.session_timeout_s is None:
            return []
        now_s = time.monotonic() if now_s is None else now_s
        silent = self.sessions.silent_since(now_s - self.options.session_timeout_s)
        for session_id in silent:
            log.info("tinker: session %s sent no heartbeat for %g s: finished", session_id,
                     self.options.session_timeout_s)
            await self.finish_session(session_id, {"reason": {"type": "timeout"}})
        return silent

    @property
    def _sweep_period_s(self) -> float:
        periods = [t for t in (self.options.evict_after_s, self.options.session_timeout_s) if t is not None]
        assert periods, "no sweep without evict_after_s or session_timeout_s"
        return min(max(min(periods) / 4, 1.0), 60.0)

    async def _sweep(self) -> None:
        """Evict idle tenants and finish silent sessions every _sweep_period_s until the server stops."""
        while True:
            await trio.sleep(self._sweep_period_s)
            await self.finish_silent_sessions()
            await self.evict_idle()
            self.stability.expire()

    async def _watch_gap(self, order: SeqOrder, seq_id: int) -> None:
        await trio.sleep(self.options.seq_gap_timeout_s)
        if not order.gap_before(seq_id):
            return
        ops, missing = order.skip_gap()
        error = TinkerAPIError(408, f"seq_id {missing} of model {order.model_id!r} never arrived within "
                                    f"{self.options.seq_gap_timeout_s:g} s (seq_gap_timeout_s), so the "
                                    f"{len(ops)} request(s) after it are dropped; send every request of a "
                                    "TrainingClient through that client")
        for op in ops:
            self.futures.resolve(op.request_id, Result.failed(error))

    async def _execute(self, op: Op) -> None:
        """Run an op's work in a worker thread under the compute limiter and resolve its future."""
        result = await trio.to_thread.run_sync(outcome, op, limiter=self.compute)
        self.futures.resolve(op.request_id, result)

    async def _execute_batchable(self, op: BatchableOp) -> None:
        """Put `op` on its base's pending list and wait until a batch has run it (module
        docstring); the base's batch task is started when none runs."""
        base = op.job.tenant.held.name
        pending = self._pending_batch.get(base)
        if pending is None:
            pending = self._pending_batch[base] = []
            self.nursery.start_soon(self._run_batches, base, pending)
        pending.append(op)
        await op.done.wait()

    async def _run_batches(self, base: str, pending: list[BatchableOp]) -> None:
        """While ops of `base` are pending: take the compute limiter, then as many of them as fit
        (`batching.take_batch`), run them in a worker thread and resolve each one's future."""
        try:
            while pending:
                async with self.compute:
                    batch = take_batch(pending, self.options.batch_tenants_max_tokens)
                    try:
                        results, num_batched = await trio.to_thread.run_sync(compute_batch, batch)
                    except Exception as exc:     # a fault of the batching itself: these ops fail, the server goes on
                        results, num_batched = [failure(op, exc) for op in batch], 0
                    if num_batched:
                        self.num_batched_forwards += 1
                        self.num_batched_ops += num_batched
                for op, result in zip(batch, results):
                    self.futures.resolve(op.request_id, result)
                    op.done.set()
        finally:         # done, or cancelled (the server stops: the drains waiting are cancelled too)
            if self._pending_batch.get(base) is pending:
                del self._pending_batch[base]

    # ------------------------------------------------------------------ sampling
    def create_sampling_session(self, body: dict) -> dict:
        from tinker import types
        request = _check(types.CreateSamplingSessionRequest, body, "create_sampling_session")
        self.sessions.get(request.session_id)
        key = (request.session_id, "sampler", request.sampling_session_seq_id)
        if key not in self._created:
            held = None if request.model_path else self.bases.get(request.base_model)
            sampler = self.samplers.open_session(request.session_id, held, request.model_path)
            self._created[key] = sampler.sampling_session_id
        return {"type": "create_sampling_session", "sampling_session_id": self._created[key]}

    def sampler_info(self, sampling_session_id: str) -> dict:
        sampler = self.samplers.get(sampling_session_id)
        return {"sampler_id": sampler.sampling_session_id, "base_model": sampler.base_model,
                "model_path": sampler.model_path}

    def join_sampling_session(self, body: dict) -> dict:
        sampler = self.samplers.get(body.get("sampling_session_id"))
        counter, sampler.num_clients = sampler.num_clients, sampler.num_clients + 1
        return {"type": "join_sampling_session", "client_counter": counter}

    def asample(self, body: dict) -> dict:
        from tinker import types
        request = _check(types.SampleRequest, body, "asample")
        for name in UNSUPPORTED_SAMPLE_FIELDS:
            if getattr(request, name) not in (None, 0, False):
                raise TinkerAPIError(400, f"asample: {name} is not supported by this server yet; leave it unset")
        key: tuple[str, int] | None = None
        if request.sampling_session_id is not None:
            sampler = self.samplers.get(request.sampling_session_id)
            if request.seq_id is not None:
                key = (sampler.sampling_session_id, request.seq_id)
                if key in self._samples:          # a retry of a request already accepted
                    return self._samples[key]
        else:
            held = None if request.model_path else self.bases.get(request.base_model)
            sampler = self.samplers.open_session("", held, request.model_path, register=False)
        held = sampler.weights.held
        try:
            prompt = request.prompt.to_ints()
        except ValueError as exc:
            raise TinkerAPIError(400, f"asample: {exc}; this server samples from text tokens only") from None
        if not prompt:
            raise TinkerAPIError(400, "asample: the prompt is empty; send at least one token")
        _check_ids(np.asarray(prompt), held, "asample prompt")
        if not 1 <= request.num_samples <= 128:
            raise TinkerAPIError(400, f"asample: num_samples must be 1 to 128, got {request.num_samples}")
        params = engine_params(request.sampling_params.model_dump(), request.num_samples, len(prompt), held)
        wants_prompt_logprobs = bool(request.prompt_logprobs)
        if request.record_stability_info:
            self._check_recordable(sampler.session_id, params, request.num_samples, len(prompt))
        self._check_queue(sampler.session_id)
        request_id = self.futures.open(sampler.session_id or None)
        answer = {"request_id": request_id,
                  "sample_sequence_ids": [sequence_id(request_id, i) for i in range(request.num_samples)]}
        if key is not None:
            self._samples[key] = answer
            while len(self._samples) > self.futures.max_kept:     # as long as the futures are kept
                del self._samples[next(iter(self._samples))]
        weights = sampler.weights
        weights.pending.append(PendingSample(request_id, prompt, params, wants_prompt_logprobs,
                                             sampler.session_id if request.record_stability_info else None))
        if not weights.draining:
            weights.draining = True
            self.nursery.start_soon(self._drain_samples, weights)
        return answer

    async def _drain_samples(self, weights: SamplerWeights) -> None:
        """Step the weights' engine, admitting every pending request before each step, until none
        waits and none is in flight (sampling.py); answer each request the step it finishes. An
        engine step that fails fails the requests in flight (an internal error each) and the
        engine is rebuilt for the next ones."""
        kv_cache_mb = self.samplers.kv_cache_mb
        try:
            while weights.pending or weights.in_flight:
                admit, weights.pending = weights.pending, []
                try:
                    answered = await trio.to_thread.run_sync(step_engine, weights, admit, kv_cache_mb,
                                                             limiter=self.compute)
                except Exception as exc:
                    log.exception("tinker: a sampling step failed")
                    error = TinkerAPIError(500, f"internal error: {type(exc).__name__}: {exc}", category="server")
                    for item in [*weights.in_flight.values(), *admit]:
                        self.futures.resolve(item.request_id, Result.failed(error))
                    weights.in_flight.clear()
                    weights.engine = None
                    continue
                for done in answered:
                    self._record(done)
                    self.futures.resolve(done.item.request_id,
                                         Result.proto(done.answer) if isinstance(done.answer, bytes)
                                         else Result.failed(TinkerAPIError(400, f"asample: {done.answer}")))
        finally:
            weights.draining = False

    def _check_recordable(self, session_id: str, params: SamplingParams, num_samples: int,
                          prompt_tokens: int) -> None:
        """TinkerAPIError 400 for a sample request whose sequences stable_reinforce could not use."""
        if not session_id:
            raise TinkerAPIError(400, "asample: record_stability_info needs a sampling session (the records "
                                      "belong to its session); sample through a SamplingClient")
        if params.temperature not in (0.0, 1.0):
            raise TinkerAPIError(400, f"asample: record_stability_info with temperature {params.temperature}: "
                                      "stable_reinforce compares the learner's logprobs (temperature 1) with the "
                                      "sampler's, so the recorded ones must be at temperature 1 too; sample at 1")
        self.stability.check_fits(num_samples, prompt_tokens, params.max_new_tokens)

    def _record(self, done: Answered) -> None:
        """Keep a finished request's sequences for stable_reinforce when it asked (stability.py),
        under the sequence ids its POST was answered with."""
        session_id = done.item.record_in
        if session_id is None or not done.sequences or not self.sessions.is_open(session_id):
            return
        prompt = np.asarray(done.item.prompt, dtype=np.int32)
        for i, seq in enumerate(done.sequences):
            self.stability.record(session_id, sequence_id(done.item.request_id, i), prompt, seq.tokens, seq.logprobs)

    # ------------------------------------------------------------------ futures
    async def retrieve_future(self, body: dict) -> tuple[str, bytes]:
        return await self.futures.retrieve(str(body.get("request_id")), bool(body.get("allow_metadata_only")))

    def cancel_future(self, body: dict) -> None:
        self.futures.cancel(str(body.get("request_id")))


def _check_ids(ids: np.ndarray, held: HeldModel, where: str) -> None:
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= held.vocab_size):
        bad = int(ids.max()) if int(ids.max()) >= held.vocab_size else int(ids.min())
        raise TinkerAPIError(400, f"{where}: token id {bad} is outside {held.name!r}'s vocabulary "
                                  f"(0 to {held.vocab_size - 1}); tokenize with the model's own tokenizer")


__all__ = ["TinkerOptions", "TinkerService"]
