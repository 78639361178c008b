"""Sharded learner checkpoints (strategy "fsdp"): torch.distributed.checkpoint (DCP), resumable
at any number of ranks.

A checkpoint is a folder:

    dcp/          DCP's files: each rank's shards (`__<rank>_0.distcp`) and `.metadata`; entries
                  model.<hf name> (the policy, no tied duplicate), optimizer.state.<i>.<name>
                  (AdamW's moments and step per parameter index), adapters.<name> (LoRA),
                  reference.<hf name> (the KL reference)
    state.json    format, step, policy_version, kl_coef, reference_frozen, the optimizer's param groups, the
                  RNG states (rank 0's), the learner config, world_size, and `extra`

Design note. Every rank calls save and load (collectives). DCP records each tensor's global
shape and each shard's offsets, so a load at another rank count (2 -> 1, 2 -> 4) reads the
pieces each rank's shard needs: the weights and the AdamW moments come back identical. A
learner not yet in a group (a resume before the group forms, or ranks = 1) loads whole
tensors, and sharding then cuts them (Learner._shard). Atomicity as for every checkpoint
(core/atomic_write.py): rank 0 makes the hidden sibling folder and tells the other ranks
its path; all write their shards there; rank 0 swaps it into place once every rank is done
(DCP's metadata, written last by rank 0, waits for them), so a kill mid-write leaves the
previous checkpoint whole. The folder must be on a file system every rank sees.

    io = ShardedCheckpointIO(learner)       # the Learner picks it once, for strategy "fsdp"
    io.save(folder, extra); extra = io.load(folder); io.export_hf(hf_folder)
"""
from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import numpy as np
import torch

from postrain.core.atomic_write import repair_interrupted_write, write_folder_atomically
from .batch import LearnerError
from .checkpoint_io import SHARDED_FORMAT, CheckpointedLearner, is_sharded_checkpoint
from .state import WholeCheckpointIO, extra_json
from .streamed_export import export_sharded

FORMAT = SHARDED_FORMAT


def _tensors(learner: CheckpointedLearner, for_load: bool) -> dict[str, torch.Tensor]:
    """The flat {entry: tensor} DCP saves, or loads in place (the learner's own tensors, shards
    under FSDP; for a load, the optimizer state is allocated first)."""
    out = {}
    for prefix, model in (("model", learner.model), ("reference", learner.reference)):
        if model is None:
            continue
        for name, value in model.state_dict().items():
            if not (model.config.tie_word_embeddings and name == "lm_head.weight"):
                out[f"{prefix}.{name}"] = value
    for name, p in _adapters(learner).items():
        out[f"adapters.{name}"] = p.detach()
    if for_load:
        return out
    for index, entry in learner.optimizer.state_dict()["state"].items():
        for name, value in entry.items():
            out[f"optimizer.state.{index}.{name}"] = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    return out


def _adapters(learner: CheckpointedLearner) -> dict[str, torch.nn.Parameter]:
    lora = learner.lora
    return {f"{name}.lora_{ab}": p for name in lora.modules
            for ab, p in (("A", lora.lora_A[name]), ("B", lora.lora_B[name]))}


def _empty_optimizer_state(learner: CheckpointedLearner, indices: list[int]) -> dict[str, torch.Tensor]:
    """Tensors shaped as AdamW's state of the parameters `indices` (shards under FSDP), to load into."""
    out = {}
    for index in indices:
        p = learner.params[index]
        out[f"optimizer.state.{index}.exp_avg"] = torch.zeros_like(p)
        out[f"optimizer.state.{index}.exp_avg_sq"] = torch.zeros_like(p)
        out[f"optimizer.state.{index}.step"] = torch.zeros((), dtype=torch.float32)   # AdamW moves it
    return out


