"""Hugging Face export one unit at a time: from a sharded (FSDP) learner, or from a checkpoint.

    export_sharded(model, lora, tokenizer, version, comm, "runs/x/hf")   # every rank of the group
    export_checkpoint("runs/x/checkpoint", "runs/x/hf")        # offline, one process: `postrain export`
    export_peft_checkpoint("runs/x/checkpoint", "runs/x/peft")  # its LoRA adapter: `postrain export --peft`

Both exports write the folder `transformers` and postrain load: config.json, the tokenizer, and
the weights as safetensors (model.safetensors, or several files and model.safetensors.index.json
above `max_shard_bytes`; safetensors_stream.py), atomically (core/atomic_write.py); a LoRA
policy's holds the merged weights and its PEFT adapter in the subfolder `adapter/` (lora.py).

Design note. A unit is one decoder layer (`model.layers.<i>.*`, one FSDP unit) or the rest
(embeddings, final norm, untied LM head). The layout (every tensor's name, dtype and global
shape, after LoRA's merge, which keeps shapes, and the architecture's `state_to_hf`, run on
meta tensors) is known before any value, so each file's header is written first and each
unit is appended as soon as it is whole: a sharded learner's ranks gather a unit's tensors
(a collective per tensor, in the same order on every rank), rank 0 merges LoRA's adapters
into them, converts and writes them, and drops them before the next unit; the other ranks
drop each gathered tensor at once. An offline export reads each unit's tensors from the
checkpoint's files: DCP reads the byte ranges it needs, safetensors maps the file. Invariant: rank 0 (or the offline process) holds
at most one unit's whole tensors beyond its shards, never the whole model.
"""
from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from postrain.core.atomic_write import repair_interrupted_write, write_folder_atomically
from ..models import model_class
from ..models.hf_config import config_to_hf
from ..weights.patch import merge_lora
from . import fsdp
from .batch import LearnerError
from .lora import ADAPTER_FOLDER, lora_config, write_peft_adapter
from .safetensors_stream import DTYPE_NAMES, Layout, StreamedSafetensors

if TYPE_CHECKING:
    from ..models.llama import LlamaModel
    from .collectives import Collectives
    from .lora import LearnerLora

MAX_SHARD_BYTES = 5 * 2**30          # transformers' default shard size
_LAYER = re.compile(r"(model\.layers\.\d+)\.")


def unit_of(name: str) -> str:
    """`model.layers.<i>` for a decoder layer's tensor, "" for the rest."""
    match = _LAYER.match(name)
    return match.group(1) if match else ""


