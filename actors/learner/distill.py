"""LearnerDistill: on-policy distillation in the learner, the teacher it may hold and the rules
a distillation batch keeps.

    distill = LearnerDistill.build(config, policy, tokenizer, device, dtype)
    distill.check_batch(batch)         # LearnerError naming what the config needs of the batch
    distill.teacher                    # the frozen teacher (learner.teacher_model), or None
    distill.weight                     # the KL's weight in the loss (1 for loss "opd")

Design note. `learner.loss = "opd"` trains on the per-token reverse KL(student || teacher) on
the trained tokens alone; `learner.distill_coef` adds that KL, times the coefficient, to any
other loss. The teacher comes in one of two ways: as its top-k rows in the batch
(TrainBatch.teacher_*: a scorer scored the samples; the KL is over the top k and a tail bucket,
a lower bound of the full KL: postrain.ext.distill), or as `learner.teacher_model`, a model
loaded frozen here whose full-vocabulary log-softmax is taken chunk by chunk beside the
student's (the exact KL; teacher and learner on one host). Both must share the policy's
tokenizer: a teacher model with another vocabulary is refused by name, as are ids outside the
policy's vocabulary in a batch. The KL is reduced by the learner's agg_mode over the whole
batch's counts, so micro-batches and data-parallel ranks sum to one process's loss
(step.py); the shared-prefix path carries the teacher's rows (they are per token, cut with
the samples), and context-parallel rings are refused by the config.

Invariant: `teacher` never has a gradient, and is not part of a checkpoint (it is rebuilt from
its spec).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..models.loading import build_policy
from ..records import TrainBatch
from . import fsdp
from .batch import LearnerError
from .config import LearnerConfig

if TYPE_CHECKING:
    from ..models.llama import LlamaModel
    from ..models.tokenizer import Tokenizer


class LearnerDistill:
    """Distillation's switch, weight and teacher (module docstring)."""

    def __init__(self, config: LearnerConfig, vocab_size: int, teacher: LlamaModel | None):
        self.active = config.distills
        self.weight = config.distill_weight if self.active else 0.0
        self.loss_name = "loss = \"opd\"" if config.loss == "opd" else f"distill_coef = {config.distill_coef}"
        self.vocab_size = vocab_size
        self.teacher = teacher

    @classmethod
    def build(cls, config: LearnerConfig, policy: LlamaModel, tokenizer: Tokenizer | None, device: torch.device,
              dtype: torch.dtype) -> "LearnerDistill":
        """The learner's distillation part; loads `teacher_model` (frozen) and refuses one that
        does not share the policy's vocabulary."""
        spec = config.teacher_model
        vocab = int(policy.config.vocab_size)
        if spec is None:
            return cls(config, vocab, None)
        teacher, teacher_tokenizer = build_policy(spec, config.seed, dtype, str(device))
        name = spec if isinstance(spec, str) else "the ModelConfig dict"
        if int(teacher.config.vocab_size) != vocab:
            raise LearnerError(f"learner.teacher_model {name!r} has a vocabulary of {teacher.config.vocab_size} "
                               f"tokens, the policy {vocab}: distillation compares the two token by token and "
                               "needs one tokenizer; pick a teacher of the policy's tokenizer")
        difference = (tokenizer.vocabulary_difference(teacher_tokenizer)
                      if tokenizer is not None and teacher_tokenizer is not None else None)
        if difference is not None:
            raise LearnerError(f"learner.teacher_model {name!r} has another tokenizer than the policy "
                               f"({difference}); distillation needs one tokenizer")
        for p in teacher.parameters():
            p.requires_grad_(False)
        return cls(config, vocab, teacher.eval())

    def check_batch(self, batch: TrainBatch) -> None:
        """LearnerError unless the batch carries what the config's distillation needs: the
        teacher's rows when distilling without a teacher model, none otherwise (rows the step
        would not use are refused, not ignored), their ids inside the policy's vocabulary. Rank 0
        of a group checks the whole batch before cutting it (no rank fails alone)."""
        rows = batch.has_teacher_rows
        if self.active and self.teacher is None and not rows:
            raise LearnerError(f"learner.{self.loss_name} needs the teacher's rows in every batch "
                               "(TrainBatch.teacher_topk_ids, teacher_topk_logprobs, teacher_tail_logmass: a "
                               "scorer serving 'logprobs' gives them), or learner.teacher_model = SPEC to score "
                               "the samples in the learner; this batch has none")
        if rows and self.teacher is not None:
            raise LearnerError("the batch carries the teacher's top-k rows and learner.teacher_model is set: the "
                               "learner would score the full vocabulary itself; send the rows or set "
                               "teacher_model, not both")
        if rows and not self.active:
            raise LearnerError("the batch carries the teacher's top-k rows but the learner does not distill: set "
                               "learner.loss = \"opd\" or learner.distill_coef > 0, or leave the rows out")
        for i, ids in enumerate(batch.teacher_topk_ids or ()):
            table = np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids)
            if table.size and (int(table.min()) < 0 or int(table.max()) >= self.vocab_size):
                raise LearnerError(f"teacher_topk_ids[{i}] holds ids in [{int(table.min())}, {int(table.max())}], "
                                   f"outside the policy's vocabulary [0, {self.vocab_size}): the teacher must "
                                   "share the policy's tokenizer")

    def release(self) -> None:
        """Free the teacher's gathered weights after a micro-batch's backward (FSDP; no-op else)."""
        fsdp.reshard(self.teacher)
