"""The config of `postrain up`: the kernel's RunConfig plus the head's own sections.

    [balancer]                     # optional; see BalancerSection
    max_workers = 4

    [tracking]                     # optional; see cli/tracking.py
    backends = ["mlflow"]

`load_up_config` is what `postrain up` (and `--dry-run`) runs: the file is
validated, then every actor's options against its class's model with
`[shared]` filled in (postrain.core.options), so any bad field of any actor
is named before a process starts.
"""
from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from postrain.core.config import RunConfig, load_config, parse_config
from postrain.core.options import resolve_options

from .tracking import TrackingSection


class BalancerSection(BaseModel):
    """The head's balancer (cli/balancer.py): the workers of every pool actor (one whose load
    reports `workers`) follow its queue; each change of an actor's backpressure is logged."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    enabled: bool = Field(True, description="run the balancer on the head")
    interval_s: float = Field(1.0, gt=0, description="how often it reads the loads and decides")
    grow_when_queued: int = Field(2, ge=1, description="pieces of work waiting at a pool actor (its "
                                  "load's `queued`) that count as a backlog")
    grow_after_ticks: int = Field(2, ge=1, description="consecutive ticks of backlog before a worker is "
                                  "added")
    shrink_after_idle_s: float = Field(30.0, gt=0, description="seconds with nothing queued and a worker "
                                       "spare before a worker is removed")
    min_workers: int = Field(1, ge=1, description="never fewer workers per pool actor")
    max_workers: int = Field(8, ge=1, description="never more workers per pool actor")
    worker_cpus: float = Field(0.1, gt=0, le=1, description="cores reserved per worker beyond the ones "
                               "a pool actor started with (its spec's cpus cover those)")

    @model_validator(mode="after")
    def _check_bounds(self):
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers ({self.min_workers}) must be <= max_workers ({self.max_workers})")
        return self



class UpConfig(RunConfig):
    balancer: BalancerSection = Field(default_factory=BalancerSection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)


def load_up_config(path: str | Path) -> UpConfig:
    """The run config at `path`, every actor's options checked; ConfigError naming each bad field."""
    config = load_config(path, UpConfig)
    resolve_options(config)
    return config


def parse_up_config(data: dict, source: str = "<config>") -> UpConfig:
    """`load_up_config` for a parsed TOML document."""
    config = parse_config(data, source, UpConfig)
    resolve_options(config)
    return config