def units(names: list[str]) -> list[list[str]]:
    """`names` grouped by unit, units in order of first appearance, names in order within each."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(unit_of(name), []).append(name)
    return list(groups.values())


def hf_layout(cls, groups: list[list[str]], shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> Layout:
    """The written layout: each unit's tensors through the architecture's `state_to_hf` (on meta
    tensors: no memory), units in order."""
    layout: Layout = {}
    for group in groups:
        meta = {n: torch.empty(shapes[n][1], dtype=shapes[n][0], device="meta") for n in group}
        for name, value in _to_hf(cls, meta).items():
            layout[name] = (value.dtype, tuple(value.shape))
    return layout


def _to_hf(cls, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return cls.state_to_hf(tensors) if hasattr(cls, "state_to_hf") else tensors


def write_model_files(folder: Path, config, tokenizer) -> None:
    """config.json (bos/eos from the tokenizer where the config has none) and the tokenizer, as
    models.loading.save_checkpoint writes them."""
    config = dataclasses.replace(config)
    if config.bos_token_id is None:
        config.bos_token_id = tokenizer.bos_token_id
    if config.eos_token_id is None:
        config.eos_token_id = tokenizer.eos_token_id
    (folder / "config.json").write_text(json.dumps(config_to_hf(config), indent=2))
    tokenizer.save(folder)


# ----------------------------------------------------------------------------- a sharded learner


def export_sharded(model: LlamaModel, lora: LearnerLora, tokenizer, policy_version: int, comm: Collectives,
                   folder: str | Path, max_shard_bytes: int = MAX_SHARD_BYTES,
                   base_model: str | dict | None = None) -> Path:
    """Every rank of a sharded learner's group: the policy `model` (FSDP2 shards; `lora`'s
    adapters merged, and written as a PEFT adapter over `base_model`, the learner's model spec)
    as a Hugging Face folder written by rank 0 unit by unit (module docstring); every rank
    returns once it is in place."""
    import torch.distributed as dist

    folder, keep = Path(folder), comm.rank == 0
    fsdp.reshard(model)
    state = model.state_dict()                  # DTensors: this rank's shards, global shapes
    tied = model.config.tie_word_embeddings
    groups = units([k for k in state if not (tied and k == "lm_head.weight")])
    cls = type(model)

    def unit_tensors(group: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        with torch.no_grad():
            for name in group:
                whole = fsdp.full_tensor(state[name].detach())     # a collective: every rank, same order
                if keep:
                    adapted = name.removesuffix(".weight")
                    if name.endswith(".weight") and adapted in lora.modules:
                        assert lora.config is not None, "adapted modules exist only with a LoRA config"
                        whole = merge_lora(whole, lora.lora_A[adapted], lora.lora_B[adapted], lora.config.scale)
                    out[name] = whole.to("cpu")    # a gathered tensor is this rank's own: no copy
                del whole
        return _to_hf(cls, out) if keep else out

    if not keep:
        for group in groups:
            unit_tensors(group)
        dist.barrier(group=comm.group)          # rank 0 has put the folder in place
        return folder
    shapes = {n: (state[n].dtype, tuple(state[n].shape)) for group in groups for n in group}
    layout = hf_layout(cls, groups, shapes)
    metadata = {"format": "pt", "policy_version": str(policy_version)}

    def write(tmp: Path) -> None:
        write_model_files(tmp, model.config, tokenizer)
        with StreamedSafetensors(tmp, layout, metadata, max_shard_bytes) as out:
            for group in groups:
                out.write(unit_tensors(group))
        if lora.active:
            lora.write_peft(tmp / ADAPTER_FOLDER, base_model)

    write_folder_atomically(folder, write)
    comm.barrier()
    return folder


# ----------------------------------------------------------------------------- a checkpoint


def export_checkpoint(checkpoint: str | Path, folder: str | Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """The policy of a learner checkpoint (LoRA merged, its adapter in ADAPTER_FOLDER) as a
    Hugging Face folder, read and written one unit at a time in this process (no group): a
    sharded learner's (DCP, sharded_state.py) or a whole one's (model.safetensors, state.py),
    each read a tensor at a time."""
    state, source = open_checkpoint(checkpoint)
    shapes = source.shapes
    config, tokenizer = model_shell(state["config"]["model"], tied="lm_head.weight" not in shapes)
    cls = model_class(config.architecture)
    lora = lora_config(state["config"].get("lora"))
    adapters = source.adapters() if lora else {}
    groups = units(list(shapes))
    layout = hf_layout(cls, groups, shapes)
    metadata = {"format": "pt", "policy_version": str(state.get("policy_version", -1))}

    def unit_tensors(group: list[str]) -> dict[str, torch.Tensor]:
        out = source.read(group)
        for name in group:
            adapter = adapters.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
            if adapter is not None:
                assert lora is not None, "adapters are read only with a LoRA config"
                out[name] = merge_lora(out[name], *adapter, lora.scale)
        return _to_hf(cls, out)

    def write(tmp: Path) -> None:
        write_model_files(tmp, config, tokenizer)
        with StreamedSafetensors(tmp, layout, metadata, max_shard_bytes) as out:
            for group in groups:
                out.write(unit_tensors(group))
        if lora:
            write_peft_adapter(tmp / ADAPTER_FOLDER, lora, adapters, state["config"]["model"])

    return write_folder_atomically(Path(folder), write)


def export_peft_checkpoint(checkpoint: str | Path, folder: str | Path) -> Path:
    """The LoRA adapters of a learner checkpoint as a PEFT adapter folder (lora.write_peft_adapter),
    written atomically; LearnerError when the checkpoint's learner trained no adapters."""
    state, source = open_checkpoint(checkpoint)
    lora = lora_config(state["config"].get("lora"))
    if lora is None:
        raise LearnerError(f"{checkpoint} holds no LoRA adapters (its learner had no lora option); "
                           "export its whole policy without --peft")
    adapters = source.adapters()
    return write_folder_atomically(Path(folder), lambda tmp: write_peft_adapter(
        tmp, lora, adapters, state["config"]["model"]))


def open_checkpoint(checkpoint: str | Path) -> tuple[dict, _DcpSource | _SafetensorsSource]:
    """(state.json's dict, a reader of the tensors) of a learner checkpoint, sharded or whole;
    LearnerError when `checkpoint` is none or of an unknown format."""
    from .checkpoint_io import SHARDED_FORMAT as SHARDED
    from .checkpoint_io import WHOLE_FORMAT as WHOLE

    checkpoint = Path(checkpoint)
    repair_interrupted_write(checkpoint)
    state_path = checkpoint / "state.json"
    if not state_path.exists():
        missing = "no state.json" if checkpoint.is_dir() else "no such folder"
        raise LearnerError(f"{checkpoint} is not a learner checkpoint ({missing}); pass a folder a learner's "
                           "save_checkpoint wrote (a run's is RUN_FOLDER/checkpoint)")
    state = json.loads(state_path.read_text())
    if state.get("format") not in (SHARDED, WHOLE):
        raise LearnerError(f"{checkpoint}: checkpoint format {state.get('format')!r} is neither the sharded "
                           f"learner's {SHARDED!r} nor the whole learner's {WHOLE!r}; export it with the "
                           "postrain version that wrote it")
    return state, (_DcpSource if state["format"] == SHARDED else _SafetensorsSource)(checkpoint)