def save_sharded_checkpoint(learner: CheckpointedLearner, folder: str | Path, extra: dict | None = None) -> Path:
    """Every rank: write the learner's state to `folder` (module docstring). Returns the folder."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    extra_text = extra_json(extra)
    folder = Path(folder)
    group = learner.comm.group
    tensors = _tensors(learner, for_load=False)
    state = _state_json(learner, json.loads(extra_text))
    if learner.comm.rank != 0:
        where: list = [None]   # rank 0's temporary folder, by broadcast_object_list
        dist.broadcast_object_list(where, src=0, group=group)
        dcp.save(tensors, checkpoint_id=Path(where[0]) / "dcp", process_group=group, no_dist=False)
        dist.barrier(group=group)       # rank 0 has put the folder in place when any rank returns
        return folder

    def write(tmp: Path) -> None:
        if learner.comm.world_size > 1:
            dist.broadcast_object_list([str(tmp)], src=0, group=group)
        dcp.save(tensors, checkpoint_id=tmp / "dcp", process_group=group, no_dist=learner.comm.world_size == 1)
        (tmp / "state.json").write_text(json.dumps(state))

    write_folder_atomically(folder, write)
    if learner.comm.world_size > 1:
        dist.barrier(group=group)
    return folder


def _state_json(learner: CheckpointedLearner, extra: dict) -> dict:
    state = learner.optimizer.state_dict()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in state["param_groups"]]
    # type ignore: numpy's stub types get_state() as the dict; legacy=True (the default) gives a tuple
    np_state: tuple = np.random.get_state()  # type: ignore[assignment]
    return {
        "format": FORMAT, "step": learner.counter.step, "policy_version": learner.counter.policy_version,
        "kl_coef": learner.kl.coef, "reference_frozen": learner.kl_reference.frozen,
        "task_kl": learner.task_kl.state_dict(),
        "param_groups": groups, "config": learner.config.to_dict(),
        "optimizer_state": sorted(int(i) for i in state["state"]), "world_size": learner.comm.world_size,
        "python_rng": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy_rng": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch_rng": torch.random.get_rng_state().tolist(),
        "extra": extra,
    }


def load_sharded_checkpoint(learner: CheckpointedLearner, folder: str | Path) -> dict:
    """Every rank: restore what save_sharded_checkpoint wrote, at any rank count; returns `extra`."""
    import torch.distributed.checkpoint as dcp

    folder = Path(folder)
    repair_interrupted_write(folder)
    state = json.loads((folder / "state.json").read_text())
    if state.get("format") != FORMAT:
        raise LearnerError(f"{folder}: checkpoint format {state.get('format')!r} is not {FORMAT!r}")
    if bool(_adapters(learner)) != any(k.startswith("adapters.") for k in _saved_keys(folder)):
        raise LearnerError(f"{folder} and this learner differ in LoRA adapters; resume with the lora options "
                           "the checkpoint was written with")
    indices = state["optimizer_state"]
    tensors = {**_tensors(learner, for_load=True), **_empty_optimizer_state(learner, indices)}
    try:
        with warnings.catch_warnings():      # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(tensors, checkpoint_id=folder / "dcp", process_group=learner.comm.group,
                     no_dist=learner.comm.world_size == 1)
    except Exception as exc:     # a missing or misshapen entry: another model or options
        raise LearnerError(f"{folder}: the checkpoint does not fit this learner ({str(exc).splitlines()[0][:300]}); "
                           "resume with the model and options it was written with") from None
    opt_state = {}
    for index in indices:
        opt_state[index] = {name: tensors[f"optimizer.state.{index}.{name}"]
                            for name in ("step", "exp_avg", "exp_avg_sq")}
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in state["param_groups"]]
    learner.optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
    py = state["python_rng"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, gauss = state["numpy_rng"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.random.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
    learner.counter.restore(int(state["step"]), int(state["policy_version"]))
    learner.kl.coef = float(state["kl_coef"])
    learner.task_kl.load_state_dict(state.get("task_kl"))   # absent: from before targets per task
    learner.kl_reference.frozen = bool(state.get("reference_frozen", True))
    return state["extra"]


def _saved_keys(folder: Path) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return list(FileSystemReader(str(folder / "dcp")).read_metadata().state_dict_metadata)


class ShardedCheckpointIO:
    """Checkpoints of a learner with strategy "fsdp": DCP, every rank writes its shard. Loads a
    whole-model checkpoint too while the model is not yet sharded (a resume before the group forms)."""

    def __init__(self, learner: CheckpointedLearner):
        self.learner = learner

    def save(self, folder: str | Path, extra: dict | None = None) -> Path:
        return save_sharded_checkpoint(self.learner, folder, extra)

    def load(self, folder: str | Path) -> dict:
        if is_sharded_checkpoint(folder):
            return load_sharded_checkpoint(self.learner, folder)
        if self.learner.sharded:
            raise LearnerError(f"{folder} is a whole-model checkpoint (strategy 'ddp'); a sharded group loads "
                               "DCP checkpoints only: resume it with ranks = 1, or before the group forms "
                               "(resume_from), and save again")
        return WholeCheckpointIO(self.learner).load(folder)

    def export_hf(self, folder: str | Path) -> Path:
        """Every rank: rank 0 writes the (merged) policy one layer at a time (streamed_export.py)."""
        if not self.learner.sharded:       # not yet in a group: the whole model is here
            return WholeCheckpointIO(self.learner).export_hf(folder)
        learner = self.learner
        return export_sharded(learner.model, learner.lora, learner.tokenizer, learner.counter.policy_version, learner.comm,
                              folder, base_model=learner.config.model)
