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
    replicas = 2                   # actors echo-0 and echo-1

    [cluster]                      # optional: run across the nodes of a Ray cluster
    address = "auto"

Replicas. An `[[actors]]` entry with `replicas = N` (N > 1) stands for N actors named
NAME-0 .. NAME-(N-1), expanded when the config loads; everything after (placement, the
supervisor, `postrain status`) sees N actors. Another actor's option that names the entry
is rewritten by `resolve_options` (core/run_options.py): a list holding NAME gets the N
replica names in its place; a single name is paired replica for replica when the actor
naming it has the same number of replicas, and is an error otherwise.

Ranks. An entry with `ranks = N` (N > 1) is ONE actor run by N processes that form a
collective group (torch.distributed data parallelism): NAME is rank 0, the one other actors
talk to, and NAME-rank1 .. NAME-rank(N-1) are the others, each placed like any actor. Each
rank's spec carries its `rendezvous` (the group's names, its rank, and where rank 0 hosts
the group's meeting point), which the head completes before starting them
(`complete_rendezvous`). Options naming the entry mean rank 0: nothing is rewritten.

Without a `[cluster]` section the run is on this host, as ever, and nothing of Ray is
imported; the `node` and `placement` hints of a spec apply only with one (core/cluster.py).

Each actor's `options` are validated by the model its class declares
(core/options.py). The layers above add their own sections by subclassing
`RunConfig` (postrain.actors.configs.run_config.UpConfig, what `postrain up` reads, adds
`[balancer]` and `[tracking]`).
"""
from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Callable, Collection, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator,
                      model_validator)

from .errors import ConfigError

_NAME_RULE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,39}$")
_IMPORT_PATH_RULE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


AUTO = "auto"   # the value of a field that the layer starting the run may derive (sizing)
AUTO_SPEC_FIELDS = frozenset({"memory_mb", "start_timeout_s"})


def auto_means_unset(data: object, fields: Collection[str]) -> object:
    """A model's input without the `fields` whose value is AUTO, so they count as unset (not in
    `model_fields_set`) and take their default until a layer above derives them."""
    if isinstance(data, dict):
        return {key: value for key, value in data.items() if not (key in fields and value == AUTO)}
    return data


def _check_name(value: str) -> str:
    if not _NAME_RULE.match(value):
        raise ValueError("must start with a letter and hold only letters, digits, _ and -, "
                         "at most 40 characters")
    return value


Name = Annotated[str, AfterValidator(_check_name)]


class Rendezvous(_Strict):
    """Where the processes of an entry with `ranks > 1` meet: one per rank, made when the config
    loads (names and rank) and completed by the head before the ranks start (rank 0's node
    address and a free port there). Invariant: every rank of a group has the same `names`,
    `address` and `port`; names[rank] is the rank's own actor name."""

    names: list[str] = Field(description="the group's actor names, rank 0 first")
    rank: int = Field(ge=0, description="this process's rank")
    address: str | None = Field(None, description="rank 0's node address (set by the head)")
    port: int | None = Field(None, ge=1, le=65535, description="the meeting port on rank 0's node "
                             "(set by the head)")

    @property
    def world_size(self) -> int:
        return len(self.names)


