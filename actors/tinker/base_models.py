"""The base models a Tinker server holds: one frozen copy each, shared by every tenant on it.

    bases = BaseModels.load(["tiny", "SmolLM2=smollm2"], seed=0)   # NAME=SPEC, or a spec named by itself
    held = bases.get("tiny")                   # TinkerAPIError 400 naming the models held otherwise
    held.model, held.tokenizer, held.max_context_tokens
    bases.capabilities()                       # get_server_capabilities' supported_models

A spec is what `postrain serve --model` takes (a built-in name, a Hugging Face folder, a .gguf
file, a packaged model such as `smollm2`); the name is what the SDK sends as `base_model`. The
base's parameters are frozen (`requires_grad` False): tenants train LoRA adapters beside them
(tenants.py) and never write them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from ..models.llama import LlamaModel
from ..models.loading import build_policy, check_model_spec
from ..models.tokenizer import Tokenizer
from .errors import TinkerAPIError


@dataclass
class HeldModel:
    """One base model: its name, spec, frozen model and tokenizer."""

    name: str
    spec: str
    model: LlamaModel
    tokenizer: Tokenizer
    seed: int

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def max_context_tokens(self) -> int:
        return int(self.model.config.max_position_embeddings)

    @property
    def architecture(self) -> str:
        return str(getattr(self.model.config, "architecture", type(self.model).__name__))


def parse_model_arg(arg: str) -> tuple[str, str]:
    """(name, spec) of `NAME=SPEC` or of a bare spec (its own name)."""
    name, equals, spec = arg.partition("=")
    if not equals:
        return arg, arg
    if not name or not spec:
        raise TinkerAPIError(400, f"a model is NAME=SPEC or SPEC, got {arg!r}; e.g. HuggingFaceTB/SmolLM2-135M=smollm2")
    return name, spec


class BaseModels:
    """The held models by name (module docstring)."""

    def __init__(self, held: list[HeldModel]):
        self._held = {h.name: h for h in held}

    @classmethod
    def load(cls, args: list[str], seed: int = 0, device: str = "cpu") -> BaseModels:
        held = []
        for arg in args:
            name, spec = parse_model_arg(arg)
            check_model_spec(spec)
            model, tokenizer = build_policy(spec, seed, torch.float32, device)
            model.eval()
            for p in model.parameters():
                p.requires_grad_(False)
            held.append(HeldModel(name, spec, cast(LlamaModel, model), tokenizer, seed))
        return cls(held)

    @property
    def names(self) -> list[str]:
        return list(self._held)

    def get(self, name: str | None) -> HeldModel:
        held = self._held.get(name or "")
        if held is None:
            raise TinkerAPIError(400, f"base_model {name!r} is not held by this server; it holds {self.names} "
                                      "(get_server_capabilities lists them); start it with --model NAME=SPEC")
        return held

    def capabilities(self) -> list[dict]:
        return [{"model_name": h.name, "max_context_length": h.max_context_tokens, "trainable": True,
                 "sampleable": True} for h in self._held.values()]
