"""Learner checkpoints: everything a resumed run needs, written atomically; Hugging Face export.

A checkpoint is a folder:

    model.safetensors      the policy (Hugging Face tensor names; metadata: step, policy_version)
    reference.safetensors  the frozen KL reference, when the learner has one
    optimizer.safetensors  AdamW state tensors ("state.<param index>.<name>") and RNG states ("rng.*")
    adapters.safetensors   the LoRA adapters, when the learner has them (model.safetensors: the base)
    state.json             format, step, policy_version, kl_coef, reference_frozen (a "warm_start"
                           reference taken yet), the optimizer's param groups,
                           Python's RNG state, the learner config, and `extra` (the orchestrator's
                           JSON-able state: ledger, data cursor, buffer)

No pickle anywhere. Atomicity (core/atomic_write.py): the folder is written as a hidden
sibling and swapped into place in one step, so a kill or a full disk mid-write leaves the
previous checkpoint whole and loadable (a full disk raises DiskFullError naming the
folder); loading first repairs what a killed writer left. Under data parallel only rank 0
writes; every rank loads.

    io = WholeCheckpointIO(learner)         # the Learner picks it once, by strategy (checkpoint_io.py)
    io.save(folder, extra); extra = io.load(folder); io.export_hf(hf_folder)
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from postrain.core.atomic_write import repair_interrupted_write, write_folder_atomically
from ..models.loading import load_state_dict_checked, save_checkpoint
from .batch import LearnerError
from .checkpoint_io import WHOLE_FORMAT, CheckpointedLearner
from .lora import ADAPTER_FOLDER

FORMAT = WHOLE_FORMAT


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    state = optimizer.state_dict()
    tensors = {}
    for index, entry in state["state"].items():
        for name, value in entry.items():
            if not isinstance(value, torch.Tensor):
                value = torch.tensor(value)
            tensors[f"state.{index}.{name}"] = value.detach().to("cpu").contiguous()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
              for g in state["param_groups"]]
    return tensors, groups


def _weights(model) -> dict[str, torch.Tensor]:
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def _rng_tensors() -> dict[str, torch.Tensor]:
    # type ignore: numpy's stub types get_state() as the dict; legacy=True (the default) gives a tuple
    out = {"rng.torch_cpu": torch.random.get_rng_state(),
           "rng.numpy": torch.from_numpy(np.random.get_state()[1].astype(np.int64))}  # type: ignore[index]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng.cuda.{i}"] = s
    return out


def extra_json(extra: dict | None) -> str:
    """A checkpoint's `extra` as JSON, or a LearnerError saying how to make it JSON-able."""
    try:
        return json.dumps(extra or {})
    except TypeError as exc:
        raise LearnerError(f"checkpoint extra must be JSON-able (dicts, lists, numbers, strings): {exc}; "
                           "convert arrays with .tolist()") from None