class ActorSpec(_Strict):
    """What the supervisor needs to start, place and restart one actor."""

    name: Name = Field(description="unique actor name; letters, digits, _ and -, 1-40 chars")
    cls: str = Field(description="import path of the Actor subclass, 'package.module:Class'")
    options: dict[str, Any] = Field(default_factory=dict, description="passed to the actor as self.options")
    cpus: float = Field(1.0, gt=0, description="CPU cores it needs (fractions share a core)")
    elastic: bool | Literal["lend"] = Field(
        False, description="true: its cores may be lent to another elastic actor while it is idle, and it "
        "may borrow theirs while it works (the driver says who works: core/elastic.py); \"lend\": it lends "
        "but never borrows; placed on cores no other elastic actor holds")
    gpus: int = Field(0, ge=0, description="whole GPUs it needs")
    memory_mb: int = Field(512, ge=0, description="host memory it may use, MiB (placement accounting); "
                           "unset or \"auto\": derived from the run's model where `postrain up` sizes the "
                           "actor (docs/your-model.md#sizing), else 512")
    max_restarts: int = Field(3, ge=0, description="restarts after a crash before the supervisor gives up")
    restart_backoff_s: float = Field(0.5, ge=0, description="first restart delay; doubles each restart")
    start_timeout_s: float = Field(60.0, gt=0, description="how long an actor may stay silent (no heartbeat) "
                                   "before READY; a setup that heartbeats (they come from a thread) may run longer; "
                                   "unset or \"auto\": derived from the run's model where `postrain up` sizes the "
                                   "actor (docs/your-model.md#sizing), else 60")
    stop_timeout_s: float = Field(5.0, gt=0, description="wait after STOP before a kill")
    bind: str = Field("ipc", description="'ipc' (one host) or a tcp address like 'tcp://0.0.0.0:5555'")
    replicas: int = Field(1, ge=1, le=1024, description="copies of this actor: N > 1 starts actors NAME-0 .. "
                          "NAME-(N-1), each with these needs and options")
    ranks: int = Field(1, ge=1, le=1024, description="processes that act as ONE actor (a collective "
                       "group, e.g. data parallelism over torch.distributed): N > 1 starts NAME (rank 0, the "
                       "one other actors talk to) and NAME-rank1 .. NAME-rank(N-1), each with these needs and "
                       "options")
    rendezvous: Rendezvous | None = Field(None, description="set when the config loads and by the head, "
                                          "for each rank of an entry with ranks > 1; never in a config file")
    node: str | None = Field(None, description="[cluster] only: the node to run on (a node name as "
                             "`postrain up --dry-run` lists them); none: any node with room")
    bulk_key: bool | None = Field(None, description="whether this actor is given the run's bulk key (it seals "
                                  "weights between nodes: core/sealed.py); none: as its class declares "
                                  "(Actor.needs_bulk_key)")
    placement: Literal["pack", "spread"] = Field("pack", description="[cluster] only, where `node` is unset: "
                                                 "'pack' takes the first node with room, in the cluster's "
                                                 "order; 'spread' the node holding the fewest replicas of "
                                                 "this entry (then the most free cores)")

    @model_validator(mode="before")
    @classmethod
    def _auto_means_unset(cls, data: object) -> object:
        return auto_means_unset(data, AUTO_SPEC_FIELDS)

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
    heartbeat_timeout_s: float = Field(30.0, gt=0, description="silence after which an actor counts as hung and "
                                       "is restarted; unset or \"auto\": `postrain up` derives it from the run's "
                                       "model and this machine (docs/your-model.md#sizing), else 30")
    bind: str = Field("ipc", description="the head's control socket: 'ipc' or 'tcp://HOST:PORT'")
    stop_grace_s: float = Field(120.0, gt=0, description="after `postrain down` or a first Ctrl-C, how long "
                                "the run's driver has to finish its step and checkpoint before every actor "
                                "is stopped anyway")
    metrics_port: int = Field(0, ge=-1, le=65535, description="the head's Prometheus endpoint "
                              "(http://metrics_host:PORT/metrics, also in head.json): 0 picks a free port, "
                              "-1 turns it off")
    metrics_host: str = Field("127.0.0.1", description="address the Prometheus endpoint listens on "
                              "(loopback by default; '0.0.0.0' exposes it, unauthenticated)")

    @model_validator(mode="before")
    @classmethod
    def _auto_means_unset(cls, data: object) -> object:
        return auto_means_unset(data, {"heartbeat_timeout_s"})

    @model_validator(mode="after")
    def _check_timeout(self) -> HeadSection:
        if self.heartbeat_timeout_s <= 2 * self.heartbeat_interval_s:
            raise ValueError(f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed twice "
                             f"heartbeat_interval_s ({self.heartbeat_interval_s})")
        return self


