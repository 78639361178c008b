"""LoRA on the learner: low-rank adapters over a frozen policy, merged weights, PEFT export.

    learner = Learner(LearnerConfig(model="tiny", lora={"rank": 16, "alpha": 32}))   # all linear layers
    learner.lora.adapters()                 # {"<hf weight name>.lora_A": (rank, in), ".lora_B": (out, rank)}
    learner.state_dict()                    # merged: base + alpha / rank * B @ A (what generators run)
    learner.lora.export_peft("runs/x/adapter", base_model_name_or_path="runs/x/base")   # peft loads it
    learner.export_hf("runs/x/policy")      # merged weights, and the PEFT adapter in policy/adapter/

Design note. The adapters live beside the model, not in it: each targeted nn.Linear gets a
forward hook that adds scale * B(A(x)) to its output (PEFT's formula, scale = alpha / rank),
so the model's state dict keeps its Hugging Face names and holds the base weights (with `exact`,
the hook returns the layer multiplied by `merge_lora`'s merged weight instead, computed with
gradients: the product the generators run, bit for bit; the base product is computed and dropped): checkpoints
store it unchanged plus `adapters.safetensors`, and a publish sends the merged weights
(`merge_lora`, actors/weights/patch.py, the same function the generators run). Every base
parameter is frozen (requires_grad False): no gradients, no optimizer state; only the adapters
are in `Learner.params`, so data parallel all-reduces only them. A starts kaiming-uniform and B
at zero (PEFT's init), so the initial policy is the base; the init is seeded from the
learner's seed, and rank 0 broadcasts them with the weights when a group forms.
Invariant: `active` == bool(modules); the base weights never change while active
(tests/actors/learner/test_lora.py).

Several adapters on one base (the Tinker server's tenants, actors/tinker/tenants.py): each
`LearnerLora` adds its hooks to the shared model, and only the adapters whose `enabled` is True
add their term; `detach()` removes a tenant's hooks for good. A learner's own adapters stay
enabled. Several adapters can also share one forward, each on its own rows of the batch
(`batched_adapters`: inside it each adapter's hooks add their term only to its rows, dim 0 of
every layer's input, with an in-place `index_add_`, so each adapter's gradient comes from its
rows alone). Each hook handles its own rows with its own A and B, so adapters of different ranks
and different targets share a forward as well (a layer an adapter does not target leaves its rows
as the base computes them): the shared part is the base's matmuls, and each adapter's low-rank
products cost what they cost alone. Outside the block the hooks are unchanged, bit for bit
(`rows` is None: every row).

Outputs: a LoRA policy's Hugging Face export (`export_hf`, the run's `policy/`, `postrain export`)
holds the merged weights and, in its ADAPTER_FOLDER subfolder, the PEFT adapter folder
(`write_peft_adapter`); `postrain export --peft` writes that adapter folder from a checkpoint.
"""
from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from postrain.core.atomic_write import write_folder_atomically
from ..models.exact import ExactLinear, exact_linear
from ..weights.patch import merge_lora
from .batch import LearnerError

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_FOLDER = "adapter"   # a LoRA policy's Hugging Face export holds its PEFT adapter in this subfolder


