"""A training client's state: a LoRA adapter on a shared frozen base, its AdamW, its gradients.

    tenant = TrainingTenant("m-1", held, rank=8, seed=0, train_mlp=True, train_attn=True)
    outputs, metrics = tenant.forward_backward(datums, "cross_entropy", {}, forward_only=False)
    [(outputs, metrics), ...] = forward_backward_together([TenantJob(tenant, datums, "cross_entropy", {}, False),
                                                          TenantJob(other, ...)])   # one forward of the base
    metrics = tenant.optim_step(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12,
                                weight_decay=0.0, grad_clip_norm=0.0)
    state = tenant.merged_weights()         # base + scale * B @ A: what a sampler runs
    tenant.evict(Path("state/m-1.pt"))      # to disk; its hooks leave the base (is_resident False)
    tenant.resume()                         # back on the base, exactly as it was
    tenant.close()                          # its hooks leave the base for good

Design note. The adapter is postrain's own LoRA (actors/learner/lora.py): the same init (A
kaiming-uniform from the seed, B zero), the same hook and the same merge, with alpha
LORA_ALPHA (scale = alpha / rank). Many tenants share one base: each adds its hooks, and only
the tenants computing have their adapters `enabled`: one alone (`_active`), or several in one
forward, each on its own rows of the batch (`forward_backward_together`, lora.batched_adapters:
the service batches the `forward_backward` calls of a base's tenants that are ready together).
The caller runs every compute one at a time (the service's compute limiter). Gradients
accumulate in the adapters' `.grad` over any number of `forward_backward` calls and are cleared
by `optim_step`, the only writer of the weights. With "lm_head" among its targets
(`train_unembed`) a tenant also adapts the unembedding (unembed.py): its logprob head reads
`head_weight()`, and a batch of several tenants scores each tenant's rows with its own head. Invariant: outside a compute, `self.lora.enabled`
is False and `self.lora.rows` None (tests/actors/tinker/test_batching.py: three tenants at once,
batched or in turn, each end as they would alone).

Eviction. An idle tenant can leave its base without ending: `evict(path)` writes one file
(`torch.save`, format EVICTED_FORMAT: the adapter, the pending gradients, the AdamW state dict,
num_steps and num_accumulated, and what the adapter was made with) and detaches its hooks;
`resume()` attaches a new adapter, loads all of it back and deletes the file. Every tensor
goes through the file unchanged, so a resumed tenant's next steps equal those of one never
evicted, bit for bit (tests/actors/tinker/test_limits.py). Invariant: exactly one of
`is_resident` and `evicted_to is not None` holds until `close()`, after which neither does.
"""
from __future__ import annotations

import contextlib
import copy
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from postrain.ext import rl_ops

from ..learner.lora import LearnerLora, batched_adapters
from ..models.config import ModelConfig
from ..models.llama import LlamaModel
from .base_models import HeldModel
from .errors import TinkerAPIError
from .losses import token_loss
from .stability import SAMPLED
from .unembed import HEAD, HeadAdapter, untied_config
from .wire import WireDatum

LORA_ALPHA = 32.0
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
EVICTED_FORMAT = "postrain-tinker-evicted-tenant/1"


def training_state_bytes(model: torch.nn.Module, rank: int, targets: tuple[str, ...]) -> int:
    """The bytes of a tenant's training state on `model`: its LoRA A and B, their gradients and
    AdamW's two moments, float32 (4 x 4 bytes per adapter weight)."""
    def adapted(name: str) -> bool:
        return HEAD in targets if name == HEAD else name.rsplit(".", 1)[-1] in targets
    per_rank = sum(m.in_features + m.out_features for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and adapted(name))
    return 16 * rank * per_rank


def lora_targets(train_attn: bool, train_mlp: bool, train_unembed: bool) -> tuple[str, ...]:
    """The layers a Tinker lora_config trains: the attention and MLP projections by name, and
    "lm_head" for the unembedding (unembed.py); TinkerAPIError 400 when it trains nothing."""
    targets = (ATTENTION if train_attn else ()) + (MLP if train_mlp else ()) + ((HEAD,) if train_unembed else ())
    if not targets:
        raise TinkerAPIError(400, "lora_config trains nothing (train_attn, train_mlp and train_unembed are all "
                                  "False); set one")
    return targets