class ClusterSection(_Strict):
    """Where a run spans several machines: the Ray cluster whose nodes it uses."""

    address: str = Field(description="the Ray cluster: 'auto' (this machine already belongs to one: "
                         "`ray start`) or the head's HOST:PORT, e.g. '10.0.0.1:6379'")
    connect_timeout_s: float = Field(30.0, gt=0, le=600, description="how long `postrain up` waits for the "
                                     "head's address to accept a connection before it fails naming it")
    node_timeout_s: float = Field(10.0, gt=0, le=600, description="a node whose agent has not answered the "
                                  "head for this long (2 s once its connection closed), or that Ray reports "
                                  "dead, is lost: its actors are placed again on nodes with room")

    @field_validator("address")
    @classmethod
    def _check_address(cls, value: str) -> str:
        if value != "auto" and not re.match(r"^[^\s:/]+:\d+$", value):
            raise ValueError("must be 'auto' or HOST:PORT of the Ray head (e.g. '10.0.0.1:6379')")
        return value


class RunConfig(_Strict):
    """A run: the head's settings and the actors. The layers above extend it with their own
    sections by subclassing (postrain.actors.configs.run_config.UpConfig adds `[balancer]` and
    `[tracking]`); a table no section declares is an error, so a misspelt section name cannot
    be ignored."""

    run: RunSection = Field(default_factory=RunSection)
    head: HeadSection = Field(default_factory=HeadSection)
    shared: dict[str, Any] = Field(default_factory=dict, description="settings several actors read, stated "
                                   "once: each actor whose options declare a field of that name gets the value")
    actors: list[ActorSpec] = Field(default_factory=list)
    cluster: ClusterSection | None = Field(None, description="run across a Ray cluster's nodes; none: "
                                           "this host only (nothing of Ray is imported)")
    # Replica name -> (its entry's name, its index, the entry's number of replicas); set once at
    # validation, when each entry with replicas > 1 is expanded into its replicas.
    _replica_of: dict[str, tuple[str, int, int]] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _expand_and_check_names(self) -> RunConfig:
        expanded: list[ActorSpec]
        replica_of: dict[str, tuple[str, int, int]]
        expanded, replica_of = [], {}
        for spec in self.actors:
            if spec.rendezvous is not None and spec.ranks == 1:
                raise ValueError(f"actor {spec.name!r} sets rendezvous, which postrain sets for the ranks "
                                 "of an entry with ranks > 1; remove it (and set ranks = N)")
            if spec.ranks > 1:
                expanded += _expand_ranks(spec)
                continue
            if spec.replicas == 1:
                expanded.append(spec)
                continue
            for index in range(spec.replicas):
                name = f"{spec.name}-{index}"
                if not _NAME_RULE.match(name):
                    raise ValueError(f"actor {spec.name!r} with replicas = {spec.replicas}: replica name "
                                     f"{name!r} is over 40 characters; shorten the name")
                expanded.append(spec.model_copy(update={"name": name, "replicas": 1}))
                replica_of[name] = (spec.name, index, spec.replicas)
        self.actors[:] = expanded      # in place: assigning would validate the config again
        self._replica_of = replica_of
        seen: set[str] = set()
        for spec in self.actors:
            if spec.name in seen:
                raise ValueError(f"actor name {spec.name!r} is used twice; names must be unique "
                                 "(an entry with replicas = N also takes the names NAME-0 .. NAME-(N-1))")
            seen.add(spec.name)
            if spec.node is not None and self.cluster is None:
                raise ValueError(f"actor {spec.name!r} sets node = {spec.node!r}, which applies only with a "
                                 "[cluster] section; remove node or add [cluster]")
        groups = {group for group, _, _ in replica_of.values()}
        if self.run.driver in groups:
            raise ValueError(f"run.driver = {self.run.driver!r} has replicas; a run has one driver: name "
                             "one replica or give the driver replicas = 1")
        if self.run.driver is not None and self.run.driver not in seen:
            raise ValueError(f"run.driver = {self.run.driver!r} names no actor; actors: {sorted(seen)}")
        return self

    def rank_groups(self) -> dict[str, list[str]]:
        """Each entry with ranks > 1: its name (rank 0's) -> its ranks' names, rank 0 first."""
        return {spec.name: list(spec.rendezvous.names) for spec in self.actors
                if spec.rendezvous is not None and spec.rendezvous.rank == 0}

    def replica_groups(self) -> dict[str, list[str]]:
        """Each entry with replicas > 1: its name -> its replicas' names, in order."""
        groups: dict[str, list[str]] = {}
        for name, (group, _, _) in self._replica_of.items():
            groups.setdefault(group, []).append(name)
        return groups

    def replica_of(self, name: str) -> tuple[str, int, int] | None:
        """(entry name, index, number of replicas) of replica `name`; None for a lone actor."""
        return self._replica_of.get(name)


