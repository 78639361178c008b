"""LearnerConfig: every knob of the learner, validated where it is made.

    config = LearnerConfig(model="tiny", lr=1e-5, micro_batch_size=4)   # LearnerError names a bad field
    config = LearnerConfig.from_dict({"lr": 1e-5})                       # an unknown name is refused
    config.lr_at(step)                                                   # the schedule's learning rate

The learner actor's options check the fields' types with pydantic (`__pydantic_config__`
forbids unknown names); `__post_init__` applies the loss preset and checks the rules between
fields. Every field carries its unit, default and where it applies.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import cast

import torch

from postrain.ext import rl_ops
from postrain.ext.cupy_ops import BACKENDS as RL_OPS_BACKENDS

from .batch import LearnerError
from .fsdp import STRATEGIES
from .lora import lora_config
from .loss_preset import apply_loss_preset, preset_loss_config

OBJECTIVES = ("ppo", "decoupled")
LR_SCHEDULES = ("constant", "cosine")
LOGPROB_PATHS = ("chunked", "naive")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    loss: str = "ppo"                      # a named loss preset: ppo | dapo | gspo | cispo | tis | mis | geo-mis | icepop | kl (loss_preset.py),
                                           # or "opd": on-policy distillation, the reverse KL to a teacher alone (docs/scorers.md)
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
    # on-policy distillation (actors/learner/distill.py, docs/scorers.md)
    distill_coef: float = 0.0              # adds distill_coef * KL(student || teacher) to the loss; > 0 needs the
                                           # teacher's rows in every batch, or teacher_model (loss "opd": weight 1)
    teacher_model: str | dict | None = None   # a model spec loaded frozen in the learner: the KL over the full
                                              # vocabulary instead of the batch's top-k rows (same tokenizer)
    distill_divergence: str = "reverse"    # "reverse" KL(student || teacher) or "forward" KL(teacher || student)
    # advantages, when the batch carries rewards instead of advantages
    advantage_mode: str = "grpo"           # "grpo" | "dr_grpo" | "rloo"
    reward_weights: dict[str, float] | None = None   # reward = sum of weight * component per named component (a missing weight is 1.0); None: all 1.0
    # logprob path
    logprob_path: str = "chunked"          # "chunked" (rl_ops) | "naive" (full logits; the bench's peer)
    chunk_size_tokens: int | None = None   # None: rl_ops picks a 32 MiB fp32 block
    shared_prefix: bool = True             # compute a prefix samples share once per micro-batch (exact)
    train_vision: bool = False             # a vision-language policy: train its vision tower and projector too
                                           # (False: frozen, its features computed without a gradient)
    exact: bool = False                    # batch-invariant ops: logprobs bitwise equal to an exact generator's
                                           # (models/exact.py; float32; not with autocast, rings or distillation)
    # mixture-of-experts policies (actors/learner/routing.py)
    routing_replay: bool = False           # route recorded tokens to the experts the generator used (R3)
    router_aux_loss_coef: float = 0.0      # weight of the router's load-balancing loss; 0 = off
    lora: dict | None = None               # {rank, alpha, targets}: train adapters only, base frozen (lora.py)
    # ranks (actors/learner/fsdp.py)
    strategy: str = "ddp"                  # "ddp": every rank holds the whole model | "fsdp": sharded (FSDP2)
    activation_checkpointing: bool = False   # recompute each decoder layer in backward (less memory)
    context_parallel: int = 1              # ranks per ring that split each sequence (context_parallel_step.py)

    def __post_init__(self) -> None:
        self.betas = cast(tuple[float, float], tuple(self.betas))   # a config brings a list (of two)
        apply_loss_preset(self)   # the preset's objective / KL fields, before the rules check them
        rules = [
            (self.objective in OBJECTIVES, f"objective must be one of {OBJECTIVES}, got {self.objective!r}"),
            (self.lr_schedule in LR_SCHEDULES,
             f"lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}"),
            (self.logprob_path in LOGPROB_PATHS,
             f"logprob_path must be one of {LOGPROB_PATHS}, got {self.logprob_path!r}"),
            (self.dtype in DTYPES, f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}"),
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
            (self.distill_coef >= 0, f"distill_coef must be >= 0, got {self.distill_coef}"),
            (not (self.loss == "opd" and self.distill_coef),
             f"loss = \"opd\" trains on the distillation KL alone (weight 1); distill_coef = {self.distill_coef} "
             "adds it to another loss: leave distill_coef at 0, or pick another loss"),
            (self.distill_divergence in rl_ops.DIVERGENCES,
             f"distill_divergence must be one of {rl_ops.DIVERGENCES}, got {self.distill_divergence!r}"),
            (self.teacher_model is None or self.distills,
             "teacher_model is the teacher of on-policy distillation: set loss = \"opd\" or distill_coef > 0, "
             "or leave teacher_model unset"),
            (self.teacher_model not in ("initial", "warm_start"),
             f"teacher_model names a model (a folder, a built-in name, a .gguf file, a ModelConfig dict), got "
             f"{self.teacher_model!r}, which only reference_model takes"),
            (not (self.distills and self.context_parallel > 1),
             f"distillation (loss = \"opd\" or distill_coef > 0) does not run on context-parallel rings yet "
             f"(context_parallel = {self.context_parallel}): set context_parallel = 1 and use data-parallel ranks"),
        ]
        rules += self._exact_rules()
        for ok, message in rules:
            if not ok:
                raise LearnerError(message)
        self.loss_config()  # validates the clip / aggregation fields (RLOpsError)
        lora_config(self.lora)   # validates the adapter fields (LearnerError)

    def _exact_rules(self) -> list[tuple[bool, str]]:
        """What `exact = true` does not run with, each with its fix."""
        if not self.exact:
            return []
        return [
            (self.dtype == "float32" and self.autocast_dtype is None,
             f"exact = true needs float32 weights and no autocast, got dtype = {self.dtype!r}, autocast_dtype = "
             f"{self.autocast_dtype!r}"),
            (self.context_parallel == 1, f"exact = true does not cover context-parallel rings yet "
                                         f"(context_parallel = {self.context_parallel}); set context_parallel = 1"),
            (not self.distills, "exact = true does not cover distillation yet; set exact = false or drop "
                                "loss = \"opd\" / distill_coef"),
        ]

    @property
    def distills(self) -> bool:
        """True when the step trains on the distillation KL (loss "opd", or distill_coef > 0)."""
        return self.loss == "opd" or self.distill_coef > 0

    @property
    def distill_weight(self) -> float:
        """The KL's weight in the loss: 1 for loss "opd", else distill_coef."""
        return 1.0 if self.loss == "opd" else self.distill_coef

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

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based): warm-up, then constant or cosine."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.lr_schedule == "constant":
            return self.lr
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
