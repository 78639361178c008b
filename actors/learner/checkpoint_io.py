"""CheckpointIO: how a learner saves, loads and exports its state; the Learner picks one at start.

    io.save(folder, extra)     # every rank calls each method (collectives where sharded)
    io.load(folder)            # either format, as the folder's state.json names it; returns extra
    io.export_hf(folder)       # a Hugging Face folder transformers loads

Implementations: WholeCheckpointIO (state.py, strategy "ddp": rank 0 writes the whole model)
and ShardedCheckpointIO (sharded_state.py, strategy "fsdp": DCP, every rank its shard). Both
load either format where the learner can hold it: a DCP checkpoint at any rank count, a
whole-model one before the model is sharded. They see the learner through
`CheckpointedLearner`, the parts a checkpoint holds, so they import nothing of learner.py.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from postrain.ext import rl_ops

from .collectives import Collectives
from .config import LearnerConfig
from .counter import StepCounter
from .lora import LearnerLora
from .reference import KLReference
from .task_kl import TaskKL

if TYPE_CHECKING:
    from ..models.llama import LlamaModel
    from ..models.tokenizer import Tokenizer


WHOLE_FORMAT = "postrain-learner-1"           # state.py
SHARDED_FORMAT = "postrain-learner-dcp-1"     # sharded_state.py


def is_sharded_checkpoint(folder: str | Path) -> bool:
    """True when `folder` holds a DCP learner checkpoint (state.json names SHARDED_FORMAT)."""
    path = Path(folder) / "state.json"
    return path.exists() and json.loads(path.read_text()).get("format") == SHARDED_FORMAT


class CheckpointIO(Protocol):
    def save(self, folder: str | Path, extra: dict | None = None) -> Path: ...

    def load(self, folder: str | Path) -> dict: ...

    def export_hf(self, folder: str | Path) -> Path: ...


class CheckpointedLearner(Protocol):
    """What a checkpoint reads and restores (Learner has it all)."""

    config: LearnerConfig
    device: torch.device
    model: LlamaModel
    tokenizer: Tokenizer
    lora: LearnerLora
    kl: rl_ops.FixedKLController | rl_ops.AdaptiveKLController
    kl_reference: KLReference
    task_kl: TaskKL
    counter: StepCounter
    comm: Collectives
    sharded: bool

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def params(self) -> list[torch.nn.Parameter]: ...

    @property
    def reference(self) -> LlamaModel | None: ...