class WholeCheckpointIO:
    """Checkpoints of a learner that holds the whole model (strategy "ddp"): rank 0 writes."""

    def __init__(self, learner: CheckpointedLearner):
        self.learner = learner

    def save(self, folder: str | Path, extra: dict | None = None) -> Path:
        """Write the learner's full state to `folder` (module docstring); every rank returns once
        rank 0 has written it. Returns the folder."""
        learner = self.learner
        extra_text = extra_json(extra)
        if learner.comm.rank == 0:
            self._write(Path(folder), json.loads(extra_text))
        learner.comm.barrier()
        return Path(folder)

    def _write(self, folder: Path, extra: dict) -> None:
        learner = self.learner
        opt_tensors, groups = _optimizer_tensors(learner.optimizer)
        # type ignore: numpy's stub types get_state() as the dict; legacy=True (the default) gives a tuple
        np_state: tuple = np.random.get_state()  # type: ignore[assignment]
        state = {
            "format": FORMAT, "step": learner.counter.step, "policy_version": learner.counter.policy_version,
            "kl_coef": learner.kl.coef, "reference_frozen": learner.kl_reference.frozen,
            "task_kl": learner.task_kl.state_dict(),
            "param_groups": groups, "config": learner.config.to_dict(),
            "python_rng": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
            "numpy_rng": [np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])],
            "extra": extra,
        }
        meta = {"format": "pt", "step": str(learner.counter.step), "policy_version": str(learner.counter.policy_version)}

        def write(tmp: Path) -> None:
            save_file(_weights(learner.model), str(tmp / "model.safetensors"), metadata=meta)
            save_file({**opt_tensors, **_rng_tensors()}, str(tmp / "optimizer.safetensors"))
            if learner.lora.active:
                save_file({k: v.contiguous() for k, v in learner.lora.adapters().items()},
                          str(tmp / "adapters.safetensors"))
            if learner.reference is not None:
                save_file(_weights(learner.reference), str(tmp / "reference.safetensors"))
            (tmp / "state.json").write_text(json.dumps(state))

        write_folder_atomically(folder, write)

    def load(self, folder: str | Path) -> dict:
        """Restore weights, optimizer, RNG and counters from a whole-model checkpoint `folder`;
        return its `extra` dict. (A DCP folder: Learner.load_checkpoint hands it to
        ShardedCheckpointIO, which reads it at any rank count.)"""
        learner, folder = self.learner, Path(folder)
        repair_interrupted_write(folder)
        if not (folder / "state.json").exists():
            raise LearnerError(f"{folder} is not a learner checkpoint (no state.json); pass a folder written "
                               "by Learner.save_checkpoint (export_hf folders hold weights only)")
        state = json.loads((folder / "state.json").read_text())
        if state.get("format") != FORMAT:
            raise LearnerError(f"{folder}: checkpoint format {state.get('format')!r} is not {FORMAT!r}")
        weights = load_file(str(folder / "model.safetensors"), device=str(learner.device))
        load_state_dict_checked(learner.model, weights, source=str(folder))
        if learner.lora.active:
            if not (folder / "adapters.safetensors").exists():
                raise LearnerError(f"{folder} has no adapters.safetensors but this learner trains LoRA adapters; "
                                   "resume without the lora option or from a checkpoint of a LoRA run")
            learner.lora.load_adapters(load_file(str(folder / "adapters.safetensors")), source=str(folder))
        if learner.reference is not None:
            if not (folder / "reference.safetensors").exists():
                raise LearnerError(f"{folder} has no reference.safetensors but this learner uses a KL "
                                   "reference; resume with reference_model=None or from a checkpoint of a "
                                   "run that had one")
            load_state_dict_checked(learner.reference, load_file(str(folder / "reference.safetensors"),
                                                                 device=str(learner.device)), source=str(folder))
        tensors = load_file(str(folder / "optimizer.safetensors"))
        opt_state: dict[int, dict] = {}
        for key, value in tensors.items():
            if key.startswith("state."):
                _, index, name = key.split(".", 2)
                opt_state.setdefault(int(index), {})[name] = value
        groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in state["param_groups"]]
        learner.optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
        torch.random.set_rng_state(tensors["rng.torch_cpu"])
        py = state["python_rng"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        kind, pos, has_gauss, gauss = state["numpy_rng"]
        np.random.set_state((kind, tensors["rng.numpy"].numpy().astype(np.uint32), pos, has_gauss, gauss))
        cuda = [tensors[k] for k in sorted(t for t in tensors if t.startswith("rng.cuda."))]
        if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        learner.counter.restore(int(state["step"]), int(state["policy_version"]))
        learner.kl.coef = float(state["kl_coef"])
        learner.task_kl.load_state_dict(state.get("task_kl"))   # absent: from before targets per task
        learner.kl_reference.frozen = bool(state.get("reference_frozen", True))
        return state["extra"]

    def export_hf(self, folder: str | Path) -> Path:
        """The policy as a Hugging Face folder (`transformers` loads it), written atomically by rank
        0; with LoRA, the merged weights (the base comes back bit for bit after) and the PEFT
        adapter in its ADAPTER_FOLDER subfolder."""
        learner = self.learner

        def write(tmp: Path) -> None:
            save_checkpoint(learner.model, learner.tokenizer, tmp, policy_version=learner.counter.policy_version)
            if learner.lora.active:
                learner.lora.write_peft(tmp / ADAPTER_FOLDER, base_model=learner.config.model)

        if learner.comm.rank == 0:
            with learner.lora.merged_into(learner.model):
                write_folder_atomically(Path(folder), write)
        return Path(folder)


def checkpoint_info(folder: str | Path) -> dict:
    """step and policy_version of a learner checkpoint, from its weights' metadata (cheap)."""
    repair_interrupted_write(folder)
    if not (Path(folder) / "model.safetensors").exists() and (Path(folder) / "state.json").exists():
        state = json.loads((Path(folder) / "state.json").read_text())     # a DCP checkpoint (sharded_state.py)
        return {"step": int(state.get("step", -1)), "policy_version": int(state.get("policy_version", -1))}
    with safe_open(str(Path(folder) / "model.safetensors"), "pt") as handle:
        meta = handle.metadata() or {}
    return {"step": int(meta.get("step", -1)), "policy_version": int(meta.get("policy_version", -1))}