def _expand_ranks(spec: ActorSpec) -> list[ActorSpec]:
    """The N processes of an entry with ranks = N: NAME (rank 0), NAME-rank1 .. NAME-rank(N-1)."""
    if spec.replicas > 1:
        raise ValueError(f"actor {spec.name!r} sets both replicas = {spec.replicas} and ranks = "
                         f"{spec.ranks}; one entry is either several actors (replicas) or one actor of several "
                         "processes (ranks): make two entries")
    names = [spec.name] + [f"{spec.name}-rank{rank}" for rank in range(1, spec.ranks)]
    if not _NAME_RULE.match(names[-1]):
        raise ValueError(f"actor {spec.name!r} with ranks = {spec.ranks}: rank name {names[-1]!r} is over "
                         "40 characters; shorten the name")
    return [spec.model_copy(update={"name": name, "ranks": 1,
                                    "rendezvous": Rendezvous(names=names, rank=rank)})
            for rank, name in enumerate(names)]


def complete_rendezvous(specs: list[ActorSpec], meeting_point: Callable[[str], tuple[str, int]]) -> None:
    """Give every rank of every group the address and port where its rank 0 hosts the group:
    `meeting_point(rank0_name) -> (address, port)`, asked once per group (the head picks a free
    port on rank 0's node). In place; specs without a rendezvous are left alone."""
    points: dict[str, tuple[str, int]] = {}
    for spec in specs:
        if spec.rendezvous is None:
            continue
        group = spec.rendezvous.names[0]
        if group not in points:
            points[group] = meeting_point(group)
        address, port = points[group]
        spec.rendezvous = spec.rendezvous.model_copy(update={"address": address, "port": port})


def parse_config(data: dict[str, Any], source: str = "<config>", schema: type[RunConfig] = RunConfig) -> RunConfig:
    """Validate a parsed TOML document against `schema` (RunConfig or a subclass of it)."""
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None


def load_config(path: str | Path, schema: type[RunConfig] = RunConfig) -> RunConfig:
    return parse_config(read_toml(path), str(path), schema)


def read_toml(path: str | Path) -> dict[str, Any]:
    """The TOML document at `path`, unchecked; ConfigError when it cannot be read or parsed."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}; pass an existing TOML file") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None


def format_validation_error(exc: ValidationError, source: str, prefix: str = "") -> str:
    lines = [f"{source}: {exc.error_count()} bad field(s):"]
    lines += [f"  {line}" for line in validation_lines(exc, prefix)]
    return "\n".join(lines)


def validation_lines(exc: ValidationError, prefix: str = "") -> list[str]:
    """One line per bad field: `path.to.field = value: rule`."""
    lines = []
    for error in exc.errors():
        location = (prefix + ".".join(str(part) for part in error["loc"])).rstrip(".") or "(top level)"
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            message = "unknown field (check the spelling; see the config reference in the docs)"
        value = error.get("input")
        shown = "" if isinstance(value, dict) or error["type"] == "missing" else f" = {value!r}"
        lines.append(f"{location}{shown}: {message}")
    return lines
