"""Run configuration: one TOML file, validated on load.

Every field has a unit in its name where it has one, a default, and a line
saying where it applies. A bad file raises `ConfigError` listing each bad
field as `path.to.field = value: rule`. Unknown fields are errors too (a typo
must not silently fall back to a default).

    [run]
    name = "tiny"                  # run name; the run folder is run_dir/name
    run_dir = "runs"

    [head]
    heartbeat_interval_s = 1.0

    [shared]                       # settings several actors read (core/options.py)
    model = "tiny"

    [[actors]]
    name = "echo"
    cls = "postrain.core.testing:EchoActor"
    cpus = 0.5

Each actor's `options` are validated by the model its class declares
(core/options.py). The application layer adds its own sections by
subclassing `RunConfig` (postrain.cli.config adds `[balancer]`).
"""
from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ConfigError

_NAME_RULE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,39}$")
_IMPORT_PATH_RULE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _check_name(value: str) -> str:
    if not _NAME_RULE.match(value):
        raise ValueError("must start with a letter and hold only letters, digits, _ and -, "
                         "at most 40 characters")
    return value


Name = Annotated[str, AfterValidator(_check_name)]


class ActorSpec(_Strict):
    """What the supervisor needs to start, place and restart one actor."""

    name: Name = Field(description="unique actor name; letters, digits, _ and -, 1-40 chars")
    cls: str = Field(description="import path of the Actor subclass, 'package.module:Class'")
    options: dict[str, Any] = Field(default_factory=dict, description="passed to the actor as self.options")
    cpus: float = Field(1.0, gt=0, description="CPU cores it needs (fractions share a core)")
    gpus: int = Field(0, ge=0, description="whole GPUs it needs")
    memory_mb: int = Field(512, ge=0, description="host memory it may use, MiB (placement accounting)")
    max_restarts: int = Field(3, ge=0, description="restarts after a crash before the supervisor gives up")
    restart_backoff_s: float = Field(0.5, ge=0, description="first restart delay; doubles each restart")
    start_timeout_s: float = Field(60.0, gt=0, description="how long an actor may stay silent (no heartbeat) "
                                   "before READY; a setup that heartbeats (they come from a thread) may run longer")
    stop_timeout_s: float = Field(5.0, gt=0, description="wait after STOP before a kill")
    bind: str = Field("ipc", description="'ipc' (one host) or a tcp address like 'tcp://0.0.0.0:5555'")

    @field_validator("cls")
    @classmethod
    def _check_cls(cls, value: str) -> str:
        if not _IMPORT_PATH_RULE.match(value):
            raise ValueError("must be an import path like 'package.module:ClassName'")
        return value

    @field_validator("bind")
    @classmethod
    def _check_bind(cls, value: str) -> str:
        if value != "ipc" and not re.match(r"^tcp://[^:]+:\d+$", value):
            raise ValueError("must be 'ipc' or 'tcp://HOST:PORT' (PORT 0 picks a free port)")
        return value


class RunSection(_Strict):
    name: Name = Field("run", description="run name; the run folder is run_dir/name")
    run_dir: str = Field("runs", description="folder holding run folders (checkpoints, logs, metrics)")
    driver: str | None = Field(None, description="actor that drives the run: `postrain up` streams its "
                               "`run` handler's progress and stops the run when it ends; none: run until "
                               "`postrain down` or Ctrl-C")


class HeadSection(_Strict):
    heartbeat_interval_s: float = Field(1.0, gt=0, description="how often actors report to the head")
    heartbeat_timeout_s: float = Field(30.0, gt=0, description="silence after which an actor counts as hung and is restarted")
    bind: str = Field("ipc", description="the head's control socket: 'ipc' or 'tcp://HOST:PORT'")
    stop_grace_s: float = Field(120.0, gt=0, description="after `postrain down` or a first Ctrl-C, how long "
                                "the run's driver has to finish its step and checkpoint before every actor "
                                "is stopped anyway")
    metrics_port: int = Field(0, ge=-1, le=65535, description="the head's Prometheus endpoint "
                              "(http://metrics_host:PORT/metrics, also in head.json): 0 picks a free port, "
                              "-1 turns it off")
    metrics_host: str = Field("127.0.0.1", description="address the Prometheus endpoint listens on "
                              "(loopback by default; '0.0.0.0' exposes it, unauthenticated)")

    @model_validator(mode="after")
    def _check_timeout(self):
        if self.heartbeat_timeout_s <= 2 * self.heartbeat_interval_s:
            raise ValueError(f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed twice "
                             f"heartbeat_interval_s ({self.heartbeat_interval_s})")
        return self


class RunConfig(_Strict):
    """A run: the head's settings and the actors. The application layer extends it with its own
    sections by subclassing (postrain.cli.config.UpConfig adds `[balancer]`); a table no section
    declares is an error, so a misspelt section name cannot be ignored."""

    run: RunSection = Field(default_factory=RunSection)
    head: HeadSection = Field(default_factory=HeadSection)
    shared: dict[str, Any] = Field(default_factory=dict, description="settings several actors read, stated "
                                   "once: each actor whose options declare a field of that name gets the value")
    actors: list[ActorSpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_names(self):
        seen = set()
        for spec in self.actors:
            if spec.name in seen:
                raise ValueError(f"actor name {spec.name!r} is used twice; names must be unique")
            seen.add(spec.name)
        if self.run.driver is not None and self.run.driver not in seen:
            raise ValueError(f"run.driver = {self.run.driver!r} names no actor; actors: {sorted(seen)}")
        return self


def parse_config(data: dict, source: str = "<config>", schema: type[RunConfig] = RunConfig) -> RunConfig:
    """Validate a parsed TOML document against `schema` (RunConfig or a subclass of it)."""
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None


def load_config(path: str | Path, schema: type[RunConfig] = RunConfig) -> RunConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}; pass an existing TOML file") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    return parse_config(data, str(path), schema)


def format_validation_error(exc: ValidationError, source: str, prefix: str = "") -> str:
    lines = [f"{source}: {exc.error_count()} bad field(s):"]
    lines += [f"  {line}" for line in validation_lines(exc, prefix)]
    return "\n".join(lines)


def validation_lines(exc: ValidationError, prefix: str = "") -> list[str]:
    """One line per bad field: `path.to.field = value: rule`."""
    lines = []
    for error in exc.errors():
        location = prefix + ".".join(str(part) for part in error["loc"]) or "(top level)"
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown field (check the spelling; see the config reference in the docs)"
        value = error.get("input")
        shown = "" if isinstance(value, dict) or error["type"] == "missing" else f" = {value!r}"
        lines.append(f"{location}{shown}: {message}")
    return lines
