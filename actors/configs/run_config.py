"""The run config file as `postrain up` reads it, and the built-in run's file.

    [balancer]                     # optional; see BalancerSection (the head's balancer)
    max_workers = 4

    [tracking]                     # optional; see TrackingSection (the head's trackers)
    backends = ["mlflow"]

`UpConfig` is the kernel's RunConfig (core/config.py) plus the head's own sections.
`load_up_config` is what `postrain up` (and `--dry-run`) runs: the file is
validated, then every actor's options against its class's model with
`[shared]` filled in (postrain.core.run_options), then what spans actors (the
scorers: scorer_checks.py), so any bad field of any actor is named before a process starts. The config's own folder goes on the import path
first (`add_import_dir`), for the head and every actor it starts: a module beside the
config file is importable by the name the config gives it. `default_config_path` is the built-in run
(configs/default.toml beside the roles).

It lives here, below the application layer (postrain.cli, whose balancer and trackers the two
sections configure) and the bench (postrain.bench), because both read run configs: the layers
point one way, and the bench may not import the application layer.
"""
from __future__ import annotations

import importlib.resources
import json
import sys
from pathlib import Path
from typing import Literal, cast

from pydantic import BaseModel, ConfigDict, Field, model_validator

from postrain.core.config import RunConfig, load_config, parse_config
from postrain.core.run_options import resolve_options

from .mixture_checks import check_task_kl
from .scorer_checks import check_scorers

DEFAULT_CONFIG = ("postrain.actors.configs", "default.toml")  # package, resource: the built-in run


def default_config_path() -> Path:
    """The built-in run's config file (what `postrain up` runs without --config)."""
    package, resource = DEFAULT_CONFIG
    return Path(str(importlib.resources.files(package).joinpath(resource)))


def add_import_dir(folder: str | Path) -> None:
    """Put `folder` on this process's import path (last: an installed package of the same name
    wins). Actors are spawned with the head's import path (multiprocessing's spawn passes
    sys.path), so every actor of the run imports from it too. Idempotent."""
    entry = str(Path(folder).resolve())
    if entry not in sys.path:
        sys.path.append(entry)


SOURCE_FILE = "source.json"   # in a run folder, beside config.toml: where that config came from


def write_run_source(run_folder: Path, config_path: Path) -> None:
    """Record, beside the run's config.toml copy, the config file it copies and the folder on the
    import path (its folder), for `--resume` and `postrain eval RUN_FOLDER`."""
    config_path = Path(config_path).resolve()
    (Path(run_folder) / SOURCE_FILE).write_text(json.dumps(
        {"config": str(config_path), "import_dir": str(config_path.parent)}))


def run_import_dir(run_folder: Path) -> Path:
    """The import folder of the run in `run_folder` (its source.json), else the folder itself."""
    try:
        return Path(json.loads((Path(run_folder) / SOURCE_FILE).read_text())["import_dir"])
    except (OSError, ValueError, KeyError, TypeError):
        return Path(run_folder)


class BalancerSection(BaseModel):
    """The head's balancer (postrain.cli.balancer): the workers of every pool actor (one whose load
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


class TrackingSection(BaseModel):
    """Mirror the run's metrics rows to experiment trackers (postrain.cli.tracking)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    backends: list[Literal["wandb", "mlflow", "trackio"]] = Field(
        default_factory=list, description="trackers to log to: wandb, mlflow, trackio (each an extra: "
        "pip install 'postrain[wandb]'); none: no tracker is imported")
    project: str = Field("postrain", description="the tracker's project (W&B, trackio) or experiment (MLflow)")
    offline: bool | None = Field(None, description="W&B offline mode; none: offline unless WANDB_API_KEY "
                                 "is set (MLflow and trackio are local unless a server or Space is named)")
    mlflow_tracking_uri: str | None = Field(None, description="MLflow server or store; none: "
                                            "MLFLOW_TRACKING_URI, else a local store in RUN_FOLDER/mlruns")
    trackio_space_id: str | None = Field(None, description="a Hugging Face Space for trackio; none: local")
    interval_s: float = Field(2.0, gt=0, description="how often new metrics rows are sent, seconds")
    samples_every_steps: int = Field(10, ge=0, description="every this many RL steps, a table of that step's "
                                     "samples (prompt, completion, tool output, reward, advantage; from "
                                     "samples.jsonl) goes to each tracker and to TensorBoard as text; 0: none")


class UpConfig(RunConfig):
    """The kernel's RunConfig plus `[balancer]`, `[tracking]` and `[[tasks]]`: a mixture's tables
    (actors/tasks/mixture.py) are a shared setting, moved into `[shared]` as `tasks` when the
    file loads, so the orchestrator and every environment actor read the same mixture."""

    # type ignores: without pydantic's mypy plugin a field's positional Field(default) reads as required
    balancer: BalancerSection = Field(default_factory=BalancerSection)  # type: ignore[arg-type]
    tracking: TrackingSection = Field(default_factory=TrackingSection)  # type: ignore[arg-type]

    @model_validator(mode="before")
    @classmethod
    def _tasks_are_shared(cls, data: object) -> object:
        if not isinstance(data, dict) or "tasks" not in data:
            return data
        shared = dict(data.get("shared") or {})
        if "tasks" in shared:
            raise ValueError("[[tasks]] and [shared] tasks are both set; fix: keep the [[tasks]] tables")
        shared["tasks"] = data["tasks"]
        return {**{k: v for k, v in data.items() if k != "tasks"}, "shared": shared}


def load_up_config(path: str | Path, import_dir: str | Path | None = None) -> UpConfig:
    """The run config at `path`, every actor's options checked; ConfigError naming each bad field.
    `import_dir` (default: the config's own folder) goes on the import path first, so that the
    modules a config names (`task = "my_pkg.reverse:TASK"`) may sit beside it (add_import_dir)."""
    add_import_dir(Path(path).parent if import_dir is None else import_dir)
    config = cast(UpConfig, load_config(path, UpConfig))   # an instance of the schema it is given
    resolve_options(config)
    check_scorers(config)
    check_task_kl(config)
    return config


def parse_up_config(data: dict, source: str = "<config>") -> UpConfig:
    """`load_up_config` for a parsed TOML document."""
    config = cast(UpConfig, parse_config(data, source, UpConfig))   # an instance of the schema it is given
    resolve_options(config)
    check_scorers(config)
    check_task_kl(config)
    return config
