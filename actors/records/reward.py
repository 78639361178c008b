"""Reward: an episode's named reward components and their weights, as environments return them.

    Reward({"correct": 1.0, "format": 0.5}, weights={"format": 0.2}).total   # 1.1

A value that is not a finite float under a str name raises EnvironmentContractError (the
episode's rollout is dropped with the reason, actors/env/episode.py). The error lives here, with
the record an environment hands back, so that records depend on no role; the Environment API
(actors/env/api.py) exports it, and `EnvironmentFailure` (an environment that raised or hung; a
judge that gave no verdict, actors/scorer/judge.py, which the Environment API imports in turn).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from postrain.core.errors import PostrainError


class EnvironmentContractError(PostrainError, ValueError):
    """An environment returned something the API does not allow (actors/env/api.py's docstring)."""


class EnvironmentFailure(PostrainError, RuntimeError):
    """An environment raised or hung; `reason` is the short text the ledger records (its first
    line: actors/env/user_errors.py). Raised `from` the user's exception, it carries their
    traceback."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclasses.dataclass
class Reward:
    """Named reward components, each a finite float, and optional weights (default 1.0 each).

    `total` = sum(weights.get(name, 1.0) * value). The learner receives `components` and
    `weights` separately so that it can log each component and reweight them per task.
    """

    components: dict[str, float] = dataclasses.field(default_factory=dict)
    weights: dict[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for field in ("components", "weights"):
            value = getattr(self, field)
            if not isinstance(value, dict):
                raise EnvironmentContractError(
                    f"Reward.{field} must be a dict of name -> float, got {type(value).__name__}; "
                    f"fix: Reward({{'correct': 1.0}})")
            clean = {}
            for name, x in value.items():
                if not isinstance(name, str) or isinstance(x, bool) or not isinstance(x, (int, float)) \
                        or not math.isfinite(x):
                    raise EnvironmentContractError(
                        f"Reward.{field}[{name!r}] must be a str name with a finite float, got "
                        f"{x!r}; fix: use finite numbers such as 0.0 or 1.0")
                clean[name] = float(x)
            setattr(self, field, clean)

    @property
    def total(self) -> float:
        return sum(self.weights.get(name, 1.0) * x for name, x in self.components.items())

    def to_dict(self) -> dict[str, dict[str, float]]:
        """Plain data for the wire (msgpack) and the run's logs."""
        return {"components": dict(self.components), "weights": dict(self.weights)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Reward":
        return cls(dict(data.get("components") or {}), dict(data.get("weights") or {}))