@dataclass(frozen=True)
class LoraConfig:
    """The learner's `lora` option: rank (>= 1), alpha (the scale is alpha / rank) and targets (the
    last part of the linear layers' names; default: every projection of attention and MLP)."""

    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = ALL_LINEAR

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def lora_config(value: dict | LoraConfig | None) -> LoraConfig | None:
    """The LoraConfig an option value describes (None: no LoRA); LearnerError naming a bad field."""
    if value is None or isinstance(value, LoraConfig):
        return value
    if not isinstance(value, dict):
        raise LearnerError(f"lora must be a table like {{rank = 16, alpha = 32}}, got {value!r}")
    unknown = sorted(set(value) - {"rank", "alpha", "targets"})
    if unknown:
        raise LearnerError(f"unknown lora option(s) {unknown}; known: ['alpha', 'rank', 'targets']")
    rank, alpha = value.get("rank", 16), value.get("alpha", 32.0)
    targets = value.get("targets", ALL_LINEAR)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LearnerError(f"lora.rank must be an integer >= 1, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
        raise LearnerError(f"lora.alpha must be a number > 0, got {alpha!r}")
    if isinstance(targets, str) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise LearnerError(f"lora.targets must be a non-empty list of layer names such as {list(ALL_LINEAR)}, "
                           f"got {targets!r}")
    if "lm_head" in targets:
        raise LearnerError("lora.targets must not name lm_head (the logprob head reads its weight directly); "
                           f"choose among {list(ALL_LINEAR)}")
    return LoraConfig(rank=rank, alpha=float(alpha), targets=tuple(targets))


class LearnerLora:
    """The adapters of one policy (inactive when config is None: a no-op with the same API).

    modules: {hf prefix (e.g. "model.layers.0.self_attn.q_proj"): its nn.Linear};
    lora_A[prefix] (rank, in) and lora_B[prefix] (out, rank): float32 parameters."""

    def __init__(self, model: nn.Module, config: dict | LoraConfig | None, seed: int = 0):
        self.config = lora_config(config)
        self.modules: dict[str, nn.Linear] = {}
        self.lora_A: dict[str, nn.Parameter] = {}
        self.lora_B: dict[str, nn.Parameter] = {}
        self.enabled = True      # the hooks add scale * B(A(x)) only while True (several adapters on one base)
        self.rows: torch.Tensor | None = None   # inside batched_adapters: the batch rows it adds to; None: all
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        if self.config is None:
            return
        linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and name != "lm_head"}
        self.modules = {name: m for name, m in linears.items() if name.rsplit(".", 1)[-1] in self.config.targets}
        if not self.modules:
            known = sorted({name.rsplit(".", 1)[-1] for name in linears})
            raise LearnerError(f"lora.targets {list(self.config.targets)} match no linear layer of this model; "
                               f"its layers: {known}")
        for p in model.parameters():
            p.requires_grad_(False)
        generator = torch.Generator().manual_seed(seed)
        for name, module in self.modules.items():
            a = torch.empty(self.config.rank, module.in_features)
            bound = 1 / math.sqrt(module.in_features)        # kaiming_uniform(a=sqrt(5)), as nn.Linear and PEFT
            a.uniform_(-bound, bound, generator=generator)
            device = module.weight.device
            self.lora_A[name] = nn.Parameter(a.to(device))
            self.lora_B[name] = nn.Parameter(torch.zeros(module.out_features, self.config.rank, device=device))
            self._handles.append(module.register_forward_hook(self._hook(name)))

    @property
    def active(self) -> bool:
        return bool(self.modules)

    def _hook(self, name: str):
        assert self.config is not None, "hooks are registered only with a LoRA config"
        scale = self.config.scale

        def add_adapter(module, args, output):
            if not self.enabled:
                return output
            x, rows = args[0], self.rows
            if rows is not None:                  # batched_adapters: this adapter's rows only
                x = x.index_select(0, rows)
            if isinstance(module, ExactLinear):   # exact: the generator's merged weight, bit for bit
                delta = (self.lora_B[name].float() @ self.lora_A[name].float()) * scale   # merge_lora's ops
                merged = exact_linear(x, (module.weight.float() + delta).to(module.weight.dtype), module.bias)
                return merged if rows is None else output.index_copy(0, rows, merged)
            low = F.linear(F.linear(x.to(self.lora_A[name].dtype), self.lora_A[name]), self.lora_B[name])
            if rows is None:
                return output + (low * scale).to(output.dtype)              # (..., out)
            # in place: the layer's output is no op's saved input, and a copy per adapter would
            # cost each adapter the whole batch's output
            return output.index_add_(0, rows, (low * scale).to(output.dtype))
        return add_adapter

    def detach(self) -> None:
        """Remove these adapters' hooks from the model for good (a tenant leaving a shared base)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.enabled = False

    def trainable(self, model: nn.Module) -> list[nn.Parameter]:
        """The parameters the optimizer steps: the adapters when active, else the model's."""
        if self.active:
            return self.parameters()
        return [p for p in model.parameters() if p.requires_grad]

    def parameters(self) -> list[nn.Parameter]:
        """The adapters' parameters (none when inactive); rank 0 broadcasts them with the model's."""
        return [p for name in self.modules for p in (self.lora_A[name], self.lora_B[name])]

    def adapters(self) -> dict[str, torch.Tensor]:
        """{"<prefix>.weight.lora_A": (rank, in), "<prefix>.weight.lora_B": (out, rank)}, CPU, detached."""
        out = {}
        for name in self.modules:
            out[f"{name}.weight.lora_A"] = self.lora_A[name].detach().to("cpu")
            out[f"{name}.weight.lora_B"] = self.lora_B[name].detach().to("cpu")
        return out

    def load_adapters(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        """Copy `adapters()`-shaped tensors in; LearnerError naming a missing or misshapen one."""
        mine = {f"{name}.weight.lora_{ab}": p for name in self.modules
                for ab, p in (("A", self.lora_A[name]), ("B", self.lora_B[name]))}
        for key, p in mine.items():
            if key not in tensors or tuple(tensors[key].shape) != tuple(p.shape):
                raise LearnerError(f"{source}: adapter {key} is missing or misshapen (want {tuple(p.shape)}); "
                                   "resume with the lora options the checkpoint was written with")
        with torch.no_grad():
            for key, p in mine.items():
                p.copy_(tensors[key].to(p.device))

    def merged(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` (the model's base weights by HF name) with every adapted weight merged (new
        tensors); `state` itself when inactive."""
        if not self.active:
            return state
        assert self.config is not None, "adapted modules exist only with a LoRA config"
        out = dict(state)
        for name in self.modules:
            key = f"{name}.weight"
            out[key] = merge_lora(state[key], self.lora_A[name], self.lora_B[name], self.config.scale)
        return out

    @contextlib.contextmanager
    def merged_into(self, model: nn.Module):
        """The model holds the merged weights inside the block (an export writes them); its base
        weights come back bit for bit after (saved copies, not a subtraction)."""
        saved = {name: m.weight.detach().clone() for name, m in self.modules.items()}
        try:
            with torch.no_grad():
                for name, m in self.modules.items():
                    assert self.config is not None, "adapted modules exist only with a LoRA config"
                    m.weight.copy_(merge_lora(saved[name], self.lora_A[name], self.lora_B[name], self.config.scale))
            yield model
        finally:
            with torch.no_grad():
                for name, m in self.modules.items():
                    m.weight.copy_(saved[name])

    def write_peft(self, folder: Path, base_model: str | dict | None) -> Path:
        """The adapters as a PEFT adapter folder written in place (write_peft_adapter)."""
        assert self.config is not None, "write_peft is called while active (with a LoRA config)"
        pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {
            name: (self.lora_A[name], self.lora_B[name]) for name in self.modules}
        return write_peft_adapter(folder, self.config, pairs, base_model)

    def export_peft(self, folder: str | Path, base_model_name_or_path: str | None = None) -> Path:
        """A PEFT adapter folder (adapter_config.json, adapter_model.safetensors), written
        atomically, that `peft.PeftModel.from_pretrained(base, folder)` loads over the base model."""
        if not self.active:
            raise LearnerError("export_peft needs a learner with the lora option set")
        return write_folder_atomically(Path(folder), lambda tmp: self.write_peft(tmp, base_model_name_or_path))


@contextlib.contextmanager
def batched_adapters(assignments: Sequence[tuple[LearnerLora, torch.Tensor | Sequence[int]]]):
    """Several adapters of one base in one forward (module docstring): inside the block each
    adapter of `assignments` is enabled and adds its term only to its rows (indices into dim 0 of
    the batch, disjoint between adapters; rows no adapter names get the base alone). After it each
    adapter's `enabled` and `rows` are as before. Run the backward inside the block too where the
    model recomputes its forward (activation checkpointing). ValueError for an adapter named twice
    or rows that overlap."""
    loras = [lora for lora, _ in assignments]
    if len({id(lora) for lora in loras}) != len(loras):
        raise ValueError("batched_adapters: an adapter is named twice; give each adapter all its rows at once")
    indices = [torch.as_tensor(rows, dtype=torch.long).flatten() for _, rows in assignments]
    every = torch.cat(indices) if indices else torch.zeros(0, dtype=torch.long)
    if every.numel() != every.unique().numel():
        raise ValueError("batched_adapters: the adapters' rows overlap; each row takes one adapter")
    saved = [(lora, lora.enabled, lora.rows) for lora in loras]
    try:
        for lora, rows in zip(loras, indices):
            params = lora.parameters()
            lora.rows = rows.to(params[0].device) if params else rows
            lora.enabled = True
        yield
    finally:
        for lora, enabled, previous in saved:
            lora.enabled, lora.rows = enabled, previous


def write_peft_adapter(folder: Path, config: LoraConfig, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]],
                       base_model: str | dict | None) -> Path:
    """Write the PEFT adapter folder `folder` (created): adapter_config.json and
    adapter_model.safetensors, which `peft.PeftModel.from_pretrained(base, folder)` loads.

    adapters: {module name (e.g. "model.layers.0.self_attn.q_proj"): (lora_A (rank, in), lora_B (out, rank))}.
    base_model: the learner's model spec, recorded as base_model_name_or_path when it is a name or a
    path (a dict of config fields names no model to load: null)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    settings = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.rank, "lora_alpha": config.alpha,
                "target_modules": sorted({n.rsplit(".", 1)[-1] for n in adapters}), "lora_dropout": 0.0,
                "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False,
                "use_dora": False, "init_lora_weights": True, "modules_to_save": None,
                "base_model_name_or_path": base_model if isinstance(base_model, str) else None}
    (folder / "adapter_config.json").write_text(json.dumps(settings, indent=2))
    tensors = {}
    for name, (lora_a, lora_b) in adapters.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = lora_a.detach().to("cpu").contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = lora_b.detach().to("cpu").contiguous()
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    return folder