class _DcpSource:
    """A sharded checkpoint's tensors (dcp/): DCP reads the byte ranges each asked tensor needs."""

    def __init__(self, checkpoint: Path):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.dir = checkpoint / "dcp"
        self.saved = {key: (meta.properties.dtype, tuple(meta.size)) for key, meta in
                      FileSystemReader(str(self.dir)).read_metadata().state_dict_metadata.items()
                      if isinstance(meta, TensorStorageMetadata)}   # bytes entries have no properties
        self.shapes = {key[len("model."):]: v for key, v in self.saved.items() if key.startswith("model.")}

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        loaded = self._load({f"model.{n}": self.shapes[n] for n in names})
        return {n: loaded[f"model.{n}"] for n in names}

    def adapters(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{adapted module: (lora_A, lora_B)}."""
        loaded = self._load({k: v for k, v in self.saved.items() if k.startswith("adapters.")})
        return {key[len("adapters."):-len(".lora_A")]: (value, loaded[key[:-1] + "B"])
                for key, value in loaded.items() if key.endswith(".lora_A")}

    def _load(self, wanted: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp

        tensors = {key: torch.empty(shape, dtype=dtype) for key, (dtype, shape) in wanted.items()}
        if tensors:
            with warnings.catch_warnings():      # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(tensors, checkpoint_id=self.dir, no_dist=True)
        return tensors


class _SafetensorsSource:
    """A whole learner's checkpoint (model.safetensors, adapters.safetensors), a tensor at a time."""

    def __init__(self, checkpoint: Path):
        from safetensors import safe_open

        self.checkpoint = checkpoint
        self.file = safe_open(str(checkpoint / "model.safetensors"), "pt")
        self.shapes = {}
        for name in self.file.keys():
            meta = self.file.get_slice(name)
            self.shapes[name] = (_SAFETENSORS_DTYPES[meta.get_dtype()], tuple(meta.get_shape()))

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        return {n: self.file.get_tensor(n) for n in names}

    def adapters(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        from safetensors.torch import load_file

        saved = load_file(str(self.checkpoint / "adapters.safetensors"))   # {"<module>.weight.lora_A": ...}
        return {key[:-len(".weight.lora_A")]: (value, saved[key[:-1] + "B"])
                for key, value in saved.items() if key.endswith(".lora_A")}


_SAFETENSORS_DTYPES = {code: dtype for dtype, code in DTYPE_NAMES.items()}


def model_shell(spec: str | dict, tied: bool):
    """(ModelConfig, tokenizer) of a learner's model spec, without its weights (the checkpoint
    has them): a dict of ModelConfig fields or a built-in name (the byte tokenizer), a Hugging
    Face folder (its config.json and tokenizer) or a .gguf file (its metadata)."""
    from ..models.config import BUILTIN_CONFIGS, ModelConfig
    from ..models.hf_config import config_from_hf
    from ..models.loading import resolve_model
    from ..models.tokenizer import Tokenizer, byte_tokenizer

    if isinstance(spec, dict):
        config, tokenizer = ModelConfig(**spec), byte_tokenizer()
    else:
        path = Path(resolve_model(spec))
        if str(spec) in BUILTIN_CONFIGS and not path.exists():
            config, tokenizer = dataclasses.replace(BUILTIN_CONFIGS[str(spec)]), byte_tokenizer()
        elif path.is_dir() and (path / "tokenizer.json").exists():
            hf = json.loads((path / "config.json").read_text())
            config = config_from_hf(hf)
            tokenizer = Tokenizer.from_folder(path, hf)
        elif path.is_file() and path.suffix == ".gguf":
            from ..models.gguf import GGUFFile, gguf_tokenizer, hf_config_from_gguf
            reader = GGUFFile(path)
            config, tokenizer = config_from_hf(hf_config_from_gguf(reader, path)), gguf_tokenizer(reader, path)
        elif path.is_dir() and (path / "config.json").exists():   # no tokenizer.json: the byte one
            config = config_from_hf(json.loads((path / "config.json").read_text()))
            if config.vocab_size != BUILTIN_CONFIGS["tiny"].vocab_size:
                raise LearnerError(f"{path} has no tokenizer.json; copy the model's tokenizer.json into it")
            tokenizer = byte_tokenizer()
        else:
            raise LearnerError(f"the checkpoint's model {spec!r} is not here (not a built-in name, a folder or "
                               "a .gguf file); export where the run's model is, or pass its folder")
    config.tie_word_embeddings = tied
    return config, tokenizer
