"""What each generator gets at a publish: the whole weights, or a patch on what it already holds.

    planner = SyncPlanner(mode="delta", lora=learner.lora)       # the learner actor's `weight_sync`
    plan = planner.prepare(learner.base_weights(), learner.policy_version)   # once per publish
    message = plan.message_for("gen0")                           # a WeightSync (`load_weights`)
    plan.sent("gen0", message)  /  planner.forget("gen0")        # after its reply / a failure
    plan.finish()                                                # the publish is over

Design note. A patch is only worth sending to a target that holds what it patches, and the
learner knows that from the target's own replies: `held[name]` is the version the target
confirmed from this learner, and is forgotten on any failure (a restarted target holds
nothing of ours). Modes (`weight_sync`): "full" sends the whole weights every time; "delta"
sends them whole to a target the learner has not synced (or that missed a version), and
after that only what changed: with LoRA the adapters (the first sync is the frozen base plus
the adapters, and the target merges), otherwise the elements that changed since the last
publish (actors/weights/patch.py). "auto" is "delta" under LoRA, else "full" (a delta keeps
one copy of the published weights on the learner). Every patch carries the digest of the
weights it must produce; a receiver that cannot produce them refuses it, and the caller sends
`full_message()` instead, so no generator runs on weights that differ from the learner's.
"""
from __future__ import annotations

from typing import Literal, get_args

import torch

from ..records import WeightPatch, WeightSync
from .patch import encode_delta
from .messages import weights_digest

WeightSyncMode = Literal["auto", "full", "delta"]   # the learner actor's `weight_sync` option
WEIGHT_SYNC_MODES: tuple[str, ...] = get_args(WeightSyncMode)


def tensor_bytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


class SyncPlanner:
    """The learner's memory of its targets across publishes.

    Invariants: `held[name]` is a version `name` confirmed; `published` is None or a copy of
    the weights of `published_version` (mode "delta" without LoRA only)."""

    def __init__(self, mode: str, lora, dtype: str | None = None):
        if mode not in WEIGHT_SYNC_MODES:
            raise ValueError(f"weight_sync must be one of {WEIGHT_SYNC_MODES}, got {mode!r}")
        self.lora = lora
        self.dtype = dtype                      # the rollout dtype weights travel in; None: the learner's
        self.mode = ("delta" if lora.active else "full") if mode == "auto" else mode
        self.held: dict[str, int] = {}
        self.published: dict[str, torch.Tensor] | None = None
        self.published_version: int | None = None

    def prepare(self, base: dict[str, torch.Tensor], version: int) -> "PublishPlan":
        """The plan of one publish of the model's own weights `base` (Learner.base_weights: {} on
        a sharded group's ranks other than 0) at policy version `version`."""
        return PublishPlan(self, base, version)

    def forget(self, name: str) -> None:
        """`name` holds nothing we know of (it failed): its next sync is whole."""
        self.held.pop(name, None)


class PublishPlan:
    """One publish: `weights` (the whole weights, merged under LoRA) at `version`; the messages
    are built once, on first use, and shared by every target. The model's weights are read
    once (`base`): a sharded learner gathers them then, on every rank (each rank prepares a
    plan; on ranks other than 0 it is empty and sends nothing)."""

    def __init__(self, planner: SyncPlanner, base: dict[str, torch.Tensor], version: int):
        self.planner = planner
        if planner.dtype is not None:
            base = {k: v.to(getattr(torch, planner.dtype)) for k, v in base.items()}
        self.base = base
        self.weights = planner.lora.merged(base) if base else {}
        self.version = version
        self._full: WeightSync | None = None
        self._patch: WeightSync | None = None
        self._digest: str | None = None
        self.num_changed: int | None = None     # delta: elements changed since the last publish

    @property
    def digest(self) -> str:
        if self._digest is None:
            self._digest = weights_digest(self.weights)
        return self._digest

    def full_message(self) -> WeightSync:
        """The whole weights; under LoRA with patches, the frozen base and the adapters."""
        if self._full is None:
            planner, lora = self.planner, self.planner.lora
            if planner.mode == "delta" and lora.active:
                base = self.base
                patch = WeightPatch("lora", self.digest, lora_scale=lora.config.scale, dtype=planner.dtype)
                self._full = WeightSync(self.version, {**base, **lora.adapters()}, patch=patch)
            else:
                self._full = WeightSync(self.version, self.weights)
        return self._full

    def message_for(self, name: str) -> WeightSync:
        """A patch when `name` holds what it patches, else the whole weights."""
        planner = self.planner
        held = planner.held.get(name)
        if planner.mode != "delta" or held is None:
            return self.full_message()
        if planner.lora.active:
            if self._patch is None:
                patch = WeightPatch("lora", self.digest, base_version=held, lora_scale=planner.lora.config.scale,
                                    dtype=planner.dtype)
                self._patch = WeightSync(self.version, planner.lora.adapters(), patch=patch)
            return self._patch
        if held != planner.published_version or planner.published is None:
            return self.full_message()                 # it missed a version
        if self._patch is None:
            encoded, self.num_changed = encode_delta(planner.published, self.weights)
            patch = WeightPatch("delta", self.digest, base_version=planner.published_version, dtype=planner.dtype)
            self._patch = WeightSync(self.version, encoded, patch=patch)
        return self._patch

    def sent(self, name: str, message: WeightSync) -> int:
        """`name` confirmed `message`: remember its version; returns the message's tensor bytes."""
        self.planner.held[name] = self.version
        return tensor_bytes(message.weights)

    def finish(self) -> None:
        """The publish is over: a delta planner keeps a copy of what it published."""
        planner = self.planner
        if planner.mode == "delta" and not planner.lora.active and planner.published_version != self.version:
            planner.published = {k: v.detach().clone() for k, v in self.weights.items()}
            planner.published_version = self.version

    @staticmethod
    def is_patch(message: WeightSync) -> bool:
        return message.patch is not None and message.patch.base_version is not None
