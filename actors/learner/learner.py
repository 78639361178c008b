"""The learner: GRPO-family policy updates (and SFT) on rollout batches, without any actor.

    learner = Learner(LearnerConfig(model="tiny", lr=1e-5, micro_batch_size=4))
    metrics = learner.train_step(batch)       # a TrainBatch (postrain.actors.records; batch.py)
    metrics = learner.sft_step(batch)         # an SftBatch: cross-entropy on loss_mask tokens (warm start)
    learner.save_checkpoint("runs/x/ckpt/step10", extra={"ledger": ...}); learner.load_checkpoint(...)
    learner.export_hf("runs/x/hf")            # a Hugging Face folder transformers loads

Design note. One optimizer step per call. The batch is cut into micro-batches of
`micro_batch_size` samples; every micro-batch's loss is divided by the WHOLE batch's token
(or sequence) count (`global_num_tokens` / `global_num_seqs` of `rl_ops.policy_loss`), so
the summed micro-batch gradients equal the full-batch gradient exactly. Data parallel is
the same rule one level up: under torch.distributed each rank packs its own shard, the
counts and then the gradients are all-reduced with SUM, and every rank takes the same
AdamW step (tests/actors/learner/test_learner_dp.py pins 2 ranks == 1 process). Strategy
"fsdp" shards the model, gradients and AdamW state instead and reduce-scatters the gradients
with the same SUM (fsdp.py; tests/actors/test_learner_fsdp.py). The step's loop is step.py. Logprobs come
from `rl_ops.token_logprobs_from_hidden` on the hidden states of the response tokens only,
so neither the prompt's nor any (tokens x vocab) logits are materialised. The same pass
yields the train-inference gap: the recomputed logprobs against the generator's
`behavior_logprobs` for tokens sampled with the current weights (same policy version).

Objectives: "ppo" takes the ratio against the behaviour logprobs (on-policy or nearly);
"decoupled" takes the ratio against the proximal logprobs, those of the current weights,
and weighs each token by min(exp(prox - behaviour), cap) (stale samples from an
asynchronous run). Invariant: a train step is exactly one optimizer step, so the proximal
weights are the ones the gradient pass runs with, and its own logprobs (detached) are the
proximal ones: no separate recompute pass. Policy versions: the learner's
`policy_version` counts optimizer steps; weights published after step k are version k.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from postrain.ext import rl_ops
from postrain.ext.cupy_ops import BACKENDS as RL_OPS_BACKENDS

from ..device import resolve_device
from ..models import model_class
from ..models.llama import LlamaModel, ModelConfig
from ..models.loading import load_model
from ..records import SftBatch, TrainBatch
from .batch import LearnerError, group_sizes_of, pack_batch, reward_components_of
from .packed import PackedBatch
from .loss_preset import apply_loss_preset, preset_loss_config
from .routing import LearnerRouting
from .lora import LearnerLora, lora_config
from . import fsdp
from .fsdp import STRATEGIES
from .shared_prefix import plan_micro_batches
from .context_parallel_step import join_rings, ring_logprobs
from .step import sft_step, train_step

OBJECTIVES = ("ppo", "decoupled")
LR_SCHEDULES = ("constant", "cosine")
LOGPROB_PATHS = ("chunked", "naive")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LearnerConfig:
    """Every knob of the learner; units in names, defaults for RL fine-tuning of a small LM."""

    __pydantic_config__ = {"extra": "forbid"}   # the learner's options check it (a misspelt field is named)
    model: str | dict = "tiny"             # load_model spec (built-in, HF folder, .gguf) or ModelConfig dict
    seed: int = 0                          # init of a from-scratch model, torch RNG
    device: str = "auto"                   # "auto" (the GPU placed, else cpu) | "cpu" | "cuda" | "cuda:N"
    dtype: str = "float32"                 # parameter dtype: float32 | bfloat16 | float16
    autocast_dtype: str | None = None      # "bfloat16" | "float16": the model's forward under torch.autocast
                                           # (parameters, optimizer and the logprob head stay at `dtype`)
    rl_ops_backend: str = "auto"           # logprobs and loss: "auto" (CuPy kernels for CUDA tensors where
                                           # cupy imports) | "torch" | "cupy" (postrain.ext.rl_ops)
    reference_model: str | dict | None = None   # frozen KL reference: None, "initial" (a copy of the
                                           # weights at start), "warm_start" (the policy at the first RL
                                           # step: after the SFT warm start) or a model spec
    # optimizer and schedule
    lr: float = 1e-6                       # peak learning rate
    rl_lr: float | None = None             # constant lr of RL steps after a warm start (None: the schedule)
    weight_decay: float = 0.0              # AdamW decoupled weight decay
    betas: tuple[float, float] = (0.9, 0.999)   # AdamW's (beta1, beta2): decay of the gradient's running mean and of its square
    adam_eps: float = 1e-8                 # AdamW's epsilon, added to the denominator's square root
    max_grad_norm: float | None = 1.0      # clip the global grad norm; None = no clipping
    warmup_steps: int = 0                  # linear warm-up from lr/warmup_steps to lr
    lr_schedule: str = "constant"          # after warm-up: "constant" | "cosine" (to min_lr_ratio * lr)
    total_steps: int = 0                   # cosine horizon in steps (needed for "cosine")
    min_lr_ratio: float = 0.0              # cosine's floor as a fraction of lr (0.1: it ends at lr / 10)
    micro_batch_size: int = 8              # samples per forward/backward (gradient accumulation)
    # policy loss (postrain.ext.rl_ops)
    objective: str = "ppo"                 # "ppo" | "decoupled" (proximal recompute for stale samples)
    loss: str = "ppo"                      # a named loss preset: ppo | dapo | gspo | cispo | tis | mis | geo-mis | icepop | kl (loss_preset.py)
    loss_options: dict[str, float | str | None] | None = None   # PolicyLossConfig fields over the preset's (e.g. {is_high = 3.0})
    clip_low: float = 0.2                  # PPO clip below: the ratio is clipped at 1 - clip_low
    clip_high: float = 0.28                # PPO clip above: 1 + clip_high (DAPO's clip-higher when > clip_low)
    dual_clip: float | None = 3.0          # a token with advantage A < 0 loses at most -dual_clip * A (c > 1); None = off
    behavior_weight_cap: float | None = 2.0   # decoupled only: cap on exp(prox - behaviour)
    agg_mode: str = "token-mean"           # loss aggregation: token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    loss_norm_constant: float | None = None   # C of seq-mean-token-sum-norm (loss / (B * C), Dr. GRPO); None: the padded length
    kl_coef: float = 0.0                   # KL-to-reference loss weight (needs reference_model)
    kl_kind: str = "k3"                    # KL estimator: k1 | k2 | k3 (k3 = exp(x) - x - 1: unbiased, low variance, >= 0)
    kl_target: float | None = None         # set: adapt kl_coef with AdaptiveKLController
    kl_horizon: int = 10000                # the adaptive KL controller's horizon in steps (with kl_target)
    entropy_coef: float = 0.0              # entropy bonus weight (0 = metric only)
    temperature: float = 1.0               # the generator's sampling temperature (logprobs at T)
    # advantages, when the batch carries rewards instead of advantages
    advantage_mode: str = "grpo"           # "grpo" | "dr_grpo" | "rloo"
    reward_weights: dict[str, float] | None = None   # reward = sum of weight * component per named component (a missing weight is 1.0); None: all 1.0
    # logprob path
    logprob_path: str = "chunked"          # "chunked" (rl_ops) | "naive" (full logits; the bench's peer)
    chunk_size_tokens: int | None = None   # None: rl_ops picks a 32 MiB fp32 block
    shared_prefix: bool = True             # compute a prefix samples share once per micro-batch (exact)
    # mixture-of-experts policies (actors/learner/routing.py)
    routing_replay: bool = False           # route recorded tokens to the experts the generator used (R3)
    router_aux_loss_coef: float = 0.0      # weight of the router's load-balancing loss; 0 = off
    lora: dict | None = None               # {rank, alpha, targets}: train adapters only, base frozen (lora.py)
    # ranks (actors/learner/fsdp.py)
    strategy: str = "ddp"                  # "ddp": every rank holds the whole model | "fsdp": sharded (FSDP2)
    activation_checkpointing: bool = False   # recompute each decoder layer in backward (less memory)
    context_parallel: int = 1              # ranks per ring that split each sequence (context_parallel_step.py)

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        apply_loss_preset(self)   # the preset's objective / KL fields, before the rules check them
        rules = [
            (self.objective in OBJECTIVES, f"objective must be one of {OBJECTIVES}, got {self.objective!r}"),
            (self.lr_schedule in LR_SCHEDULES,
             f"lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}"),
            (self.logprob_path in LOGPROB_PATHS,
             f"logprob_path must be one of {LOGPROB_PATHS}, got {self.logprob_path!r}"),
            (self.dtype in _DTYPES, f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}"),
            (self.autocast_dtype in (None, "bfloat16", "float16"),
             f"autocast_dtype must be 'bfloat16', 'float16' or unset, got {self.autocast_dtype!r}"),
            (self.strategy in STRATEGIES, f"strategy must be one of {STRATEGIES}, got {self.strategy!r}"),
            (self.rl_ops_backend in RL_OPS_BACKENDS,
             f"rl_ops_backend must be one of {RL_OPS_BACKENDS}, got {self.rl_ops_backend!r}"),
            (self.lr > 0, f"lr must be > 0, got {self.lr}"),
            (self.rl_lr is None or self.rl_lr > 0, f"rl_lr must be > 0 or unset, got {self.rl_lr}"),
            (self.micro_batch_size >= 1, f"micro_batch_size must be >= 1, got {self.micro_batch_size}"),
            (self.context_parallel >= 1, f"context_parallel must be >= 1, got {self.context_parallel}"),
            (self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}"),
            (self.lr_schedule != "cosine" or self.total_steps > self.warmup_steps,
             f"lr_schedule='cosine' needs total_steps > warmup_steps, got total_steps={self.total_steps}"),
            (self.max_grad_norm is None or self.max_grad_norm > 0,
             f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}"),
            (self.temperature > 0, f"temperature must be > 0 (greedy samples are scored at 1), got "
                                   f"{self.temperature}"),
            (not (self.kl_coef or self.kl_target) or self.reference_model is not None,
             f"kl_coef={self.kl_coef} / kl_target={self.kl_target} need reference_model "
             "(\"initial\", \"warm_start\" or a model spec)"),
        ]
        for ok, message in rules:
            if not ok:
                raise LearnerError(message)
        self.loss_config()  # validates the clip / aggregation fields (RLOpsError)
        lora_config(self.lora)   # validates the adapter fields (LearnerError)

    @classmethod
    def from_dict(cls, values: dict | None) -> "LearnerConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values or {}) - names)
        if unknown:
            raise LearnerError(f"unknown learner option(s) {unknown}; known: {sorted(names)}")
        return cls(**(values or {}))

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["betas"] = list(self.betas)
        return out

    def loss_config(self, kl_coef: float | None = None) -> rl_ops.PolicyLossConfig:
        return preset_loss_config(self, kl_coef)   # the classic fields, the `loss` preset, loss_options


def build_policy(spec: str | dict, seed: int, dtype: torch.dtype, device: str):
    """(model, tokenizer) from a load_model spec, or from a dict of ModelConfig fields."""
    from ..models.tokenizer import byte_tokenizer

    if isinstance(spec, dict):
        config = ModelConfig(**spec)
        model = model_class(config.architecture)(config).init_weights(seed)
        return model.to(device=device, dtype=dtype), byte_tokenizer()
    return load_model(spec, dtype=dtype, device=device, seed=seed)


class Learner:
    """Owns the policy, the optional frozen reference, AdamW and the step counters.

    Invariants: policy_version == step + version_offset (a resumed run continues its count);
    every rank of a data-parallel group holds identical parameters after each step.
    """

    def __init__(self, config: LearnerConfig | dict | None = None, *, process_group=None):
        self.config = config if isinstance(config, LearnerConfig) else LearnerConfig.from_dict(config)
        cfg = self.config
        self.device = resolve_device(cfg.device)
        torch.manual_seed(cfg.seed)
        dtype = _DTYPES[cfg.dtype]
        self.model, self.tokenizer = build_policy(cfg.model, cfg.seed, dtype, self.device)
        self.model.train()
        if cfg.activation_checkpointing:
            fsdp.checkpoint_layers(self.model)
        self.routing = LearnerRouting(self.model, cfg.routing_replay, cfg.router_aux_loss_coef)
        self.reference = self._build_reference(dtype)
        self.reference_frozen = cfg.reference_model != "warm_start"   # "warm_start": set at the first RL step
        self.lora = LearnerLora(self.model, cfg.lora, cfg.seed)   # inactive without the lora option
        self.params = self.lora.trainable(self.model)   # LoRA: the adapters alone (base frozen)
        self.optimizer = self._build_optimizer()
        self.sharded = False               # strategy "fsdp" in a group: the model is FSDP2-sharded
        self.grad_bytes = 0                # this rank's gradient bytes at the last step (fsdp.sharded_bytes)
        self.kl = (rl_ops.AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
                   if cfg.kl_target else rl_ops.FixedKLController(cfg.kl_coef))
        self.step = 0
        self.policy_version = 0
        self.group = process_group
        self.world_size, self.rank = 1, 0
        self.rings = None                  # context_parallel > 1 in a group: LearnerRings
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.join_process_group(process_group)

    def join_process_group(self, process_group=None) -> None:
        """Become a rank of torch.distributed's initialised group (`process_group`, or the default
        one): rank 0's weights are broadcast, and from now on counts and gradients are summed
        over the ranks. Every rank calls it (a collective); a learner built before its group
        formed calls it once the group exists (actors/learner/group.py)."""
        self.group = process_group
        self.world_size = torch.distributed.get_world_size(process_group)
        self.rank = torch.distributed.get_rank(process_group)
        self._broadcast_parameters()
        if self.config.strategy == "fsdp":
            self._shard()
        if self.config.context_parallel > 1:
            self.rings = join_rings(self)

    def _build_optimizer(self) -> torch.optim.AdamW:
        cfg = self.config
        fused = all(p.device.type in ("cpu", "cuda") for p in self.params)  # 0.10 s/step, foreach 0.66 (135M)
        return torch.optim.AdamW(self.params, lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps,
                                 weight_decay=cfg.weight_decay, fused=fused)

    def _shard(self) -> None:
        """FSDP2 over the group (actors/learner/fsdp.py): the policy (and the reference) sharded
        in place; a full-model optimizer is rebuilt over the shards, its state (a resumed one's
        moments, the same on every rank) cut to each rank's shard."""
        cfg = self.config
        mesh = fsdp.device_mesh(self.group, self.device)
        mixed = _DTYPES[cfg.autocast_dtype] if cfg.autocast_dtype and self.device.type == "cuda" else None
        state = self.optimizer.state_dict()
        fsdp.shard_policy(self.model, mesh, mixed)
        if self.reference is not None:
            fsdp.shard_policy(self.reference, mesh, mixed)
        self.sharded = True
        if self.lora.active:
            return                         # the optimizer holds the adapters: whole on every rank
        self.params = self.lora.trainable(self.model)
        self.optimizer = self._build_optimizer()
        state["state"] = {i: {k: fsdp.shard_like(v, self.params[i]) for k, v in entry.items()}
                          for i, entry in state["state"].items()}
        self.optimizer.load_state_dict(state)

    # ------------------------------------------------------------------ public API

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One policy-gradient optimizer step on a rollout batch; returns its metrics (floats)."""
        return train_step(self, batch)

    def sft_step(self, batch: SftBatch) -> dict[str, float]:
        """One supervised step: token-mean cross-entropy on the loss_mask tokens (SFT warm start)."""
        return sft_step(self, batch)

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch | SftBatch) -> list[torch.Tensor]:
        """The policy's logprob of every token of every sample (index 0 is 0: no prefix), as the
        train step computes it; aligned with batch.token_ids. For consistency checks."""
        packed = self.routing.pack(batch, pack_batch(SftBatch(
            token_ids=batch.token_ids, loss_mask=[[0] + [1] * (len(x) - 1) for x in batch.token_ids])))
        order, micro = self._micro_batches(packed)
        rows = []
        for mb in micro:
            logp, _ = self._logprobs(self.model, mb)
            for row, n in zip(logp, mb.attention_mask.sum(-1).tolist()):
                rows.append(torch.cat([torch.zeros(1), row[:n - 1].float().cpu()]))
        fsdp.reshard(self.model)
        out = [None] * len(rows)
        for position, index in enumerate(order.tolist()):
            out[index] = rows[position]
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's weights with Hugging Face names, on the CPU (no tied duplicate). Sharded: a
        collective every rank calls; ranks other than 0 get {} (fsdp.full_weights)."""
        if self.sharded:     # gathered one tensor at a time (a collective: every rank calls it)
            state = fsdp.full_weights(self.model, keep=self.rank == 0)
            if self.rank != 0:
                return {}
        else:
            state = {k: v.detach().to("cpu") for k, v in self.model.state_dict().items()}
        if self.model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        return self.lora.merged(state)     # LoRA: base + scale * B @ A (new tensors)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based): warm-up, then constant or cosine."""
        cfg = self.config
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return cfg.lr
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
        return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def save_checkpoint(self, folder: str | Path, extra: dict | None = None) -> Path:
        """Weights, optimizer, RNG, counters and `extra` (JSON-able), written atomically. Strategy
        "fsdp": a DCP checkpoint every rank writes its shard of (sharded_state.py)."""
        if self.config.strategy == "fsdp":
            from .sharded_state import save_sharded_checkpoint
            return save_sharded_checkpoint(self, folder, extra)
        from .state import save_learner_checkpoint
        path = save_learner_checkpoint(self, folder, extra)
        if self.world_size > 1:
            torch.distributed.barrier(group=self.group)   # rank 0 has written it when any rank returns
        return path

    def load_checkpoint(self, folder: str | Path) -> dict:
        """Restore everything save_checkpoint wrote (a DCP one at any rank count); returns `extra`."""
        from .sharded_state import is_sharded_checkpoint, load_sharded_checkpoint
        from .state import load_learner_checkpoint
        if is_sharded_checkpoint(folder):
            return load_sharded_checkpoint(self, folder)
        if self.sharded:
            raise LearnerError(f"{folder} is a whole-model checkpoint (strategy 'ddp'); a sharded group loads "
                               "DCP checkpoints only: resume it with ranks = 1, or before the group forms "
                               "(resume_from), and save again")
        return load_learner_checkpoint(self, folder)

    def export_hf(self, folder: str | Path) -> Path:
        """The policy as a Hugging Face folder (config.json, model.safetensors, tokenizer). Sharded:
        every rank calls it; rank 0 writes it one layer at a time (streamed_export.py)."""
        if self.sharded:
            from .streamed_export import export_sharded
            return export_sharded(self, folder)
        from .state import export_hf
        return export_hf(self, folder)

    # ------------------------------------------------------------------ steps

    def _build_reference(self, dtype):
        spec = self.config.reference_model
        if spec is None:
            return None
        if spec in ("initial", "warm_start"):     # "warm_start": overwritten by freeze_reference
            ref = type(self.model).empty(self.model.config).to(device=self.device, dtype=dtype)
            ref.load_state_dict(self.model.state_dict())
        else:
            ref, _ = build_policy(spec, self.config.seed, dtype, self.device)
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref.eval()

    def freeze_reference(self) -> None:
        """reference_model "warm_start": the reference becomes the policy as it is now (LoRA: the
        adapters merged in), once, before the first RL step's loss; checkpoints keep it."""
        with torch.no_grad():
            policy = self.lora.merged(self.model.state_dict())
            for name, tensor in self.reference.state_dict().items():
                tensor.copy_(policy[name])
        self.reference_frozen = True

    def batch_advantages(self, batch: TrainBatch) -> tuple[dict[str, float], torch.Tensor | None]:
        """(reward metrics, per-sample advantages (B,)) from a batch's rewards over its groups;
        ({}, None) when the batch carries its advantages. Data parallel: the group's rank 0 calls
        it on the whole batch before cutting it into shards (actors/learner/group.py)."""
        if not isinstance(batch, TrainBatch):
            raise LearnerError(f"a train step takes a TrainBatch (postrain.actors.records), got "
                               f"{type(batch).__name__}; build one, e.g. TrainBatch(token_ids=..., ...)")
        if batch.advantages is not None:
            return {}, None
        num = batch.num_samples
        components = reward_components_of(batch, num)
        sizes = group_sizes_of(batch.group_ids, num) if batch.group_ids is not None else [num]  # ragged: failures
        res = rl_ops.compute_advantages(components, self.config.reward_weights, sizes,
                                        mode=self.config.advantage_mode)
        rewards = res.rewards
        return {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std(unbiased=False)),
                "num_zero_variance_groups": float(res.num_zero_variance_groups)}, res.advantages

    def _micro_batches(self, packed: PackedBatch) -> tuple[torch.Tensor, list[PackedBatch]]:
        """(order, micro-batches of `micro_batch_size` samples) on the learner's device: the samples
        in `order` (B,), grouped by shared prefix where that saves compute, else sorted by length
        so that short samples pad to short ones (actors/learner/shared_prefix.py). The gradient is the
        same in any order, since every micro-batch's loss uses the whole batch's normalisers."""
        order, micro = plan_micro_batches(packed, self.config.micro_batch_size,   # MoE, rings: plain rows
                                          self.config.shared_prefix and not self.routing.active
                                          and self.config.context_parallel == 1)
        return order, [mb.to(self.device) for mb in micro]

    def _global_counts(self, packed: PackedBatch) -> tuple[float, float]:
        """Trained tokens and non-empty sequences over the whole batch (all ranks)."""
        counts = torch.tensor([float(packed.loss_mask.sum()), float((packed.loss_mask.sum(-1) > 0).sum())],
                              dtype=torch.float64)
        self._all_reduce(counts)
        if counts[0] == 0:
            raise LearnerError("the batch has no trained tokens (loss_mask is 0 everywhere); mark the "
                               "response tokens with 1")
        return float(counts[0]), float(counts[1])

    def _logprobs(self, model: LlamaModel, mb: PackedBatch, replay: bool | None = None):
        """logp, entropy (B, T - 1) of the targets input_ids[:, 1:] (float32, or the model's dtype
        if wider); 0 where not trained.

        Only the loss_mask positions reach the LM head: (N, H) hidden rows, N = trained tokens."""
        if self.config.context_parallel > 1:
            return ring_logprobs(self, model, mb)      # each rank its slice (context_parallel_step.py)
        sel = mb.loss_mask                                                                # (B, T-1)
        with self.autocast(), self.routing.trace(model, mb, replay):
            h = self._trained_hidden(model, mb)                                           # (N, H)
        logp, entropy = self._head(model, h, mb.input_ids[:, 1:][sel])
        zeros = torch.zeros(sel.shape, dtype=logp.dtype, device=sel.device)
        return zeros.masked_scatter(sel, logp), zeros.masked_scatter(sel, entropy)

    def autocast(self):
        """The forward's autocast context: `autocast_dtype` where set, else off."""
        cfg = self.config
        return torch.autocast(self.device.type, dtype=_DTYPES[cfg.autocast_dtype or cfg.dtype],
                              enabled=cfg.autocast_dtype is not None)

    def _head(self, model: LlamaModel, h: torch.Tensor, targets: torch.Tensor):
        """logp, entropy (N,) of `targets` (N,) from final hidden rows `h` (N, H)."""
        cfg = self.config
        weight = model.lm_head.weight
        h = h.to(weight.dtype)
        cap = model.config.final_logit_softcapping                # Gemma: the full logits, capped
        if cfg.logprob_path == "naive" or cap is not None:
            logits = h @ weight.t() if cap is None else torch.tanh(h @ weight.t() / cap) * cap
            logp, entropy = rl_ops.naive_token_logprobs(logits, targets, cfg.temperature,
                                                        return_entropy=True)
        else:
            logp, entropy = rl_ops.token_logprobs_from_hidden(
                h, weight, targets, temperature=cfg.temperature, chunk_size_tokens=cfg.chunk_size_tokens,
                return_entropy=True, backend=cfg.rl_ops_backend)
        return logp, entropy

    @staticmethod
    def _trained_hidden(model: LlamaModel, mb: PackedBatch) -> torch.Tensor:
        """(N, H) final hidden states at the loss_mask positions: from one padded pass over the
        whole samples, or from the shared-prefix pass (each shared prefix computed once)."""
        sel = mb.loss_mask                                                                # (B, T-1)
        if mb.shared is None:
            full = bool(mb.attention_mask.all())
            hidden = model.hidden_states(mb.input_ids, None if full else mb.attention_mask)  # (B, T, H)
            return hidden[:, :-1][sel]
        rows = model.shared_prefix_hidden_states(mb.shared.batch)                         # (G*P + B*S, H)
        return rows[mb.shared.hidden_rows[:, :-1][sel]]

    @torch.no_grad()
    def _recompute(self, micro: list[PackedBatch], model: LlamaModel) -> list[torch.Tensor]:
        out = [self._logprobs(model, mb)[0] for mb in micro]
        fsdp.reshard(model)               # no backward frees the root's gathered weights
        return out

    def _staleness(self, packed: PackedBatch) -> dict[str, float]:
        known = packed.loss_mask & (packed.policy_versions >= 0)
        if not bool(known.any()):
            return {}
        lag = (self.policy_version - 1 - packed.policy_versions[known]).float()  # version before the step
        return {"staleness_mean": float(lag.mean()), "staleness_max": float(lag.max())}

    # ------------------------------------------------------------------ data parallel

    def _all_reduce(self, tensor: torch.Tensor, op=None) -> None:
        """Sum (or `op`) a per-sample count or metric over the ranks, each sample once: over the
        data-parallel group when context parallel (a ring's ranks hold the same samples)."""
        if self.world_size > 1:
            group = self.rings.dp_group if self.rings is not None else self.group
            torch.distributed.all_reduce(tensor, op=op or torch.distributed.ReduceOp.SUM, group=group)

    def _all_reduce_grads(self) -> None:
        """Sum every gradient over the ranks in one flat buffer (losses use global normalisers).
        Sharded without LoRA: FSDP has reduce-scattered them already (a SUM)."""
        if self.world_size == 1 or (self.sharded and not self.lora.active):
            return
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def _broadcast_parameters(self) -> None:
        with torch.no_grad():
            for tensor in list(self.model.state_dict().values()) + self.lora.parameters():
                torch.distributed.broadcast(tensor, src=0, group=self.group)