@dataclass(frozen=True)
class TenantCheckpoint:
    """What `save_weights` keeps of a tenant: its adapter (copies), how it was made, its AdamW state."""

    base_model: str
    rank: int
    seed: int
    targets: tuple[str, ...]
    adapters: dict[str, torch.Tensor]
    optimizer_state: dict
    num_steps: int


def _trained_rows(datum: WireDatum, loss_fn: str, forward_only: bool) -> np.ndarray:
    """(L,) the positions whose loss term has a gradient: cross_entropy's non-zero weights,
    stable_reinforce's sampled tokens, every position of the other losses, none for a forward pass."""
    num = len(datum.tokens)
    if forward_only:
        return np.zeros(num, dtype=bool)
    if loss_fn == "cross_entropy" and "weights" in datum.inputs:
        return np.asarray(datum.inputs["weights"]) != 0
    if loss_fn == "stable_reinforce":
        return np.asarray(datum.inputs[SAMPLED]) != 0
    return np.ones(num, dtype=bool)


class TrainingTenant:
    """One training client (module docstring)."""

    def __init__(self, model_id: str, held: HeldModel, *, rank: int, seed: int, targets: tuple[str, ...],
                 session_id: str | None = None):
        if rank < 1:
            raise TinkerAPIError(400, f"lora_config.rank must be >= 1, got {rank}")
        self.model_id, self.held, self.rank, self.seed, self.session_id = model_id, held, rank, seed, session_id
        self.targets = tuple(targets)
        self.state_bytes = training_state_bytes(held.model, rank, self.targets)   # while resident
        self._lora: LearnerLora | None = None              # None while evicted or closed
        self._head: HeadAdapter | None = None              # the unembedding's adapter ("lm_head" in targets)
        self._optimizer: torch.optim.AdamW | None = None   # set together with _lora
        self.evicted_to: Path | None = None                # the file while evicted, else None
        self._attach()
        self.num_steps = 0
        self.num_accumulated = 0        # forward_backward calls since the last optim_step
        self.last_used_s = time.monotonic()   # when a request of it last came or ended (the service's eviction)

    def _attach(self) -> None:
        """A new adapter on the base (A from the seed, B zero) and a fresh AdamW over it."""
        body = [t for t in self.targets if t != HEAD]
        lora = LearnerLora(self.held.model, {"rank": self.rank, "alpha": LORA_ALPHA, "targets": body} if body else None,
                           self.seed)
        lora.enabled = False
        self._lora = lora
        self._head = (HeadAdapter(self.held.model.lm_head.weight, self.rank, LORA_ALPHA, self.seed)
                      if HEAD in self.targets else None)
        self._optimizer = self._new_optimizer()

    def _new_optimizer(self) -> torch.optim.AdamW:
        params = self.parameters()
        fused = all(p.device.type in ("cpu", "cuda") for p in params)    # as the learner's PolicyOptimizer
        return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0, fused=fused)

    def parameters(self) -> list[torch.nn.Parameter]:
        """The adapter's parameters: the body's LoRA, then the unembedding's when trained."""
        return self.lora.parameters() + (self._head.parameters() if self._head is not None else [])

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The adapter's parameters by their `adapters()` keys."""
        lora = self.lora
        body = {f"{name}.weight.lora_{ab}": p for name in lora.modules
                for ab, p in (("A", lora.lora_A[name]), ("B", lora.lora_B[name]))}
        return {**body, **(self._head.named_parameters() if self._head is not None else {})}

    def head_weight(self) -> torch.Tensor:
        """The weight this tenant's logprob head reads: the base's, or with the unembedding's
        adapter added (differentiable in it)."""
        base = self.held.model.lm_head.weight
        return base if self._head is None else self._head.weight(base)

    def sampler_config(self) -> ModelConfig:
        """The model config a sampler of this tenant's merged weights is built with."""
        config = self.held.model.config
        return config if self._head is None else untied_config(config)

    @property
    def is_resident(self) -> bool:
        """Whether the adapter is on the base (not evicted, not closed)."""
        return self._lora is not None

    @property
    def lora(self) -> LearnerLora:
        assert self._lora is not None, f"tenant {self.model_id} is not resident; the service resumes it first"
        return self._lora

    @property
    def optimizer(self) -> torch.optim.AdamW:
        assert self._optimizer is not None, f"tenant {self.model_id} is not resident; the service resumes it first"
        return self._optimizer

    @contextlib.contextmanager
    def _active(self):
        self.lora.enabled = True
        try:
            yield
        finally:
            self.lora.enabled = False

    def logprobs(self, datums: list[WireDatum], trained: list[np.ndarray]) -> list[torch.Tensor]:
        """Each datum's logprob of its target tokens (L,) with this tenant's adapter (`_logprobs`)."""
        with self._active():
            return _logprobs(self.held.model, self.held.model.lm_head.weight.device, datums, trained,
                             _row_order(datums), [self.head_weight()] * len(datums))

    def forward_backward(self, datums: list[WireDatum], loss_fn: str, config: dict[str, float],
                         forward_only: bool) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Per-datum outputs ("logprobs", "elementwise_loss") and metrics ("loss:sum"); the loss's
        gradient is added to the adapters' unless `forward_only`."""
        return forward_backward_together([TenantJob(self, datums, loss_fn, config, forward_only)])[0]

    def optim_step(self, *, learning_rate: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                   grad_clip_norm: float) -> dict[str, float]:
        """One AdamW step with these settings on the accumulated gradients, then zero them."""
        params = self.parameters()
        if grad_clip_norm > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip_norm))
        else:
            grad_norm = rl_ops.global_grad_norm(params)
        for group in self.optimizer.param_groups:
            group.update(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.num_steps += 1
        self.num_accumulated = 0
        return {"grad_norm:mean": grad_norm, "learning_rate:mean": learning_rate}

    def adapters(self) -> dict[str, torch.Tensor]:
        return {k: p.detach().to("cpu") for k, p in self.named_parameters().items()}

    def checkpoint(self) -> TenantCheckpoint:
        """Copies of the adapter and the AdamW state (a later step changes neither)."""
        return TenantCheckpoint(self.held.name, self.rank, self.seed, self.targets,
                                {k: v.clone() for k, v in self.adapters().items()},
                                copy.deepcopy(self.optimizer.state_dict()), self.num_steps)

    def restore(self, checkpoint: TenantCheckpoint, with_optimizer: bool, source: str) -> None:
        """The checkpoint's adapter (and AdamW state, else a fresh one) in place of this tenant's;
        TinkerAPIError 400 when its base, rank or targets differ. Pending gradients are dropped."""
        mine = (self.held.name, self.rank, self.targets)
        theirs = (checkpoint.base_model, checkpoint.rank, checkpoint.targets)
        if mine != theirs:
            raise TinkerAPIError(400, f"{source} holds a rank-{checkpoint.rank} adapter of {checkpoint.base_model!r} "
                                      f"on {list(checkpoint.targets)}, this training client is rank {self.rank} on "
                                      f"{self.held.name!r} on {list(self.targets)}; load it with "
                                      "create_training_client_from_state instead")
        self._load_adapters(checkpoint.adapters, source)
        self.optimizer.zero_grad(set_to_none=True)
        fresh = self._new_optimizer()
        if with_optimizer:
            fresh.load_state_dict(copy.deepcopy(checkpoint.optimizer_state))
        self._optimizer = fresh
        self.num_steps = checkpoint.num_steps if with_optimizer else 0
        self.num_accumulated = 0

    def _load_adapters(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        self.lora.load_adapters(tensors, source)
        if self._head is not None:
            self._head.load_adapters(tensors, source)

    def merged_weights(self) -> dict[str, torch.Tensor]:
        """The base's weights with this adapter merged in (new tensors, CPU); with the
        unembedding's adapter, a head of its own (build the sampler with `sampler_config`)."""
        base = {k: v.detach().to("cpu") for k, v in self.held.model.state_dict().items()}
        merged = self.lora.merged(base)
        if self._head is not None:
            merged = {**merged, f"{HEAD}.weight": self._head.merged(self.held.model.lm_head.weight).to("cpu")}
        return merged

    def evict(self, path: Path) -> None:
        """Write everything needed to resume exactly to `path` (module docstring), then detach the
        hooks and drop the adapter's tensors. A tenant not resident is left as it is."""
        if self._lora is None:
            return
        params = self.named_parameters()
        state = {"format": EVICTED_FORMAT, "model_id": self.model_id, "base_model": self.held.name,
                 "rank": self.rank, "seed": self.seed, "targets": list(self.targets),
                 "adapters": {k: v.detach().to("cpu").clone() for k, v in params.items()},
                 "grads": {k: p.grad.detach().to("cpu").clone() for k, p in params.items() if p.grad is not None},
                 "optimizer": self.optimizer.state_dict(), "num_steps": self.num_steps,
                 "num_accumulated": self.num_accumulated}
        partial = path.with_name(path.name + ".partial")
        torch.save(state, partial)
        os.replace(partial, path)       # the file is whole or absent
        self._lora.detach()
        self._lora = self._head = self._optimizer = None
        self.evicted_to = path

    def resume(self) -> None:
        """Back on the base from the file `evict` wrote, exactly as it was; the file is deleted.
        TinkerAPIError 404 for a closed tenant (its session finished while a request waited)."""
        if self._lora is not None:
            return
        if self.evicted_to is None:
            raise TinkerAPIError(404, f"model {self.model_id!r} was freed (its session finished); create a new "
                                      "training client")
        path = self.evicted_to
        state = torch.load(path, map_location="cpu", weights_only=True)
        assert state["format"] == EVICTED_FORMAT and state["model_id"] == self.model_id, \
            f"{path} holds {state.get('format')!r} of {state.get('model_id')!r}, not tenant {self.model_id}"
        self._attach()
        self._load_adapters(state["adapters"], str(path))
        params = self.named_parameters()
        for key, grad in state["grads"].items():
            params[key].grad = grad.to(params[key].device)
        self.optimizer.load_state_dict(state["optimizer"])
        self.num_steps, self.num_accumulated = state["num_steps"], state["num_accumulated"]
        self.evicted_to = None
        path.unlink()

    def close(self) -> None:
        """The tenant ends: its hooks leave the base, or its evicted file is deleted."""
        if self._lora is not None:
            self._lora.detach()
        self._lora = self._head = self._optimizer = None
        if self.evicted_to is not None:
            self.evicted_to.unlink(missing_ok=True)
            self.evicted_to = None


@dataclass(frozen=True)
class TenantJob:
    """One tenant's `forward_backward` (or `forward`: forward_only) call."""

    tenant: TrainingTenant
    datums: list[WireDatum]
    loss_fn: str
    config: dict[str, float]
    forward_only: bool


class BackwardFailed(RuntimeError):
    """The backward of `forward_backward_together` failed: the training jobs' gradients may hold
    part of it (the cause is chained)."""


def forward_backward_together(jobs: list[TenantJob]) -> list[tuple[list[dict[str, np.ndarray]], dict[str, float]]]:
    """Each job's (per-datum outputs, metrics), as `TrainingTenant.forward_backward` alone would
    give them, from one forward of the jobs' shared base over all their datums together, each
    tenant's adapter on its own rows (lora.batched_adapters), and one backward of the sum of the
    training jobs' losses: the adapters are disjoint and no row sees another's, so each adapter's
    gradient is that of its own loss alone (equal to it alone up to float rounding: the batch is
    padded to the longest datum of all). One job runs with its adapter on every row: the pass of
    one tenant alone, unchanged. The tenants are distinct and resident, on one base. BackwardFailed
    when the backward of two or more fails (before it nothing is written); one job's failure is
    its own exception."""
    assert jobs, "at least one job"
    held = jobs[0].tenant.held
    assert all(job.tenant.held is held for job in jobs), "the jobs share one base"
    assert len({job.tenant.model_id for job in jobs}) == len(jobs), "one job per tenant"
    datums = [d for job in jobs for d in job.datums]
    owners = [k for k, job in enumerate(jobs) for _ in job.datums]
    trained = [_trained_rows(d, job.loss_fn, job.forward_only) for job in jobs for d in job.datums]
    device = held.model.lm_head.weight.device

    order = _row_order(datums)
    if len(jobs) == 1:
        adapters = jobs[0].tenant._active()
    else:
        rows = [[row for row, i in enumerate(order) if owners[i] == k] for k in range(len(jobs))]
        adapters = batched_adapters([(job.tenant.lora, r) for job, r in zip(jobs, rows)])
    results: list[tuple[list[dict[str, np.ndarray]], dict[str, float]]] = []
    with torch.set_grad_enabled(not all(job.forward_only for job in jobs)), adapters:
        heads = [job.tenant.head_weight() for job in jobs]
        per_datum = _logprobs(held.model, device, datums, trained, order, [heads[k] for k in owners])
        totals, first = [], 0
        for job in jobs:
            total = torch.zeros((), dtype=torch.float32)
            outputs = []
            for d, logp in zip(job.datums, per_datum[first:first + len(job.datums)]):
                inputs = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in d.inputs.items()
                          if k != "target_tokens"}
                loss, term = token_loss(job.loss_fn, logp, inputs, job.config)
                total = total + loss
                outputs.append({"logprobs": logp.detach().float().numpy(),
                                "elementwise_loss": term.detach().float().numpy()})
            first += len(job.datums)
            if not job.forward_only and total.requires_grad:
                totals.append(total)
            results.append((outputs, {"loss:sum": float(total.detach())}))
        if totals:
            if len(jobs) == 1:
                totals[0].backward()
            else:
                try:
                    torch.stack(totals).sum().backward()
                except Exception as exc:
                    raise BackwardFailed(f"the backward of {len(jobs)} tenants together failed: "
                                         f"{type(exc).__name__}: {exc}") from exc
    for job in jobs:
        if not job.forward_only:
            job.tenant.num_accumulated += 1
    return results


def _row_order(datums: list[WireDatum]) -> list[int]:
    """The datum index of each batch row: sorted by length, stable (the learner's plain plan)."""
    return sorted(range(len(datums)), key=lambda i: len(datums[i].tokens))


def _logprobs(model: LlamaModel, device: torch.device, datums: list[WireDatum], trained: list[np.ndarray],
              order: list[int], heads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each datum's logprob of its target tokens (L,), with the adapters the caller enabled; the
    rows where `trained[i]` is True carry the adapters' gradient path, the others are computed
    without one. `order`: the datum index of each batch row (`_row_order`); `heads[i]`: the LM
    head weight datum i's tenant reads (TrainingTenant.head_weight: one tensor per tenant).

    The pass is the learner's SFT pass (actors/learner/policy_forward.py), row for row, so that
    its gradients are the learner's bit for bit: each datum is its tokens and one more (its
    last target, which only the last position sees), the datums run sorted by length (stable,
    the learner's plain plan), padded on the right, and the LM head sees the trained rows
    alone, in row-major order."""
    width = max(len(d.tokens) for d in datums) + 1
    ids = torch.zeros(len(datums), width, dtype=torch.long)                        # (B, T)
    attention = torch.zeros(ids.shape, dtype=torch.long)
    targets = torch.zeros(len(datums), width - 1, dtype=torch.long)                 # (B, T - 1)
    rows = torch.zeros(targets.shape, dtype=torch.bool)
    train = torch.zeros(targets.shape, dtype=torch.bool)
    for row, i in enumerate(order):
        d, n = datums[i], len(datums[i].tokens)
        ids[row, :n + 1] = torch.from_numpy(np.append(d.tokens, d.inputs["target_tokens"][-1]))
        attention[row, :n + 1] = 1
        targets[row, :n] = torch.from_numpy(np.array(d.inputs["target_tokens"], dtype=np.int64))
        rows[row, :n] = True
        train[row, :n] = torch.from_numpy(trained[i])
    ids, attention, targets = ids.to(device), attention.to(device), targets.to(device)
    rows, train = rows.to(device), train.to(device)
    rest = rows & ~train
    hidden = model.hidden_states(ids, None if bool(attention.all()) else attention)[:, :-1]   # (B, T-1, H)
    out = torch.zeros(targets.shape, dtype=torch.float32, device=device)
    row_heads = [heads[i] for i in order]
    for weight in {id(h): h for h in row_heads}.values():          # one pass over all rows when one head
        mine = torch.tensor([h is weight for h in row_heads], device=device)[:, None]              # (B, 1)
        head_train, head_rest = train & mine, rest & mine
        if bool(head_train.any()):
            out = out.masked_scatter(head_train, rl_ops.token_logprobs_from_hidden(hidden[head_train], weight,
                                                                                   targets[head_train]))
        if bool(head_rest.any()):
            with torch.no_grad():
                untrained = rl_ops.token_logprobs_from_hidden(hidden[head_rest].detach(), weight.detach(),
                                                              targets[head_rest])
            out = out.masked_scatter(head_rest, untrained)
    per_datum: list[torch.Tensor] = [torch.empty(0)] * len(datums)
    for row, i in enumerate(order):
        per_datum[i] = out[row, :len(datums[i].tokens)]
    return per_datum

